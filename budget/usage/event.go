package usage

import (
	"bytes"
	"encoding/binary"
	"math/bits"

	"github.com/fleetguard/fleetguard/budget"
)

// event is what one JSON payload (a whole response, one SSE data payload or
// one NDJSON line) says about usage, in any supported format, and about
// output, in the format's output table (outputTables). Keys are read by
// exact case, as upstreams and SDKs read them; of a key given twice, the
// last counts.
type event struct {
	kind eventKind // "type"
	// OpenAI chat (final chunk or JSON body), Responses and Anthropic JSON
	// bodies, Anthropic message_delta.
	usage usageFields
	// Anthropic message_start carries usage inside message; Ollama chat
	// carries its output there.
	message      bool
	messageUsage usageFields
	// Responses events carry the response object (its usage and
	// service_tier are read for the final events only); Ollama's generate
	// API has its output here.
	responseUsage usageFields
	responseTier  tierField
	// serviceTier is OpenAI's top-level service_tier: the tier that served
	// the response.
	serviceTier tierField
	// Gemini.
	gemini geminiUsage
	// Ollama's native API.
	promptEvalCount, evalCount optInt
	// output is what the top-level names of the table held.
	output outputSum
	// text is the output of the whole event, finished whether it ended the
	// response (Gemini's finishReason): set once the event is read.
	text     int64
	finished bool
}

// eventKind is the "type" of an event, where it decides how usage is read.
type eventKind uint8

const (
	kindOther eventKind = iota
	kindMessageStart
	kindMessageDelta
	kindResponseFinal // response.completed, response.incomplete, response.failed
)

// optInt is an integer field that may be absent or null.
type optInt struct {
	v   int64
	set bool
}

// tierField is a service_tier given as a string (any other value is none).
type tierField struct {
	tier budget.ServiceTier
	set  bool
}

// geminiUsage is Gemini's usageMetadata.
type geminiUsage struct {
	present                                              bool
	prompt, candidates, thoughts, cachedContent, toolUse int64
	// audio is the AUDIO modality's part of the prompt
	// (promptTokensDetails), summed as budget.AddCounts does.
	audio int64
}

// textBytes is the output the event carried.
func (ev *event) textBytes() int64 { return ev.text }

// tally accumulates what a response reported, event by event.
type tally struct {
	usage budget.Usage
	// complete: a final usage report was seen (the last one wins).
	complete bool
	// inputKnown: the input tokens were reported even if the output was not
	// (Anthropic's message_start, Gemini's running usageMetadata).
	inputKnown bool
	// finished: the response said it has finished (an endField of its
	// table). Gemini's usageMetadata is final from then on.
	finished bool
	// outputTextBytes counts the generated text seen, for an estimate when a
	// stream ends without usage.
	outputTextBytes int64
	// tier is the service tier the response said served it, the last said.
	tier budget.ServiceTier
}

// billed is the usage reported, with the tier that served it.
func (t *tally) billed() budget.Usage {
	u := t.usage
	u.ServiceTier = t.tier
	return u
}

// add folds one event into the tally.
func (t *tally) add(f Format, ev *event) {
	t.outputTextBytes += ev.textBytes()
	t.finished = t.finished || ev.finished
	if ev.serviceTier.set {
		t.tier = ev.serviceTier.tier
	}
	switch {
	case ev.kind == kindMessageStart && ev.message && ev.messageUsage.present:
		if u, ok := ev.messageUsage.usage(Anthropic); ok {
			t.usage = t.usage.WithInputOf(u)
			t.usage.OutputTokens = max(t.usage.OutputTokens, u.OutputTokens)
			t.usage.WebSearchCalls = max(t.usage.WebSearchCalls, u.WebSearchCalls)
			t.inputKnown = true
		}
	case ev.kind == kindMessageDelta && ev.usage.present:
		t.addMessageDelta(&ev.usage)
	case ev.kind == kindResponseFinal:
		if ev.responseTier.set {
			t.tier = ev.responseTier.tier
		}
		if ev.responseUsage.present {
			t.set(ev.responseUsage.usage(OpenAIResponses))
		}
	case ev.gemini.present:
		t.addGemini(ev.gemini)
	case ev.promptEvalCount.set || ev.evalCount.set:
		// Ollama reports the counts on its final object only.
		t.set(budget.Usage{InputTokens: ev.promptEvalCount.v, OutputTokens: ev.evalCount.v}, true)
	case ev.usage.present:
		// A chat chunk with "usage": null has none.
		t.set(ev.usage.usage(f))
	}
}

// addMessageDelta adds an Anthropic message_delta's usage: cumulative, the
// last value wins, never a sum. Newer API versions repeat the input counts
// here too.
func (t *tally) addMessageDelta(fields *usageFields) {
	if fields.has(outputTokens) {
		t.usage.OutputTokens = fields.count[outputTokens]
	}
	if fields.has(webSearch) {
		t.usage.WebSearchCalls = fields.count[webSearch]
	}
	if fields.has(inputTokens) || fields.has(cacheRead) || fields.has(cacheCreation) {
		if u, ok := fields.usage(Anthropic); ok && u.InputTokens > 0 {
			t.usage = t.usage.WithInputOf(u)
			t.inputKnown = true
		}
	}
	t.complete = true
}

