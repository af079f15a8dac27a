// measure.mjs — how many tokens real tokenizers give a streamed output text,
// against the byte-count bound  estimate = ceil(asciiBytes/A) + ceil(highBytes/B)
// where the bytes are those of the text as a JSON string body (raw UTF-8 for
// non-ASCII; \n, \" etc. count 2, \uXXXX counts 6 ASCII bytes).
//
// Run (needs node >= 18 and the packages, installed outside the repo):
//   mkdir -p /tmp/tok && cd /tmp/tok && npm init -y && npm install gpt-tokenizer @anthropic-ai/tokenizer
//   cd /tmp/tok && node /path/to/fleetguard/bench/tokenbound/measure.mjs > /path/to/fleetguard/bench/results/tokenbound.txt
// (the synthetic corpora are regenerated with: node bench/tokenbound/gen.mjs)
//
// Tokenizers: o200k_base (GPT-4o/4.1/o-series/5), cl100k_base (GPT-4/3.5),
// claude = @anthropic-ai/tokenizer (the published Claude 2 era BPE; Claude 3+
// tokenizers are not public, so treat that column as indicative only).
import { readFileSync, readdirSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const require = createRequire(join(process.cwd(), 'x.js'));
const here = dirname(fileURLToPath(import.meta.url));
const corpusDir = join(here, 'corpus');
const streamsDir = join(here, '..', '..', 'budget', 'usage', 'testdata', 'streams');

// ---- tokenizers: encode(text) -> ids, tokenBytes(id) -> Uint8Array
const enc = new TextEncoder();
function gptTok(name) {
  const m = require(`gpt-tokenizer/cjs/encoding/${name}`);
  const core = m.default?.bytePairEncodingCoreProcessor ?? m.bytePairEncodingCoreProcessor;
  return {
    name: name.replace('_base', ''),
    encode: (t) => m.encode(t),
    tokenBytes: (id) => {
      for (const p of core.decodeNativeGenerator([id])) return typeof p === 'string' ? enc.encode(p) : p;
      return new Uint8Array();
    },
  };
}
const toks = [gptTok('o200k_base'), gptTok('cl100k_base')];
try {
  const { getTokenizer } = require('@anthropic-ai/tokenizer');
  const t = getTokenizer();
  toks.push({
    name: 'claude',
    encode: (s) => Array.from(t.encode(s.normalize('NFKC'), 'all')),
    tokenBytes: (id) => t.decode(Uint32Array.of(id)),
  });
} catch (e) { console.log('# claude tokenizer unavailable:', e.message); }

// ---- byte classes of a text as a JSON string body
function jsonBody(s, asciiOnly) {
  let j = JSON.stringify(s).slice(1, -1);
  if (asciiOnly) j = j.replace(/[\u0080-\uffff]/g, (c) => '\\u' + c.charCodeAt(0).toString(16).padStart(4, '0'));
  return j;
}
function classify(s, asciiOnly = false) {
  const b = enc.encode(jsonBody(s, asciiOnly));
  let hi = 0;
  for (const x of b) if (x >= 0x80) hi++;
  return { a: b.length - hi, h: hi };
}
const est = (a, h, A, B) => Math.ceil(a / A) + Math.ceil(h / B);

// Streamed chunks: one per token, incomplete UTF-8 held back as a provider does.
function chunks(tok, ids) {
  const d = new TextDecoder('utf-8');
  return ids.map((id) => d.decode(tok.tokenBytes(id), { stream: true }));
}

// ---- corpora
const corpora = readdirSync(corpusDir).sort().map((f) => ({
  name: f.replace(/\.[^.]+$/, ''), adv: f.startsWith('adv_'), texts: [readFileSync(join(corpusDir, f), 'utf8')],
}));

// Golden transcripts: the generated text of each stream (text, thinking,
// tool-call argument deltas), one text per stream.
const keys = new Set(['text', 'thinking', 'content', 'response', 'delta', 'partial_json', 'arguments', 'reasoning_content', 'reasoning', 'refusal']);
function collect(v, out, key) {
  if (typeof v === 'string') { if (keys.has(key)) out.push(v); return; }
  if (Array.isArray(v)) { for (const x of v) collect(x, out, key); return; }
  if (v && typeof v === 'object') for (const [k, x] of Object.entries(v)) collect(x, out, k);
}
const golden = [];
for (const f of readdirSync(streamsDir).sort()) {
  if (f.endsWith('.golden')) continue;
  const parts = [];
  for (let line of readFileSync(join(streamsDir, f), 'utf8').split(/\r?\n/)) {
    line = line.replace(/^data:\s?/, '');
    let v; try { v = JSON.parse(line); } catch { continue; }
    // skip events that repeat the whole output (Responses *.done / completed)
    if (typeof v?.type === 'string' && (/\.done$/.test(v.type) || /^response\.(completed|incomplete|failed|created|in_progress)$/.test(v.type))) continue;
    collect(v, parts, '');
  }
  const t = parts.join('');
  if (t) golden.push({ file: f, text: t });
}
corpora.push({ name: 'golden_streams', adv: false, golden: true, texts: golden.map((g) => g.text), files: golden.map((g) => g.file) });

// ---- measure
const pairs = [[4, 2], [3.5, 2], [3, 2], [4, 1.5], [3, 1.5], [2.5, 1], [2.5, 1.5], [2, 1.5], [2, 1]];
const rows = [];
for (const c of corpora) for (const tok of toks) {
  const per = c.texts.map((text) => {
    const ids = tok.encode(text);
    return { text, ids, raw: classify(text), esc: classify(text, true), ch: chunks(tok, ids) };
  });
  rows.push({ c, tok, per });
}
const sum = (xs, f) => xs.reduce((s, x) => s + f(x), 0);
// estimate summed over streams (ceil once per stream)
const E = (r, A, B, mode = 'raw') => sum(r.per, (p) => est(p[mode].a, p[mode].h, A, B));
const T = (r) => sum(r.per, (p) => p.ids.length);
const minStream = (r, A, B, mode = 'raw') => Math.min(...r.per.map((p) => est(p[mode].a, p[mode].h, A, B) / p.ids.length));
// per-chunk ceil (what summing ceil per delta would give)
const Echunk = (r, A, B) => sum(r.per, (p) => sum(p.ch, (s) => { const k = classify(s); return (k.a ? Math.ceil(k.a / A) : 0) + (k.h ? Math.ceil(k.h / B) : 0); }));
// running count: min over token boundaries k of est(streamed prefix)/k
function minPrefix(r, A, B) {
  let m = Infinity; r.deficit = 0;
  for (const p of r.per) {
    let a = 0, h = 0;
    p.ch.forEach((s, i) => { const k = classify(s); a += k.a; h += k.h; const e = est(a, h, A, B); m = Math.min(m, e / (i + 1)); r.deficit = Math.max(r.deficit, i + 1 - e); });
  }
  return m;
}
const f2 = (x) => x.toFixed(2) + (x < 1 ? '!' : ' ');
const pad = (s, n) => String(s).padEnd(n);
const lpad = (s, n) => String(s).padStart(n);

console.log('# Token bound: estimate = ceil(asciiBytes/A) + ceil(highBytes/B), bytes of the JSON string body');
console.log(`# node ${process.version}; tokenizers: ${toks.map((t) => t.name).join(', ')}; "!" marks an under-count (factor < 1)`);
console.log('# golden_streams: ' + golden.length + ' transcripts, ceil applied once per stream, factors are sum(est)/sum(tokens); "min" columns below give the worst single stream\n');
console.log('## 1. Whole text, raw UTF-8 in JSON (factor = estimate/tokens)\n');
console.log(pad('corpus', 17) + pad('tok', 7) + lpad('ascii', 6) + lpad('high', 6) + lpad('tokens', 7) + lpad('B/tok', 6) + pairs.map(([A, B]) => lpad(`${A},${B}`, 8)).join(''));
for (const r of rows) {
  const a = sum(r.per, (p) => p.raw.a), h = sum(r.per, (p) => p.raw.h), t = T(r);
  console.log(pad(r.c.name + (r.c.adv ? '*' : ''), 17) + pad(r.tok.name, 7) + lpad(a, 6) + lpad(h, 6) + lpad(t, 7) + lpad(((a + h) / t).toFixed(2), 6) + pairs.map(([A, B]) => lpad(f2(E(r, A, B) / t), 8)).join(''));
}
console.log('(* adversarial)\n');

console.log('## 2. Same texts with non-ASCII sent as \\uXXXX escapes (ensure_ascii JSON encoders), corpora with non-ASCII only\n');
console.log(pad('corpus', 17) + pad('tok', 7) + lpad('ascii', 6) + lpad('tokens', 7) + pairs.map(([A, B]) => lpad(`${A},${B}`, 8)).join(''));
for (const r of rows) {
  if (sum(r.per, (p) => p.raw.h) === 0 || r.c.golden) continue;
  const t = T(r);
  console.log(pad(r.c.name, 17) + pad(r.tok.name, 7) + lpad(sum(r.per, (p) => p.esc.a), 6) + lpad(t, 7) + pairs.map(([A, B]) => lpad(f2(E(r, A, B, 'esc') / t), 8)).join(''));
}
console.log('');

// ---- largest A, B. Estimate is non-increasing in A and in B, so scan a grid.
const grid = (lo, hi, step) => { const g = []; for (let x = lo; x <= hi + 1e-9; x += step) g.push(Math.round(x * 100) / 100); return g; };
const Ag = grid(1, 8, 0.05), Bg = grid(0.25, 8, 0.05);
const ok = (rs, A, B) => rs.every((r) => r.per.every((p) => est(p.raw.a, p.raw.h, A, B) >= p.ids.length));
const maxA = (rs) => { let m = null; for (const A of Ag) if (ok(rs, A, 1e9) || rs.every((r) => r.per.every((p) => p.raw.h === 0 ? est(p.raw.a, 0, A, 1) >= p.ids.length : true))) m = A; return m; };
const maxB = (rs, A) => { let m = null; for (const B of Bg) if (ok(rs, A, B)) m = B; return m; };
const asciiOnly = (r) => sum(r.per, (p) => p.raw.h) === 0;

console.log('## 3. Largest A and B that never under-count (grid step 0.05; each text/stream checked on its own)\n');
console.log('A is bounded by the ASCII-only corpora; B is then the largest value that keeps every corpus (incl. mixed) >= tokens at that A.\n');
const nonAdv = rows.filter((r) => !r.c.adv);
const scopes = [...toks.map((t) => [t.name, nonAdv.filter((r) => r.tok === t)]), ['overall', nonAdv]];
for (const [name, rs] of scopes) {
  const A = maxA(rs.filter(asciiOnly));
  const lim = rs.filter(asciiOnly).map((r) => [r.c.name, maxA([r])]).sort((x, y) => x[1] - y[1]).slice(0, 3);
  const line = [2, 2.5, 3, 3.5, 4].filter((a) => a <= A + 1e-9).map((a) => `B(A=${a})=${maxB(rs, a)}`).join('  ');
  console.log(`${pad(name, 8)} maxA=${A} (tightest: ${lim.map(([n, a]) => `${n} ${a}`).join(', ')})  maxB at maxA=${maxB(rs, A)}  ${line}`);
}
{ // golden checked as one concatenated corpus instead of stream by stream
  const merged = nonAdv.map((r) => r.c.golden ? { ...r, per: [{ raw: { a: sum(r.per, (p) => p.raw.a), h: 0 }, ids: { length: T(r) } }] } : r);
  console.log(`overall, golden_streams summed (not per stream): maxA=${maxA(merged.filter(asciiOnly))}  B(A=2)=${maxB(merged, 2)}  B(A=2.5)=${maxB(merged, 2.5)}`);
}
console.log('\nPer corpus (non-adversarial), largest B that holds at A = 2 / 2.5 / 3 / 3.5 / 4 (– = the corpus under-counts at that A whatever B; any = no high bytes):');
for (const r of nonAdv) {
  const cell = (A) => { if (asciiOnly(r)) return ok([r], A, 1e9) ? 'any' : '–'; const b = maxB([r], A); return b === null ? '–' : b; };
  console.log('  ' + pad(r.c.name, 17) + pad(r.tok.name, 7) + [2, 2.5, 3, 3.5, 4].map((A) => lpad(cell(A), 6)).join(''));
}
console.log('\nAdversarial corpora (ASCII only): A they need = asciiBytes/tokens');
for (const r of rows.filter((r) => r.c.adv)) console.log('  ' + pad(r.c.name, 17) + pad(r.tok.name, 7) + ' needs A <= ' + maxA([r]) + '  (bytes/token ' + (sum(r.per, (p) => p.raw.a) / T(r)).toFixed(2) + ')');
console.log('');

// ---- the recommended pair in detail
const recs = [[2, 1.5], [2.5, 1.5], [3, 1.5]];
for (const [A, B] of recs) {
  console.log(`## 4. (A,B) = (${A},${B}): whole-stream factor, worst single stream, per-token-chunk ceil, running count (prefix = min over token-boundary prefixes of est/tokens so far; lag = most tokens the running count trails by), \\u-escaped\n`);
  console.log(pad('corpus', 17) + pad('tok', 7) + lpad('whole', 8) + lpad('min', 8) + lpad('chunk', 8) + lpad('prefix', 8) + lpad('lag', 5) + lpad('\\u', 8));
  for (const r of rows) {
    const t = T(r);
    const escf = sum(r.per, (p) => p.raw.h) ? f2(E(r, A, B, 'esc') / t) : '';
    console.log(pad(r.c.name + (r.c.adv ? '*' : ''), 17) + pad(r.tok.name, 7) + lpad(f2(E(r, A, B) / t), 8) + lpad(f2(minStream(r, A, B)), 8) + lpad(f2(Echunk(r, A, B) / t), 8) + lpad(f2(minPrefix(r, A, B)), 8) + lpad(r.deficit, 5) + lpad(escf, 8));
  }
  console.log('');
}

console.log('## 5. Golden stream texts (o200k tokens shown)\n');
const go = rows.find((r) => r.c.golden && r.tok.name === 'o200k');
go.per.forEach((p, i) => console.log('  ' + pad(golden[i].file, 44) + lpad(p.ids.length, 4) + ' tok  ' + JSON.stringify(p.text).slice(0, 70)));
