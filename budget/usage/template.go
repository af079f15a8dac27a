package usage

// A stream's events mostly differ from the one before only in a few values
// the meter does not read: a chat chunk's text and its obfuscation padding,
// a Responses event's sequence number, an Ollama line's timestamp. An
// eventTemplate keeps the last event read in full and where those values
// lie in it (its holes); an event that equals it outside the holes, with a
// valid string or number in each, reads the same but for the text of its
// text hole, so it is read by comparing bytes instead of scanning them.
//
// Why that is exact: the readers look at a skipped string or number only to
// validate it, and at a text string only for its decoded length, which is
// the event's text when it is the event's one text (keep), whatever its
// value; a value read for more (what ends a response, a JSON value counted
// as written) is no hole, but compared. So the reading is a function of the
// bytes outside the holes, of the holes' types and of the text hole's
// length. A hit's event is therefore the template's with another text
// length, and folding it into the tally is the template's fold again (a
// no-op but for the text: TestTallyAddIsIdempotentButForText) plus its
// text.

// maxHoles bounds the holes a template records; values past them are
// compared like the bytes around them.
const maxHoles = 12

// templateAfter is how many events a stream reads before it keeps a
// template: a template costs an allocation (1 KiB) and a copy of every
// event read in full, which a short stream does not earn back.
const templateAfter = 16

// A stream keeps its template while it earns it: each miss spends a unit
// of credit and each hit earns hitCredit, up to maxCredit; at none the
// stream stops keeping a template (Gemini's events, for one, change their
// usage counts every time, and few events of a short stream repeated match
// the one before).
const (
	startCredit = 16
	hitCredit   = 4
	maxCredit   = 64
)

// hole is a value of the template that another event may hold differently.
type hole struct {
	start, end int32 // its bytes in the template, quotes included
	number     bool  // a number; else a string
}

// eventTemplate is the last event read in full and its holes. While an
// event is read, the scanner records its holes here; keep makes it the
// template if it was valid.
type eventTemplate struct {
	holes [maxHoles]hole
	// base is the text the event read outside its text hole.
	base int64
	// textLen is, while an event is read, the decoded length of its first
	// text string.
	textLen   int64
	n         int32 // the template's length in buf; 0: there is none
	nHoles    uint8
	textHole  int8      // the index of the text hole, or -1
	textReads uint8     // the text values read (strings or not), up to 2
	credit    uint8     // see startCredit
	hits      uint32    // events read by comparison
	buf       [848]byte // (1024 bytes in all, a size class)
}

// begin readies t to record the holes of an event read in full.
func (t *eventTemplate) begin() {
	t.n, t.nHoles, t.textHole, t.textReads = 0, 0, -1, 0
}

// skipped records the value at b[start:end], a string or a number the
// reader skipped, as a hole.
func (t *eventTemplate) skipped(start, end int, number bool) {
	if t.nHoles < maxHoles {
		t.holes[t.nHoles] = hole{int32(start), int32(end), number}
		t.nHoles++
	}
}

// textRead records that a reader read a text value; when it is the first
// and a string at b[start:end], of decoded length n (start < 0 otherwise),
// it is the text hole candidate.
func (t *eventTemplate) textRead(start, end int, n int64) {
	if t.textReads++; t.textReads > 1 {
		t.textReads = 2
		return
	}
	if start >= 0 && t.nHoles < maxHoles {
		t.textHole, t.textLen = int8(t.nHoles), n
		t.skipped(start, end, false)
	}
}

// keep makes event, valid and read in full with its text total text, the
// template. The text hole stands only when it is the event's one text
// value, not empty, and counted: then the text is its length. Otherwise it
// is compared like the rest, and every text the event read is the base.
func (t *eventTemplate) keep(event []byte, text int64) {
	if len(event) > len(t.buf) {
		return
	}
	if h := t.textHole; h >= 0 && (t.textReads != 1 || t.textLen == 0 || text != t.textLen) {
		copy(t.holes[h:], t.holes[h+1:t.nHoles])
		t.nHoles--
		t.textHole = -1
	}
	t.base = text
	if t.textHole >= 0 {
		t.base = 0
	}
	t.n = int32(copy(t.buf[:], event))
}

// match reports whether event reads like the template but for its holes,
// and then the text it carries; tc, when not nil, counts the tokens of its
// text hole (a template with text outside a hole counts none: the meter's
// text and the count then differ, and the caller counts that event by its
// bytes).
func (t *eventTemplate) match(event []byte, tc *textCount) (text int64, ok bool) {
	tmpl := t.buf[:t.n]
	// The end first: where an event differs in more than its holes, its
	// end mostly does too (its fields change from there on).
	tail := tmpl // with no holes, the whole event
	if t.nHoles > 0 {
		tail = tmpl[t.holes[t.nHoles-1].end:]
	}
	if len(event) < len(tail) || string(event[len(event)-len(tail):]) != string(tail) {
		return 0, false
	}
	s := scanner{b: event}
	at := 0 // the position in tmpl; s.i is that in event
	var textRaw []byte
	var textPlain bool
	for h, hl := range t.holes[:t.nHoles] {
		same := tmpl[at:hl.start]
		if len(event)-s.i <= len(same) || string(event[s.i:s.i+len(same)]) != string(same) {
			return 0, false
		}
		s.i += len(same)
		if hl.number {
			s.skipNumber()
		} else {
			if event[s.i] != '"' {
				return 0, false
			}
			start, end, plain := s.str()
			if h == int(t.textHole) && !s.failed {
				text = textLen(event[start:end], plain)
				textRaw, textPlain = event[start:end], plain
			}
		}
		if s.failed {
			return 0, false
		}
		at = int(hl.end)
	}
	if len(event)-s.i != len(tail) { // (what is left is the tail, checked)
		return 0, false
	}
	if tc != nil && textRaw != nil {
		tc.text(textRaw, textPlain, text)
	}
	return t.base + text, true
}