// addGemini adds a Gemini chunk's usageMetadata.
func (t *tally) addGemini(m geminiUsage) {
	u := budget.Usage{
		// The tool-use prompt (what a tool returned, read back) is
		// billed as input, apart from promptTokenCount.
		InputTokens:       budget.AddCounts(m.prompt, m.toolUse),
		CachedInputTokens: m.cachedContent,
		AudioInputTokens:  m.audio,
		OutputTokens:      budget.AddCounts(m.candidates, m.thoughts),
		ReasoningTokens:   m.thoughts,
	}
	if t.finished {
		t.set(u, true)
		return
	}
	// Until the response has finished, Gemini's usageMetadata is a
	// running count (some chunks hold the prompt alone): the largest of
	// each count so far is a lower bound of the final one, not a report.
	t.usage = budget.Usage{
		InputTokens:       max(t.usage.InputTokens, u.InputTokens),
		CachedInputTokens: max(t.usage.CachedInputTokens, u.CachedInputTokens),
		AudioInputTokens:  max(t.usage.AudioInputTokens, u.AudioInputTokens),
		OutputTokens:      max(t.usage.OutputTokens, u.OutputTokens),
		ReasoningTokens:   max(t.usage.ReasoningTokens, u.ReasoningTokens),
	}
	t.inputKnown, t.complete = t.usage.InputTokens > 0, false
}

func (t *tally) set(u budget.Usage, ok bool) {
	if ok {
		t.usage, t.complete, t.inputKnown = u, true, true
	}
}

// readEvent reads one payload of format f into ev, which must be zero. It
// is false when the payload is not a JSON object or is one that
// encoding/json would refuse to decode into the usage fields read (bad
// syntax anywhere, or a usage field holding the wrong type): such a payload
// counts nothing. memo, when not nil, lets a payload that starts like the
// last one skip what they share (see prefixMemo), and is updated. tmpl,
// when not nil, becomes the payload's template if it is valid (see
// eventTemplate).
func readEvent(data []byte, ev *event, f Format, memo *prefixMemo, tmpl *eventTemplate) bool {
	return readCounted(data, ev, f, memo, tmpl, nil)
}

