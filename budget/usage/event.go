package usage

import (
	"bytes"
	"encoding/binary"
	"math/bits"

	"github.com/fleetguard/fleetguard/budget"
)

// event is what one JSON payload (a whole response, one SSE data payload or
// one NDJSON line) says about usage and output text, in any supported
// format. Keys are read by exact case, as upstreams and SDKs read them; of a
// key given twice, the last counts.
type event struct {
	kind eventKind // "type"
	// OpenAI chat (final chunk or JSON body), Responses and Anthropic JSON
	// bodies, Anthropic message_delta.
	usage usageFields
	// Anthropic message_start carries usage inside message; Ollama chat
	// carries the output text there.
	message      bool
	messageUsage usageFields
	// Responses events carry the response object (its usage is read for
	// the final events only); Ollama's generate API has a string here.
	responseUsage usageFields
	// Gemini.
	gemini geminiUsage
	// Ollama's native API.
	promptEvalCount, evalCount optInt
	// text is the output text each key carried, in bytes as decoded.
	text [textKeys]int64
}

// eventKind is the "type" of an event, where it decides how usage is read.
type eventKind uint8

const (
	kindOther eventKind = iota
	kindMessageStart
	kindMessageDelta
	kindResponseFinal // response.completed, response.incomplete, response.failed
)

// The keys that carry output text.
const (
	textChoices    = iota // chat chunks: choices[].delta
	textDelta             // Responses (a string) and Anthropic (an object) deltas
	textCandidates        // Gemini: candidates[].content.parts[].text
	textMessage           // Ollama chat: message.content
	textResponse          // Ollama generate: response (a string)
	textKeys
)

// optInt is an integer field that may be absent or null.
type optInt struct {
	v   int64
	set bool
}

func (o optInt) nonNegative() int64 {
	if o.set && o.v > 0 {
		return o.v
	}
	return 0
}

// geminiUsage is Gemini's usageMetadata.
type geminiUsage struct {
	present                                     bool
	prompt, candidates, thoughts, cachedContent int64
}

// textBytes is the output text the event carried.
func (ev *event) textBytes() int64 {
	return ev.text[textChoices] + ev.text[textDelta] + ev.text[textCandidates] + ev.text[textMessage] + ev.text[textResponse]
}

// tally accumulates what a response reported, event by event.
type tally struct {
	usage budget.Usage
	// complete: a final usage report was seen (the last one wins).
	complete bool
	// inputKnown: the input tokens were reported even if the output was not
	// (Anthropic's message_start).
	inputKnown bool
	// outputTextBytes counts the generated text seen, for an estimate when a
	// stream ends without usage.
	outputTextBytes int64
}

// add folds one event into the tally.
func (t *tally) add(f Format, ev *event) {
	t.outputTextBytes += ev.textBytes()
	switch {
	case ev.kind == kindMessageStart && ev.message && ev.messageUsage.present:
		if u, ok := ev.messageUsage.usage(Anthropic); ok {
			t.usage.InputTokens, t.usage.CachedInputTokens = u.InputTokens, u.CachedInputTokens
			t.usage.OutputTokens = max(t.usage.OutputTokens, u.OutputTokens)
			t.inputKnown = true
		}
	case ev.kind == kindMessageDelta && ev.usage.present:
		// Cumulative: the last value wins, never a sum. Newer API versions
		// repeat the input counts here too.
		fields := &ev.usage
		if fields.has(outputTokens) {
			t.usage.OutputTokens = max(fields.count[outputTokens], 0)
		}
		if fields.has(inputTokens) || fields.has(cacheRead) || fields.has(cacheCreation) {
			if u, ok := fields.usage(Anthropic); ok && u.InputTokens > 0 {
				t.usage.InputTokens, t.usage.CachedInputTokens = u.InputTokens, u.CachedInputTokens
				t.inputKnown = true
			}
		}
		t.complete = true
	case ev.kind == kindResponseFinal:
		if ev.responseUsage.present {
			t.set(ev.responseUsage.usage(OpenAIResponses))
		}
	case ev.gemini.present:
		m := ev.gemini
		t.set(budget.Usage{
			InputTokens:       max(m.prompt, 0),
			CachedInputTokens: max(m.cachedContent, 0),
			OutputTokens:      max(m.candidates, 0) + max(m.thoughts, 0),
		}, true)
	case ev.promptEvalCount.set || ev.evalCount.set:
		// Ollama reports the counts on its final object only.
		t.set(budget.Usage{InputTokens: ev.promptEvalCount.nonNegative(), OutputTokens: ev.evalCount.nonNegative()}, true)
	case ev.usage.present:
		// A chat chunk with "usage": null has none.
		t.set(ev.usage.usage(f))
	}
}

