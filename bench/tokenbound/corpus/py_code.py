"""Small utilities for parsing and summarising web server access logs."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import re
import sys
from typing import Iterable, Iterator

LINE_RE = re.compile(
    r'(?P<ip>\S+) \S+ \S+ \[(?P<ts>[^\]]+)\] '
    r'"(?P<method>[A-Z]+) (?P<path>\S+) (?P<proto>[^"]+)" '
    r'(?P<status>\d{3}) (?P<size>\d+|-)'
)


@dataclasses.dataclass(frozen=True)
class Hit:
    ip: str
    when: dt.datetime
    method: str
    path: str
    status: int
    size: int


def parse(lines: Iterable[str]) -> Iterator[Hit]:
    """Yield a Hit for every line that matches the combined log format."""
    for lineno, line in enumerate(lines, start=1):
        m = LINE_RE.match(line)
        if not m:
            print(f"skipping line {lineno}: {line[:60]!r}", file=sys.stderr)
            continue
        when = dt.datetime.strptime(m["ts"], "%d/%b/%Y:%H:%M:%S %z")
        size = 0 if m["size"] == "-" else int(m["size"])
        yield Hit(m["ip"], when, m["method"], m["path"], int(m["status"]), size)


def summarise(hits: Iterable[Hit], top: int = 10) -> dict[str, object]:
    by_status: collections.Counter[int] = collections.Counter()
    by_path: collections.Counter[str] = collections.Counter()
    bytes_total = 0
    first = last = None
    for h in hits:
        by_status[h.status // 100 * 100] += 1
        by_path[h.path.split("?", 1)[0]] += 1
        bytes_total += h.size
        first = h.when if first is None or h.when < first else first
        last = h.when if last is None or h.when > last else last
    span = (last - first).total_seconds() if first and last else 0.0
    return {
        "requests": sum(by_status.values()),
        "bytes": bytes_total,
        "span_seconds": span,
        "status_classes": dict(sorted(by_status.items())),
        "top_paths": by_path.most_common(top),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="*", help="log files (default: stdin)")
    ap.add_argument("--top", type=int, default=10, help="how many paths to list")
    args = ap.parse_args(argv)

    def lines() -> Iterator[str]:
        if not args.files:
            yield from sys.stdin
            return
        for name in args.files:
            with open(name, encoding="utf-8", errors="replace") as fh:
                yield from fh

    report = summarise(parse(lines()), top=args.top)
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, list):
            print(f"{key:<{width}} :")
            for path, count in value:
                print(f"    {count:>8}  {path}")
        else:
            print(f"{key:<{width}} : {value}")
    return 0 if report["requests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
