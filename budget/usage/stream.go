package usage

import (
	"bytes"

	"github.com/fleetguard/fleetguard/budget"
)

// MaxEventBytes bounds what the meter keeps of one SSE event or NDJSON line.
// A larger one passes through to the client untouched; the meter counts its
// bytes as generated text and does not parse it. Usage events are small.
const MaxEventBytes = 1 << 20

// Framing is how a streamed response separates its events.
type Framing uint8

const (
	// SSE is text/event-stream: data: lines, events end at a blank line.
	SSE Framing = iota
	// NDJSON is one JSON object per line (Ollama's native streaming).
	NDJSON
)

// Meter reads usage from a streamed response as its bytes pass, keeping at
// most one event (MaxEventBytes), and the first KiB of the one before it
// (prefixMemo), in memory whatever the stream's length or line length. Any
// split of the stream into Writes gives the same result.
type Meter struct {
	// The fields with pointers come first: the GC scans a Meter only up to
	// the last of them.
	line []byte // the current line, without its terminator
	// data holds the data of the current SSE event from dataStart on: a cut
	// data line is taken over from line whole, its "data: " before
	// dataStart, rather than copied. line and data trade their rooms so
	// that one mostly serves both.
	data []byte
	// template, when not nil, is the last event read in full, against
	// which the next is compared first (see eventTemplate); noTemplate:
	// the stream's misses spent its credit, it keeps none.
	template *eventTemplate
	// tokens, when not nil, counts the tokens of the output values read
	// (CountTokens).
	tokens    *textCount
	memo      prefixMemo
	dataStart int

	lineOverflow int64 // bytes of the current line past MaxEventBytes
	tally        tally
	bytes        int64

	format       Format
	framing      Framing
	afterCR      bool // the last byte seen was \r: a following \n is part of it
	dataOverflow bool
	hasData      bool
	noTemplate   bool
	reads        uint8 // events read, up to templateAfter+1
}

// sseRoom is the first room for the lines of an SSE stream cut between
// Writes; a longer line grows it once. It makes an sseMeter 512 bytes: an
// object with pointers above that takes a malloc header and a larger size
// class, which costs the streams that cut no line more than a larger room
// saves the others (BenchmarkMeter).
const sseRoom = 216

// sseMeter is a Meter with the first room for its lines in the same
// allocation: most SSE streams cut a line between two Writes.
type sseMeter struct {
	Meter
	room [sseRoom]byte
}

// NewMeter meters a stream of format f framed as framing.
func NewMeter(f Format, framing Framing) *Meter {
	var m *Meter
	if framing == SSE {
		s := new(sseMeter)
		m = &s.Meter
		m.line = s.room[:0]
	} else {
		m = new(Meter)
	}
	m.format, m.framing = f, framing
	return m
}

// Write observes the next bytes of the stream. It never fails and never
// keeps p. A line that ends within p is read where it is; only the start of
// a line that ends in a later Write is copied.
func (m *Meter) Write(p []byte) (int, error) {
	n := len(p)
	m.bytes += int64(n)
	// cr is the next CR in p: most streams have none, and then one scan
	// of the whole of p tells, instead of one per line.
	cr := bytes.IndexByte(p, '\r')
	for len(p) > 0 {
		if m.afterCR {
			m.afterCR = false
			if p[0] == '\n' {
				p = p[1:]
				if cr > 0 {
					cr--
				}
				continue
			}
		}
		var i int // the end of p's first line (its CR or LF), or -1
		if len(m.line) == 0 && m.lineOverflow == 0 {
			if p, cr, i = m.wholeLines(p, cr); len(p) == 0 {
				break
			}
			if i < 0 {
				m.appendLine(p)
				break
			}
			m.lineAt(p, i)
		} else {
			if i = bytes.IndexByte(p, '\n'); cr >= 0 && (i < 0 || cr < i) {
				i = cr
			}
			if i < 0 {
				m.appendLine(p)
				break
			}
			m.appendLine(p[:i])
			m.endLine(m.line, m.lineOverflow, false)
			m.line, m.lineOverflow = m.line[:0], 0
		}
		if p[i] == '\r' {
			m.afterCR = true // (it is false here: see the loop's start)
		}
		p = p[i+1:]
		if cr >= 0 {
			if cr -= i + 1; cr < 0 {
				cr = bytes.IndexByte(p, '\r')
			}
		}
	}
	return n, nil
}