func (t *tally) set(u budget.Usage, ok bool) {
	if ok {
		t.usage, t.complete, t.inputKnown = u, true, true
	}
}

// readEvent reads one payload into ev, which must be zero. It is false when
// the payload is not a JSON object or is one that encoding/json would refuse
// to decode into the fields read (bad syntax anywhere, or a field read
// holding the wrong type): such a payload counts nothing, as before this
// reader. memo, when not nil, lets a payload that starts like the last one
// skip what they share (see prefixMemo), and is updated. tmpl, when not
// nil, becomes the payload's template if it is valid (see eventTemplate).
func readEvent(data []byte, ev *event, memo *prefixMemo, tmpl *eventTemplate) bool {
	if tmpl != nil {
		tmpl.begin()
	}
	if len(data) == 0 || data[0] != '{' || data[len(data)-1] != '}' {
		data = bytes.TrimSpace(data)
		if len(data) == 0 || data[0] != '{' {
			return false
		}
	}
	s := scanner{b: data, i: 1, tmpl: tmpl}
	k := 0
	if memo != nil {
		k = memo.resume(&s, ev)
	}
	s.eventMembers(ev, k, memo)
	if memo != nil {
		memo.finish(s.b)
	}
	if s.failed {
		return false
	}
	s.space()
	if s.i != len(s.b) {
		return false
	}
	if tmpl != nil {
		tmpl.keep(data, ev.textBytes())
	}
	return true
}

// eventMembers reads the members of the payload's top object, from its k-th
// on; memo, when not nil, learns where the members that change nothing but
// the kind end.
func (s *scanner) eventMembers(ev *event, k int, memo *prefixMemo) {
	plain := true // every member so far set nothing but the kind
	for ; ; k++ {
		key, more := s.member(k)
		if !more {
			return
		}
		ok, set := true, true
		switch string(key) {
		case "type":
			ev.kind, ok = s.eventKind()
			set = false
		case "usage":
			ok = s.usageFields(1, &ev.usage)
		case "message":
			ev.message, ev.text[textMessage], ok = s.message(&ev.messageUsage)
		case "response":
			ev.text[textResponse] = s.response(&ev.responseUsage)
		case "choices":
			ev.text[textChoices], ok = s.choices()
		case "delta":
			ev.text[textDelta] = s.topDelta()
		case "usageMetadata":
			ev.gemini, ok = s.geminiUsage()
		case "candidates":
			ev.text[textCandidates], ok = s.candidates()
		case "done":
			ok, set = s.optBool(1), false
		case "prompt_eval_count":
			ev.promptEvalCount, ok = s.optInt(1)
		case "eval_count":
			ev.evalCount, ok = s.optInt(1)
		default:
			s.skip(1)
			set = false
		}
		if !ok || s.failed {
			s.fail()
			return
		}
		// A run ends at a comma, so that it never ends inside a token of
		// another event (1 of 12).
		if plain = plain && !set; plain && memo != nil && s.i < len(s.b) && s.b[s.i] == ',' {
			memo.reached(s.i+1, k+1, ev.kind)
		}
	}
}

// The typed readers below read the value at the position, which is nested
// in d arrays and objects. They consume the whole value even when it has the
// wrong type for them; ok is then false.