// readCounted is readEvent that counts the tokens of the output values
// read with tc, when not nil (a payload that fails counts them too: the
// caller takes them back).
func readCounted(data []byte, ev *event, f Format, memo *prefixMemo, tmpl *eventTemplate, tc *textCount) bool {
	if tmpl != nil {
		tmpl.begin()
	}
	if len(data) == 0 || data[0] != '{' || data[len(data)-1] != '}' {
		data = bytes.TrimSpace(data)
		if len(data) == 0 || data[0] != '{' {
			return false
		}
	}
	s := scanner{b: data, i: 1, tmpl: tmpl, tc: tc}
	k := 0
	if memo != nil {
		k = memo.resume(&s, ev)
	}
	s.eventMembers(ev, f, k, memo)
	ev.text, ev.finished = ev.output.total(outputOf(f)), ev.output.ends != 0
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
// on, its output by format f's table; memo, when not nil, learns where the
// members that change nothing but the kind end.
func (s *scanner) eventMembers(ev *event, f Format, k int, memo *prefixMemo) {
	out := outputOf(f)
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
			var text int64
			var end bool
			ev.message, text, end, ok = s.message(f, &ev.messageUsage)
			if j := out.message; j >= 0 {
				ev.output.set(j, text, end)
			}
		case "response":
			if text := s.response(&ev.responseUsage, &ev.responseTier, out.response >= 0); out.response >= 0 {
				ev.output.set(out.response, text, false)
			}
		case "service_tier":
			// Plain for the memo: a run that skips it in a later event holds
			// the same tier, which the tally keeps.
			ev.serviceTier, set = s.serviceTier(1), false
		case "usageMetadata":
			ev.gemini, ok = s.geminiUsage()
		case "done":
			ok, set = s.optBool(1), false
		case "prompt_eval_count":
			ev.promptEvalCount, ok = s.optInt(1)
		case "eval_count":
			ev.evalCount, ok = s.optInt(1)
		default:
			if out.mayName(key) {
				if j, text, end := s.topOutput(f, key); j >= 0 {
					ev.output.set(j, text, end)
					break
				}
			}
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
		if s.tc != nil {
			s.tc.text(s.b[start:end], plain, n)
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

// optOpaque reads a string or null that counts as output but holds no text
// the model wrote (opaqueField): its decoded length. A token counter counts
// it a token a byte, and a template compares it rather than taking it for
// its text hole.
func (s *scanner) optOpaque(d int) (int64, bool) {
	tc, tmpl := s.tc, s.tmpl
	s.tc, s.tmpl = nil, nil
	n, ok := s.optText(d)
	s.tc, s.tmpl = tc, tmpl
	if tmpl != nil {
		tmpl.textRead(-1, -1, 0)
	}
	if tc != nil && ok {
		tc.strict(n)
	}
	return n, ok
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

// usageMembers reads the members of an object (its '{' consumed), nested
// in d arrays and objects, of which only usage is read; ok is false when a
// field of it has the wrong type.
func (s *scanner) usageMembers(d int, usage *usageFields) (ok bool) {
	ok = true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return ok
		}
		if string(key) == "usage" {
			ok = s.usageFields(d, usage) && ok
		} else {
			s.skip(d)
		}
	}
}

// response reads the top-level response: a Responses event's response
// object (its usage into usage, its service_tier into tier; a wrong type in
// its usage leaves it without usage, as a failed decode did), or, when
// isText (the format's table names it), Ollama's generated text.
func (s *scanner) response(usage *usageFields, tier *tierField, isText bool) (text int64) {
	*usage, *tier = usageFields{}, tierField{}
	switch s.peek() {
	case '{':
		s.i++
		ok := true
		for k := 0; ; k++ {
			key, more := s.member(k)
			if !more {
				break
			}
			switch string(key) {
			case "usage":
				ok = s.usageFields(2, usage) && ok
			case "service_tier":
				*tier = s.serviceTier(2)
			default:
				s.skip(2)
			}
		}
		if !ok {
			*usage = usageFields{}
		}
		return 0
	case '"':
		if isText {
			text, _ = s.optText(1)
			return text
		}
	}
	s.skip(1)
	return 0
}

// audioTokens reads Gemini's promptTokensDetails, an array (or null) of
// {"modality", "tokenCount"}: the sum of the AUDIO modality's counts (-1
// past int64 or for a negative count, as budget.AddCounts). ok is false when
// a value has the wrong type.
func (s *scanner) audioTokens(d int) (audio int64, ok bool) {
	isArray, ok := s.array(d)
	if !isArray {
		return 0, ok
	}
	for k := 0; s.element(k); k++ {
		isObject, good := s.object(d + 1)
		ok = ok && good
		if !isObject {
			continue
		}
		var isAudio bool
		var count int64
		for m := 0; ; m++ {
			key, more := s.member(m)
			if !more {
				break
			}
			switch string(key) {
			case "modality":
				isAudio, good = s.modalityAudio(d + 2)
				ok = ok && good
			case "tokenCount":
				n, good := s.optInt(d + 2)
				count, ok = n.v, ok && good
			default:
				s.skip(d + 2)
			}
		}
		if isAudio {
			audio = budget.AddCounts(audio, count)
		}
	}
	return audio, ok
}

// modalityAudio reads a modality (a string or null): whether it is AUDIO.
func (s *scanner) modalityAudio(d int) (isAudio, ok bool) {
	switch s.peek() {
	case 'n':
		s.literal("null")
		return false, true
	case '"':
	default:
		s.skip(d)
		return false, false
	}
	start, end, plain := s.str()
	if s.failed {
		return false, false
	}
	name := s.b[start:end]
	if !plain {
		var buf [8]byte
		n, decoded := decodeASCII(buf[:], name)
		if !decoded {
			return false, true
		}
		name = buf[:n]
	}
	return string(name) == "AUDIO", true
}

// serviceTier reads a service_tier: a string names a tier (budget.ParseServiceTier),
// any other value is none and not an error.
func (s *scanner) serviceTier(d int) tierField {
	if s.peek() != '"' {
		s.skip(d)
		return tierField{}
	}
	start, end, plain := s.str()
	if s.failed {
		return tierField{}
	}
	name := s.b[start:end]
	if !plain {
		var buf [16]byte
		n, ok := decodeASCII(buf[:], name)
		if !ok {
			return tierField{set: true} // no tier's name: the standard tier
		}
		name = buf[:n]
	}
	var tier budget.ServiceTier
	switch string(name) {
	case "flex":
		tier = budget.FlexTier
	case "priority":
		tier = budget.PriorityTier
	case "batch":
		tier = budget.BatchTier
	}
	return tierField{tier: tier, set: true}
}

// jsonBytes reads any value: its length as written, 0 for null. Its strings
// and numbers are no template holes: its length is output.
func (s *scanner) jsonBytes(d int) int64 {
	start, tmpl, null := s.i, s.tmpl, s.peek() == 'n'
	s.tmpl = nil
	s.skip(d)
	if s.tmpl = tmpl; tmpl != nil {
		tmpl.textRead(-1, -1, 0)
	}
	if null || s.failed {
		return 0
	}
	if s.tc != nil {
		s.tc.strict(int64(s.i - start))
	}
	return int64(s.i - start)
}

// endMark reads a value that ends the response when it is a string, not
// empty. A string here is no template hole: it is compared.
func (s *scanner) endMark(d int) bool {
	if s.peek() != '"' {
		s.skip(d)
		return false
	}
	start, end, _ := s.str()
	return !s.failed && end > start
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
		case "toolUsePromptTokenCount":
			field = &g.toolUse
		case "promptTokensDetails":
			var good bool
			g.audio, good = s.audioTokens(2)
			ok = ok && good
			continue
		default:
			s.skip(2)
			continue
		}
		n, good := s.optInt(2)
		*field = n.v
		ok = ok && good
	}
}
