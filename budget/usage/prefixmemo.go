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
type prefixMemo struct {
	prefix  []byte    // the last event's bytes up to the comma after the run
	members int       // how many members the run holds
	kind    eventKind // the kind they set
	// event and end are the event being read and how far its run got.
	event []byte
	end   int
}

// resume starts reading the event s.b: when it starts with the run, the
// scan moves past it and ev gets the kind it held; resume returns how many
// members it skipped.
func (p *prefixMemo) resume(s *scanner, ev *event) int {
	p.event, p.end = s.b, 0
	n := len(p.prefix)
	if n == 0 || len(s.b) <= n || !bytes.Equal(s.b[:n], p.prefix) {
		p.prefix, p.members, p.kind = p.prefix[:0], 0, kindOther
		return 0
	}
	p.end = n
	s.i, ev.kind = n-1, p.kind // at the comma
	return p.members
}

// reached records that the event's run extends to end (just past a comma),
// holding members members and setting kind.
func (p *prefixMemo) reached(end, members int, kind eventKind) {
	if end > p.end && end <= maxMemoPrefix {
		p.end, p.members, p.kind = end, members, kind
	}
}

// finish keeps the event's run for the next event, and forgets the event.
func (p *prefixMemo) finish() {
	if p.end > len(p.prefix) {
		p.prefix = append(p.prefix, p.event[len(p.prefix):p.end]...)
	}
	p.event = nil
}