// object starts an object or null: isObject says the '{' was consumed.
func (s *scanner) object(d int) (isObject, ok bool) {
	switch s.peek() {
	case '{':
		s.i++
		return true, true
	case 'n':
		s.literal("null")
		return false, true
	}
	s.skip(d)
	return false, false
}

// array starts an array or null: isArray says the '[' was consumed.
func (s *scanner) array(d int) (isArray, ok bool) {
	switch s.peek() {
	case '[':
		s.i++
		return true, true
	case 'n':
		s.literal("null")
		return false, true
	}
	s.skip(d)
	return false, false
}

func (s *scanner) optInt(d int) (optInt, bool) {
	switch c := s.peek(); {
	case c == 'n':
		s.literal("null")
		return optInt{}, true
	case c == '-' || '0' <= c && c <= '9':
		v, isInt := s.number()
		return optInt{v: v, set: isInt}, isInt
	}
	s.skip(d)
	return optInt{}, false
}

// optText reads a string or null: its decoded length.
func (s *scanner) optText(d int) (int64, bool) {
	ok := true
	switch at := s.i; s.peek() {
	case '"':
		start, end, plain := s.str()
		if s.failed {
			return 0, false
		}
		n := textLen(s.b[start:end], plain)
		if s.tmpl != nil {
			s.tmpl.textRead(at, s.i, n)
		}
		return n, true
	case 'n':
		s.literal("null")
	default:
		s.skip(d)
		ok = false
	}
	if s.tmpl != nil {
		s.tmpl.textRead(-1, -1, 0)
	}
	return 0, ok
}

func (s *scanner) optBool(d int) bool {
	switch s.peek() {
	case 't':
		s.literal("true")
	case 'f':
		s.literal("false")
	case 'n':
		s.literal("null")
	default:
		s.skip(d)
		return false
	}
	return true
}

func (s *scanner) eventKind() (eventKind, bool) {
	switch s.peek() {
	case '"':
	case 'n':
		s.literal("null")
		return kindOther, true
	default:
		s.skip(1)
		return kindOther, false
	}
	// Most names are plain and shorter than 24 bytes: they are scanned
	// and matched here, in three words loaded once, without str's call or
	// the switch's memequal (every event has a type).
	if b, i := s.b, s.i+1; len(b)-i >= 24 {
		w := b[i : i+24 : i+24]
		x0, x1, x2 := binary.LittleEndian.Uint64(w[:8]), binary.LittleEndian.Uint64(w[8:16]), binary.LittleEndian.Uint64(w[16:24])
		n := 24 // the name's length, where its first byte not plain is
		if h := notPlain8(x0); h != 0 {
			n = bits.TrailingZeros64(h) >> 3
		} else if h = notPlain8(x1); h != 0 {
			n = 8 + bits.TrailingZeros64(h)>>3
		} else if h = notPlain8(x2); h != 0 {
			n = 16 + bits.TrailingZeros64(h)>>3
		}
		if n == 24 { // longer than any kind's name: only valid or not
			s.strFrom(i, i+n)
			return kindOther, !s.failed
		}
		if w[n] == '"' {
			s.i = i + n + 1
			return kindOfWords(n, x0, x1, x2), true
		}
	}
	start, end, plain := s.str()
	if s.failed {
		return kindOther, false
	}
	name := s.b[start:end]
	if !plain {
		var buf [32]byte
		n, ok := decodeASCII(buf[:], name)
		if !ok {
			return kindOther, true
		}
		name = buf[:n]
	}
	switch string(name) {
	case "message_start":
		return kindMessageStart, true
	case "message_delta":
		return kindMessageDelta, true
	case "response.completed", "response.incomplete", "response.failed":
		return kindResponseFinal, true
	}
	return kindOther, true
}

// The names of the kinds in little-endian words, their bytes
// past a name's end zero (TestKindWords).
const (
	wordMessage_ = 0x5f6567617373656d // "message_"
	wordStart    = 0x7472617473       // "start"
	wordDelta    = 0x61746c6564       // "delta"
	wordResponse = 0x65736e6f70736572 // "response"
	wordFailed   = 0x64656c6961662e   // ".failed"
	wordComplet  = 0x74656c706d6f632e // ".complet"
	wordEd       = 0x6465             // "ed"
	wordIncompl  = 0x6c706d6f636e692e // ".incompl"
	wordEte      = 0x657465           // "ete"
)