// lineAt ends the line p[:i], which started in p: read where it is, with no
// copy.
func (m *Meter) lineAt(p []byte, i int) {
	switch line := p[:i]; {
	case m.framing == NDJSON:
		m.endLine(line, 0, true)
	case len(line) == 0:
		m.dispatch()
	case line[0] != 'd' && len(line) <= MaxEventBytes:
		m.otherLine(line)
	case !m.hasData && !m.dataOverflow && len(line) <= MaxEventBytes && blankLineAt(p, i):
		// The one data line of an event that ends in this Write, the most
		// common: read where it is.
		if value, isData := dataValue(line); isData {
			m.read(value)
		} else {
			m.otherLine(line)
		}
	default:
		m.endLine(line, 0, true)
	}
}

// wholeLines reads the lines of p, from a line's start, that end with an
// LF before cr (the next CR, or -1) and need no copy: most lines of most
// streams, in a loop that keeps none of Write's state. It returns at the
// first other line (cut by p's end, ended by a CR, too long, or an SSE
// data line that does not end its event alone), with what is left of p
// and of cr, and the end of that line (its CR or LF), or -1.
func (m *Meter) wholeLines(p []byte, cr int) (rest []byte, _, end int) {
	for len(p) > 0 {
		i := 0 // (an empty line, most often the one after a cut event)
		if p[0] != '\n' {
			i = bytes.IndexByte(p, '\n')
		}
		if cr >= 0 && (i < 0 || cr < i) {
			return p, cr, cr
		}
		if i < 0 || i > MaxEventBytes {
			return p, cr, i
		}
		line := p[:i]
		switch {
		case m.framing == NDJSON:
			if len(line) > 0 { // (an empty line is no JSON text)
				m.read(line)
			}
		case len(line) == 0:
			m.dispatch()
		case line[0] != 'd':
			m.otherLine(line)
		case !m.hasData && !m.dataOverflow && i+1 < len(p) && p[i+1] == '\n':
			// The one data line of an event, the most common: the blank
			// line after it is taken too (dispatch has no data to read).
			if value, isData := dataValue(line); isData {
				m.read(value)
			} else {
				m.otherLine(line)
			}
			i++
		default:
			return p, cr, i
		}
		p = p[i+1:]
		if cr >= 0 {
			cr -= i + 1
		}
	}
	return p, cr, -1
}

// blankLineAt reports whether the line ending at p[i] (its CR or LF) is
// followed, in p, by an empty line.
func blankLineAt(p []byte, i int) bool {
	j := i + 1
	if p[i] == '\r' && j < len(p) && p[j] == '\n' {
		j++
	}
	return j < len(p) && (p[j] == '\n' || p[j] == '\r')
}

// dataValue is the value of an SSE data: line.
func dataValue(line []byte) (value []byte, isData bool) {
	if len(line) < 5 || string(line[:5]) != "data:" {
		return nil, false
	}
	if len(line) > 5 && line[5] == ' ' {
		return line[6:], true
	}
	return line[5:], true
}

// lineEnd is the index of the first CR or LF in p, or -1.
func lineEnd(p []byte) int {
	i := bytes.IndexByte(p, '\n')
	before := p
	if i >= 0 {
		before = p[:i]
	}
	if j := bytes.IndexByte(before, '\r'); j >= 0 {
		return j
	}
	return i
}

// Close ends the stream: a last unterminated line and a last event without
// its blank line are read too (a cut one fails to parse and counts nothing).
func (m *Meter) Close() {
	if len(m.line) > 0 || m.lineOverflow > 0 {
		m.endLine(m.line, m.lineOverflow, false)
		m.line, m.lineOverflow = m.line[:0], 0
	}
	m.dispatch()
}

