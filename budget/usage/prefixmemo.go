package usage

import "bytes"

// maxMemoPrefix bounds the bytes a prefixMemo keeps: real shared prefixes
// are about a hundred bytes.
const maxMemoPrefix = 1024

// prefixMemo lets the meter skip what an event shares with the one before
// it. The events of a stream mostly start alike (a chat chunk's id, object,
// created and model; a content_block_delta's type and index) and only then
// carry what matters. The memo keeps the longest run of leading top-level
// members of the last event that set nothing but its kind, with the comma
// after them: an event that starts with the same bytes is valid up to there
// and reads the same there, so its scan resumes at that comma.
//
// A prefix of up to len(small) bytes is kept in small, inside the Meter: it
// holds no pointer that an event would rewrite (a pointer written to the
// heap costs a write barrier while the GC runs).
type prefixMemo struct {
	big     []byte    // the prefix when it is longer than small
	n       int32     // the length of the last event's bytes up to the comma after the run
	members int32     // how many members the run holds
	end     int32     // how far the run of the event being read got
	kind    eventKind // the kind the run sets
	small   [120]byte
}

// prefix is the kept prefix.
func (p *prefixMemo) prefix() []byte {
	if p.n <= int32(len(p.small)) {
		return p.small[:p.n]
	}
	return p.big[:p.n]
}

// resume starts reading the event s.b: when it starts with the run, the
// scan moves past it and ev gets the kind it held; resume returns how many
// members it skipped.
func (p *prefixMemo) resume(s *scanner, ev *event) int {
	p.end = 0
	n := int(p.n)
	if n == 0 || len(s.b) <= n || !bytes.Equal(s.b[:n], p.prefix()) {
		p.n, p.members, p.kind = 0, 0, kindOther
		return 0
	}
	p.end = p.n
	s.i, ev.kind = n-1, p.kind // at the comma
	return int(p.members)
}

// reached records that the event's run extends to end (just past a comma),
// holding members members and setting kind.
func (p *prefixMemo) reached(end, members int, kind eventKind) {
	if end > int(p.end) && end <= maxMemoPrefix {
		p.end, p.members, p.kind = int32(end), int32(members), kind
	}
}

// finish keeps the run of event, the event just read, for the next event.
func (p *prefixMemo) finish(event []byte) {
	if p.end <= p.n {
		return
	}
	if p.end <= int32(len(p.small)) {
		copy(p.small[p.n:p.end], event[p.n:p.end])
	} else {
		if p.n <= int32(len(p.small)) {
			p.big = append(p.big[:0], p.small[:p.n]...)
		}
		p.big = append(p.big[:p.n], event[p.n:p.end]...)
	}
	p.n = p.end
}