// kindOfWords is the kind the plain name of n bytes (n < 24) names, its
// bytes and those after it in the little-endian words x0, x1 and x2: the
// switch in eventKind, by words.
func kindOfWords(n int, x0, x1, x2 uint64) eventKind {
	switch n {
	case 13: // message_start, message_delta
		if x0 == wordMessage_ {
			switch x1 & (1<<40 - 1) {
			case wordStart:
				return kindMessageStart
			case wordDelta:
				return kindMessageDelta
			}
		}
	case 15: // response.failed
		if x0 == wordResponse && x1&(1<<56-1) == wordFailed {
			return kindResponseFinal
		}
	case 18: // response.completed
		if x0 == wordResponse && x1 == wordComplet && x2&(1<<16-1) == wordEd {
			return kindResponseFinal
		}
	case 19: // response.incomplete
		if x0 == wordResponse && x1 == wordIncompl && x2&(1<<24-1) == wordEte {
			return kindResponseFinal
		}
	}
	return kindOther
}

// message reads Anthropic's message object (message_start), its usage into
// usage, or Ollama's chat message.
func (s *scanner) message(usage *usageFields) (isObject bool, text int64, ok bool) {
	*usage = usageFields{}
	isObject, ok = s.object(1)
	if !isObject {
		return false, 0, ok
	}
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return true, text, ok
		}
		switch string(key) {
		case "usage":
			ok = s.usageFields(2, usage) && ok
		case "content":
			text = s.anyText(2)
		default:
			s.skip(2)
		}
	}
}

// anyText reads any value: the decoded length when it is a string.
func (s *scanner) anyText(d int) int64 {
	if s.peek() != '"' {
		s.skip(d)
		return 0
	}
	n, _ := s.optText(d)
	return n
}

// response reads a Responses event's response object (its usage into usage;
// a wrong type there leaves it without usage, as a failed decode did) or
// Ollama's generated text.
func (s *scanner) response(usage *usageFields) (text int64) {
	*usage = usageFields{}
	switch s.peek() {
	case '"':
		return s.anyText(1)
	case '{':
	default:
		s.skip(1)
		return 0
	}
	s.i++
	ok := true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			break
		}
		if string(key) == "usage" {
			ok = s.usageFields(2, usage) && ok
		} else {
			s.skip(2)
		}
	}
	if !ok {
		*usage = usageFields{}
	}
	return 0
}

// choices reads a chat chunk's choices: the text of their deltas.
func (s *scanner) choices() (text int64, ok bool) { return s.textOfElements(chatChoices) }

// chatDelta reads choices[].delta: content, reasoning, refusal and tool
// call arguments.
func (s *scanner) chatDelta() (text int64, ok bool) {
	isObject, ok := s.object(3)
	if !isObject {
		return 0, ok
	}
	var content, reasoning, refusal, tools int64
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			break
		}
		good := true
		switch string(key) {
		case "content":
			content, good = s.optText(4)
		case "reasoning_content":
			reasoning, good = s.optText(4)
		case "refusal":
			refusal, good = s.optText(4)
		case "tool_calls":
			tools, good = s.toolCalls()
		default:
			s.skip(4)
		}
		ok = ok && good
	}
	return content + reasoning + refusal + tools, ok
}

// toolCalls reads delta.tool_calls[].function.arguments.
func (s *scanner) toolCalls() (text int64, ok bool) {
	isArray, ok := s.array(4)
	if !isArray {
		return 0, ok
	}
	for k := 0; s.element(k); k++ {
		isObject, good := s.object(5)
		ok = ok && good
		if !isObject {
			continue
		}
		var call int64
		for m := 0; ; m++ {
			key, more := s.member(m)
			if !more {
				break
			}
			if string(key) != "function" {
				s.skip(6)
				continue
			}
			call = 0
			isFunction, good := s.object(6)
			ok = ok && good
			if !isFunction {
				continue
			}
			for n := 0; ; n++ {
				key, more := s.member(n)
				if !more {
					break
				}
				if string(key) == "arguments" {
					call, good = s.optText(7)
					ok = ok && good
				} else {
					s.skip(7)
				}
			}
		}
		text += call
	}
	return text, ok
}