// Reading is what a stream reported.
type Reading struct {
	// Usage is the last usage reported. With Complete false it may hold
	// only the input (InputKnown), a running count whose output is a lower
	// bound of the final one (Gemini's usageMetadata before the response
	// finished), or nothing.
	Usage      budget.Usage
	Complete   bool
	InputKnown bool
	// OutputTextBytes is the generated output seen (every field of the
	// format's output table), for an output estimate.
	OutputTextBytes int64
	// OutputTokens is, with CountTokens, the tokens of the output values
	// read, and OutputTokensText the decoded bytes of those values. Where
	// OutputTextBytes grew by more or less than OutputTokensText (an event
	// too long to read, a template with text outside its hole, a name given
	// twice), the meter counted text the counter did not: such text is
	// counted by its bytes.
	OutputTokens     int64 `json:",omitempty"`
	OutputTokensText int64 `json:",omitempty"`
	// Bytes is the length of the stream so far.
	Bytes int64
}

// Framing is how the metered stream separates its events.
func (m *Meter) Framing() Framing { return m.framing }

// CountTokens makes the meter count the tokens of each output value it
// reads from now on with c (Reading.OutputTokens): each value alone, an
// event's text delta, a tool call's name or arguments, as c counts it. A
// value counted as written (JSON arguments), and one with escapes whose
// decoded text is longer than 2 KiB, count a token a byte. It costs one
// allocation.
func (m *Meter) CountTokens(c TokenCounter) {
	m.tokens = &textCount{counter: c}
}

// Reading returns what the stream has reported so far.
func (m *Meter) Reading() Reading {
	r := Reading{
		Usage:           m.tally.billed(),
		Complete:        m.tally.complete,
		InputKnown:      m.tally.inputKnown,
		OutputTextBytes: m.tally.outputTextBytes,
		Bytes:           m.bytes,
	}
	if m.tokens != nil {
		r.OutputTokens, r.OutputTokensText = m.tokens.tokens, m.tokens.bytes
	}
	return r
}

func (m *Meter) appendLine(p []byte) {
	room := MaxEventBytes - len(m.line)
	if m.lineOverflow > 0 {
		room = 0
	}
	keep := min(room, len(p))
	if cap(m.line) == 0 && !m.hasData {
		m.line, m.data = m.data[:0], m.line // data's room is free
	}
	m.line = appendBounded(m.line, p[:keep])
	m.lineOverflow += int64(len(p) - keep)
}

// appendBounded appends like append, but never grows dst's capacity past
// MaxEventBytes; callers keep len(dst)+len(p) within it.
func appendBounded(dst, p []byte) []byte {
	if need := len(dst) + len(p); need > cap(dst) {
		grown := make([]byte, len(dst), min(max(2*cap(dst), need, 512), MaxEventBytes))
		copy(grown, dst)
		dst = grown
	}
	return append(dst, p...)
}

// endLine reads one whole line: line is what was kept of it, overflow the
// bytes past MaxEventBytes that were not (a line read in place may itself
// be longer than that); inPlace says line is in the p of this Write, else
// it is m.line.
func (m *Meter) endLine(line []byte, overflow int64, inPlace bool) {
	if overflow > 0 || len(line) > MaxEventBytes {
		// Too long to parse: count it as generated text, which errs on the
		// side of charging, and drop any event it belongs to.
		m.tally.outputTextBytes += int64(len(line)) + overflow
		if m.framing == SSE {
			m.dataOverflow = true
		}
		return
	}
	if m.framing == NDJSON {
		m.read(line)
		return
	}
	m.sseLine(line, inPlace)
}