// topDelta reads the top-level delta: a string (Responses) or an object
// with text, partial_json or thinking (Anthropic). A wrong type in the
// object counts no text but keeps the event, as a failed decode of this
// field alone did.
func (s *scanner) topDelta() int64 {
	switch s.peek() {
	case '"':
		return s.anyText(1)
	case '{':
	default:
		s.skip(1)
		return 0
	}
	s.i++
	var text, partial, thinking int64
	ok := true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			break
		}
		good := true
		switch string(key) {
		case "text":
			text, good = s.optText(2)
		case "partial_json":
			partial, good = s.optText(2)
		case "thinking":
			thinking, good = s.optText(2)
		default:
			s.skip(2)
		}
		ok = ok && good
	}
	if !ok {
		return 0
	}
	return text + partial + thinking
}

// candidates reads Gemini's candidates[].content.parts[].text.
func (s *scanner) candidates() (text int64, ok bool) { return s.textOfElements(geminiCandidates) }

// textArray names an array of objects whose elements hold text in one
// member: chat choices (delta) or Gemini candidates (content).
type textArray uint8

const (
	chatChoices textArray = iota
	geminiCandidates
)

// textOfElements reads a textArray, adding up the text of each element's
// member; the others are skipped. (A switch, not a func value: passing
// the scanner to a func value makes it escape, an allocation per event.)
func (s *scanner) textOfElements(a textArray) (text int64, ok bool) {
	isArray, ok := s.array(1)
	if !isArray {
		return 0, ok
	}
	for k := 0; s.element(k); k++ {
		isObject, good := s.object(2)
		ok = ok && good
		if !isObject {
			continue
		}
		var found int64
		for m := 0; ; m++ {
			key, more := s.member(m)
			if !more {
				break
			}
			switch {
			case a == chatChoices && string(key) == "delta":
				found, good = s.chatDelta()
			case a == geminiCandidates && string(key) == "content":
				found, good = s.geminiContent()
			default:
				s.skip(3)
				continue
			}
			ok = ok && good
		}
		text += found
	}
	return text, ok
}

// geminiContent reads candidates[].content: its parts' text.
func (s *scanner) geminiContent() (text int64, ok bool) {
	isObject, ok := s.object(3)
	if !isObject {
		return 0, ok
	}
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return text, ok
		}
		if string(key) != "parts" {
			s.skip(4)
			continue
		}
		text = 0
		isArray, good := s.array(4)
		ok = ok && good
		if !isArray {
			continue
		}
		for m := 0; s.element(m); m++ {
			isPart, good := s.object(5)
			ok = ok && good
			if !isPart {
				continue
			}
			var part int64
			for n := 0; ; n++ {
				key, more := s.member(n)
				if !more {
					break
				}
				if string(key) == "text" {
					part, good = s.optText(6)
					ok = ok && good
				} else {
					s.skip(6)
				}
			}
			text += part
		}
	}
}

// geminiUsage reads usageMetadata.
func (s *scanner) geminiUsage() (g geminiUsage, ok bool) {
	isObject, ok := s.object(1)
	if !isObject {
		return g, ok
	}
	g.present = true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return g, ok
		}
		var field *int64
		switch string(key) {
		case "promptTokenCount":
			field = &g.prompt
		case "candidatesTokenCount":
			field = &g.candidates
		case "thoughtsTokenCount":
			field = &g.thoughts
		case "cachedContentTokenCount":
			field = &g.cachedContent
		default:
			s.skip(2)
			continue
		}
		n, good := s.optInt(2)
		*field = n.v
		ok = ok && good
	}
}