// read folds one JSON payload into the tally.
func (m *Meter) read(payload []byte) {
	t := m.template
	if t == nil && !m.noTemplate {
		// A template costs an allocation and a copy of each event read
		// in full: a stream earns one when it has passed its first events.
		if m.reads++; m.reads > templateAfter {
			t = &eventTemplate{credit: startCredit}
			m.template = t
		}
	} else if t != nil && t.n > 0 {
		if text, ok := t.match(payload, m.tokens); ok {
			m.tally.outputTextBytes += text
			t.credit = min(t.credit+hitCredit, maxCredit)
			t.hits++
			return
		}
		if t.credit--; t.credit == 0 {
			m.template, m.noTemplate, t = nil, true, nil
		}
	}
	var ev event
	var before textCount
	if m.tokens != nil {
		before.tokens, before.bytes = m.tokens.tokens, m.tokens.bytes
	}
	if readCounted(payload, &ev, m.format, &m.memo, t, m.tokens) {
		m.tally.add(m.format, &ev)
		return
	}
	if m.tokens != nil {
		// The tokenizer counts none of a payload that does not parse...
		m.tokens.tokens, m.tokens.bytes = before.tokens, before.bytes
	}
	// ...and the meter counts it whole as output: a body that is not what
	// its Content-Type says (SSE labelled NDJSON, garbage) is charged a
	// token a byte, never passed free.
	m.tally.outputTextBytes += unparsed(payload)
}

// unparsed is what a payload the meter could not read counts as output
// text: its bytes, but for the stream's end marker of OpenAI's SSE.
func unparsed(payload []byte) int64 {
	if string(bytes.TrimSpace(payload)) == "[DONE]" {
		return 0
	}
	return int64(len(payload))
}

// otherLine counts an SSE line that is not data as output text unless it
// is one of the fields that carry none (event:, id:, retry:) or a comment:
// a line an SSE client would ignore may still be read by a client that
// reads lines, so it is never free.
func (m *Meter) otherLine(line []byte) {
	if !sseFieldLine(line) {
		m.tally.outputTextBytes += int64(len(line))
	}
}

// sseFieldLine reports whether line is a comment or an SSE field that is not
// output: event, id, retry, or data (a line "data" without a colon).
func sseFieldLine(line []byte) bool {
	if len(line) == 0 || line[0] == ':' {
		return true
	}
	name := line
	if i := bytes.IndexByte(line, ':'); i >= 0 {
		name = line[:i]
	}
	switch string(name) {
	case "event", "id", "retry", "data":
		return true
	}
	return false
}

// sseLine handles one line of text/event-stream.
func (m *Meter) sseLine(line []byte, inPlace bool) {
	if len(line) == 0 {
		m.dispatch()
		return
	}
	value, isData := dataValue(line)
	if !isData {
		m.otherLine(line)
		return
	}
	if m.dataOverflow {
		return
	}
	if !m.hasData && !inPlace {
		// line is m.line: data takes it over, and line takes data's room.
		m.line, m.data = m.data[:0], m.line
		m.dataStart, m.hasData = len(line)-len(value), true
		return
	}
	sep := 0
	if m.hasData {
		sep = 1
	}
	if len(m.data)-m.dataStart+sep+len(value) > MaxEventBytes {
		m.tally.outputTextBytes += int64(len(m.data) - m.dataStart + len(value))
		m.data, m.dataStart, m.dataOverflow = m.data[:0], 0, true
		return
	}
	if m.dataStart > 0 { // keep data's bytes within MaxEventBytes of its room
		m.data = m.data[:copy(m.data, m.data[m.dataStart:])]
		m.dataStart = 0
	}
	if cap(m.data) == 0 && inPlace {
		m.line, m.data = m.data, m.line[:0] // line's room is free
	}
	if sep == 1 {
		m.data = appendBounded(m.data, []byte{'\n'})
	}
	m.data = appendBounded(m.data, value)
	m.hasData = true
}

// dispatch ends the current SSE event.
func (m *Meter) dispatch() {
	if m.hasData && !m.dataOverflow {
		m.read(m.data[m.dataStart:])
	}
	m.data, m.dataStart, m.hasData, m.dataOverflow = m.data[:0], 0, false, false
}
