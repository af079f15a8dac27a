package usage

// The readers as they were before the byte scanner (encoding/json decoding
// every payload), kept as the reference the scanner is compared with
// (reference_diff_test.go) and benchmarked against. The usage is decoded
// into structs; the output is read by the formats' output tables
// (outputTables), member by member with encoding/json, by exact key case
// as upstreams write them.

import (
	"bytes"
	"encoding/json"
	"slices"

	"github.com/fleetguard/fleetguard/budget"
)

// refEvent is the union of the top-level fields that carry usage in any
// supported format: a whole JSON response, one SSE data payload, or one
// NDJSON line.
type refEvent struct {
	Type string `json:"type"`
	// OpenAI chat (final chunk or JSON body), Responses and Anthropic JSON
	// bodies, Anthropic message_delta.
	Usage *refFields `json:"usage"`
	// Anthropic message_start carries usage inside message.
	Message *struct {
		Usage *refFields `json:"usage"`
	} `json:"message"`
	// Responses events carry the response object.
	Response json.RawMessage `json:"response"`
	// OpenAI's tier that served the response.
	ServiceTier json.RawMessage `json:"service_tier"`
	// Gemini.
	UsageMetadata *struct {
		PromptTokenCount        int64 `json:"promptTokenCount"`
		CandidatesTokenCount    int64 `json:"candidatesTokenCount"`
		ThoughtsTokenCount      int64 `json:"thoughtsTokenCount"`
		CachedContentTokenCount int64 `json:"cachedContentTokenCount"`
		ToolUsePromptTokenCount int64 `json:"toolUsePromptTokenCount"`
		PromptTokensDetails     []*struct {
			Modality   string `json:"modality"`
			TokenCount int64  `json:"tokenCount"`
		} `json:"promptTokensDetails"`
	} `json:"usageMetadata"`
	// Ollama's native API.
	Done            bool   `json:"done"`
	PromptEvalCount *int64 `json:"prompt_eval_count"`
	EvalCount       *int64 `json:"eval_count"`

	// raw is the payload, for its output.
	raw []byte
}

// refTally accumulates what a response reported, event by event.
type refTally struct {
	usage budget.Usage
	// complete: a final usage report was seen (the last one wins).
	complete bool
	// inputKnown: the input tokens were reported even if the output was not
	// (Anthropic's message_start, Gemini's running usageMetadata).
	inputKnown bool
	// finished: the response said it has finished; Gemini's usageMetadata
	// is final from then on.
	finished bool
	// outputTextBytes counts the generated text seen, for an estimate when a
	// stream ends without usage.
	outputTextBytes int64
	// tier is the service tier last said.
	tier budget.ServiceTier
}

// billed is the usage reported, with the tier that served it.
func (t *refTally) billed() budget.Usage {
	u := t.usage
	u.ServiceTier = t.tier
	return u
}

// refTier reads a service_tier: a string names a tier, anything else none.
func refTier(raw json.RawMessage) (budget.ServiceTier, bool) {
	var s string
	if len(raw) == 0 || raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return 0, false
	}
	return budget.ParseServiceTier(s), true
}

// add folds one parsed event into the tally.
func (t *refTally) add(f Format, ev *refEvent) {
	text, finished := refOutput(outputOf(f), ev.raw)
	t.outputTextBytes += text
	t.finished = t.finished || finished
	if tier, ok := refTier(ev.ServiceTier); ok {
		t.tier = tier
	}
	switch {
	case ev.Type == "message_start" && ev.Message != nil && ev.Message.Usage != nil:
		if u, ok := ev.Message.Usage.Usage(Anthropic); ok {
			t.usage = t.usage.WithInputOf(u)
			t.usage.OutputTokens = max(t.usage.OutputTokens, u.OutputTokens)
			t.usage.WebSearchCalls = max(t.usage.WebSearchCalls, u.WebSearchCalls)
			t.inputKnown = true
		}
	case ev.Type == "message_delta" && ev.Usage != nil:
		// Cumulative: the last value wins, never a sum. Newer API versions
		// repeat the input counts here too.
		fields := ev.Usage
		if fields.OutputTokens != nil {
			t.usage.OutputTokens = *fields.OutputTokens
		}
		if fields.ServerToolUse != nil {
			t.usage.WebSearchCalls = fields.ServerToolUse.WebSearchRequests
		}
		if fields.InputTokens != nil || fields.CacheReadInputTokens != nil || fields.CacheCreationInputTokens != nil {
			if u, ok := fields.Usage(Anthropic); ok && u.InputTokens > 0 {
				t.usage = t.usage.WithInputOf(u)
				t.inputKnown = true
			}
		}
		t.complete = true
	case ev.Type == "response.completed" || ev.Type == "response.incomplete" || ev.Type == "response.failed":
		var resp struct {
			Usage       *refFields      `json:"usage"`
			ServiceTier json.RawMessage `json:"service_tier"`
		}
		err := json.Unmarshal(ev.Response, &resp)
		if tier, ok := refTier(resp.ServiceTier); ok {
			t.tier = tier
		}
		if err == nil && resp.Usage != nil {
			t.set(resp.Usage.Usage(OpenAIResponses))
		}
	case ev.UsageMetadata != nil:
		m := ev.UsageMetadata
		var audio int64
		for _, d := range m.PromptTokensDetails {
			if d != nil && d.Modality == "AUDIO" {
				audio = budget.AddCounts(audio, d.TokenCount)
			}
		}
		u := budget.Usage{
			InputTokens:       budget.AddCounts(m.PromptTokenCount, m.ToolUsePromptTokenCount),
			CachedInputTokens: m.CachedContentTokenCount,
			AudioInputTokens:  audio,
			OutputTokens:      budget.AddCounts(m.CandidatesTokenCount, m.ThoughtsTokenCount),
			ReasoningTokens:   m.ThoughtsTokenCount,
		}
		if t.finished {
			t.set(u, true)
			break
		}
		// A running count until the response has finished: the largest of
		// each count so far.
		t.usage = budget.Usage{
			InputTokens:       max(t.usage.InputTokens, u.InputTokens),
			CachedInputTokens: max(t.usage.CachedInputTokens, u.CachedInputTokens),
			AudioInputTokens:  max(t.usage.AudioInputTokens, u.AudioInputTokens),
			OutputTokens:      max(t.usage.OutputTokens, u.OutputTokens),
			ReasoningTokens:   max(t.usage.ReasoningTokens, u.ReasoningTokens),
		}
		t.inputKnown, t.complete = t.usage.InputTokens > 0, false
	case ev.PromptEvalCount != nil || ev.EvalCount != nil:
		// Ollama reports the counts on its final object only.
		var in, out int64
		if ev.PromptEvalCount != nil {
			in = *ev.PromptEvalCount
		}
		if ev.EvalCount != nil {
			out = *ev.EvalCount
		}
		t.set(budget.Usage{InputTokens: in, OutputTokens: out}, true)
	case ev.Usage != nil:
		// A chat chunk with "usage": null decodes to nil and lands elsewhere.
		t.set(ev.Usage.Usage(f))
	}
}

func (t *refTally) set(u budget.Usage, ok bool) {
	if ok {
		t.usage, t.complete, t.inputKnown = u, true, true
	}
}

// refOutput reads the output the object raw holds by the table n: the
// bytes of its output members, and whether one ends the response. A value
// of another type than its table says holds none.
func refOutput(n *outputNode, raw []byte) (text int64, ended bool) {
	var members map[string]json.RawMessage
	if json.Unmarshal(raw, &members) != nil {
		return 0, false
	}
	held := make([]int64, len(n.names))
	for j, name := range n.names {
		v, ok := members[name]
		if !ok {
			continue
		}
		switch f := &n.fields[j]; f.kind {
		case textField, opaqueField:
			var s string
			if json.Unmarshal(v, &s) == nil {
				held[j] = int64(len(s))
			}
		case jsonField:
			if string(v) != "null" {
				held[j] = int64(len(v))
			}
		case endField:
			var s string
			ended = ended || json.Unmarshal(v, &s) == nil && s != ""
		case objectField:
			t, e := refOutput(f.node, v)
			held[j], ended = t, ended || e
		case arrayField:
			var elems []json.RawMessage
			if json.Unmarshal(v, &elems) != nil {
				continue
			}
			for _, elem := range elems {
				t, e := refOutput(f.node, elem)
				held[j], ended = held[j]+t, ended || e
			}
		}
	}
	// Of a group of names ("a|b"), the largest counts.
	for _, g := range n.groups {
		largest := int64(0)
		for _, j := range g {
			largest, held[j] = max(largest, held[j]), 0
		}
		held[g[0]] = largest
	}
	for _, t := range held {
		text += t
	}
	return text, ended
}

// refParseEvent decodes one JSON payload; false when it is not a JSON object.
func refParseEvent(data []byte) (*refEvent, bool) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 || data[0] != '{' {
		return nil, false
	}
	ev := refEvent{raw: data}
	if json.Unmarshal(data, &ev) != nil {
		return nil, false
	}
	return &ev, true
}

// refFields is the union of the usage fields of every supported format, as they
// appear in a JSON response or in the usage object of a stream event.
type refFields struct {
	// OpenAI Chat Completions.
	PromptTokens        *int64 `json:"prompt_tokens"`
	CompletionTokens    *int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
		AudioTokens  int64 `json:"audio_tokens"`
	} `json:"prompt_tokens_details"`
	CompletionTokensDetails *struct {
		ReasoningTokens int64 `json:"reasoning_tokens"`
		AudioTokens     int64 `json:"audio_tokens"`
	} `json:"completion_tokens_details"`
	// OpenAI Responses and Anthropic Messages.
	InputTokens        *int64 `json:"input_tokens"`
	OutputTokens       *int64 `json:"output_tokens"`
	InputTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokensDetails *struct {
		ReasoningTokens int64 `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	// Anthropic prompt caching: these add to input_tokens.
	CacheCreationInputTokens *int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     *int64 `json:"cache_read_input_tokens"`
	CacheCreation            *struct {
		Ephemeral5m int64 `json:"ephemeral_5m_input_tokens"`
		Ephemeral1h int64 `json:"ephemeral_1h_input_tokens"`
	} `json:"cache_creation"`
	ServerToolUse *struct {
		WebSearchRequests int64 `json:"web_search_requests"`
	} `json:"server_tool_use"`
}

// Usage normalises the fields of format f. OpenAI's cached tokens are part of
// its input count; Anthropic's cache reads and writes come on top of it.
func (u *refFields) Usage(f Format) (budget.Usage, bool) {
	v := func(p *int64) int64 {
		if p == nil {
			return 0
		}
		return *p
	}
	switch {
	case u.PromptTokens != nil || u.CompletionTokens != nil:
		out := budget.Usage{InputTokens: v(u.PromptTokens), OutputTokens: v(u.CompletionTokens)}
		if d := u.PromptTokensDetails; d != nil {
			out.CachedInputTokens, out.AudioInputTokens = d.CachedTokens, d.AudioTokens
		}
		if d := u.CompletionTokensDetails; d != nil {
			out.ReasoningTokens, out.AudioOutputTokens = d.ReasoningTokens, d.AudioTokens
		}
		return out, true
	case f == Anthropic || u.CacheCreationInputTokens != nil || u.CacheReadInputTokens != nil:
		if u.InputTokens == nil && u.OutputTokens == nil && u.CacheReadInputTokens == nil && u.CacheCreationInputTokens == nil {
			return budget.Usage{}, false
		}
		// The flat count is every cache write; the breakdown says which
		// last an hour (without it, all last 5 minutes).
		var m5, h1 int64
		if c := u.CacheCreation; c != nil {
			m5, h1 = c.Ephemeral5m, c.Ephemeral1h
		}
		read, writes := v(u.CacheReadInputTokens), v(u.CacheCreationInputTokens)
		if u.CacheCreationInputTokens == nil {
			writes = budget.AddCounts(m5, h1)
		}
		hour := min(max(h1, 0), max(writes, 0))
		out := budget.Usage{
			InputTokens:        budget.AddCounts(v(u.InputTokens), writes, read),
			CachedInputTokens:  read,
			CacheWriteTokens:   max(writes, 0) - hour,
			CacheWrite1hTokens: hour,
			OutputTokens:       v(u.OutputTokens),
		}
		if u.ServerToolUse != nil {
			out.WebSearchCalls = u.ServerToolUse.WebSearchRequests
		}
		return out, true
	case u.InputTokens != nil || u.OutputTokens != nil:
		out := budget.Usage{InputTokens: v(u.InputTokens), OutputTokens: v(u.OutputTokens)}
		if u.InputTokensDetails != nil {
			out.CachedInputTokens = u.InputTokensDetails.CachedTokens
		}
		if u.OutputTokensDetails != nil {
			out.ReasoningTokens = u.OutputTokensDetails.ReasoningTokens
		}
		return out, true
	}
	return budget.Usage{}, false
}

// refFromJSON reads the usage of a non-streaming JSON response of format f
// (Gemini's usageMetadata and Ollama's final counts are recognised by their
// fields). The second result is false when the body reports no usage.
func refFromJSON(f Format, body []byte) (budget.Usage, bool) {
	ev, ok := refParseEvent(body)
	if !ok {
		return budget.Usage{}, false
	}
	t := refTally{finished: true} // a whole response: its usage is final
	t.add(f, ev)
	return t.billed(), t.complete
}

// refMeter reads usage from a streamed response as its bytes pass, keeping at
// most one event (MaxEventBytes) in memory whatever the stream's length or
// line length. Any split of the stream into Writes gives the same result.
type refMeter struct {
	format  Format
	framing Framing

	line         []byte // the current line, without its terminator
	lineOverflow int64  // bytes of the current line past MaxEventBytes
	afterCR      bool   // the last byte seen was \r: a following \n is part of it

	data         []byte // SSE: the data of the current event
	dataOverflow bool
	hasData      bool

	tally refTally
	bytes int64

	// ambiguous: a payload read had a key given twice or in another case
	// than a field's, which encoding/json and the scanner read differently
	// (by design: the scanner reads keys as upstreams do). Checked only
	// when checkAmbiguity is set (not in benchmarks).
	checkAmbiguity, ambiguous bool
}

// newRefMeter meters a stream of format f framed as framing.
func newRefMeter(f Format, framing Framing) *refMeter {
	return &refMeter{format: f, framing: framing}
}

// Write observes the next bytes of the stream. It never fails and never
// keeps p.
func (m *refMeter) Write(p []byte) (int, error) {
	n := len(p)
	m.bytes += int64(n)
	for len(p) > 0 {
		if m.afterCR {
			m.afterCR = false
			if p[0] == '\n' {
				p = p[1:]
				continue
			}
		}
		i := bytes.IndexAny(p, "\r\n")
		if i < 0 {
			m.appendLine(p)
			return n, nil
		}
		m.appendLine(p[:i])
		m.afterCR = p[i] == '\r'
		p = p[i+1:]
		m.endLine()
	}
	return n, nil
}

// Close ends the stream: a last unterminated line and a last event without
// its blank line are read too (a cut one fails to parse and counts nothing).
func (m *refMeter) Close() {
	if len(m.line) > 0 || m.lineOverflow > 0 {
		m.endLine()
	}
	m.dispatch()
}

// Reading returns what the stream has reported so far.
func (m *refMeter) Reading() Reading {
	return Reading{
		Usage:           m.tally.billed(),
		Complete:        m.tally.complete,
		InputKnown:      m.tally.inputKnown,
		OutputTextBytes: m.tally.outputTextBytes,
		Bytes:           m.bytes,
	}
}

func (m *refMeter) appendLine(p []byte) {
	room := MaxEventBytes - len(m.line)
	if m.lineOverflow > 0 {
		room = 0
	}
	keep := min(room, len(p))
	m.line = appendBounded(m.line, p[:keep])
	m.lineOverflow += int64(len(p) - keep)
}

func (m *refMeter) endLine() {
	line, overflow := m.line, m.lineOverflow
	m.line, m.lineOverflow = m.line[:0], 0
	if overflow > 0 {
		// Too long to parse: count it as generated text, which errs on the
		// side of charging, and drop any event it belongs to.
		m.tally.outputTextBytes += int64(len(line)) + overflow
		if m.framing == SSE {
			m.dataOverflow = true
		}
		return
	}
	if m.framing == NDJSON {
		m.ambiguous = m.ambiguous || m.checkAmbiguity && ambiguousJSON(line)
		if ev, ok := refParseEvent(line); ok {
			m.tally.add(m.format, ev)
		} else if s := string(bytes.TrimSpace(line)); s != "[DONE]" {
			m.tally.outputTextBytes += int64(len(line))
		}
		return
	}
	m.sseLine(line)
}

// sseLine handles one line of text/event-stream.
func (m *refMeter) sseLine(line []byte) {
	if len(line) == 0 {
		m.dispatch()
		return
	}
	value, isData := bytes.CutPrefix(line, []byte("data:"))
	if !isData {
		// Comments and the fields that carry no output are free; any other
		// line counts as output text.
		name, _, _ := bytes.Cut(line, []byte(":"))
		if line[0] != ':' && !slices.Contains([]string{"event", "id", "retry", "data"}, string(name)) {
			m.tally.outputTextBytes += int64(len(line))
		}
		return
	}
	value, _ = bytes.CutPrefix(value, []byte(" "))
	if m.dataOverflow {
		return
	}
	sep := 0
	if m.hasData {
		sep = 1
	}
	if len(m.data)+sep+len(value) > MaxEventBytes {
		m.tally.outputTextBytes += int64(len(m.data) + len(value))
		m.data, m.dataOverflow = m.data[:0], true
		return
	}
	if sep == 1 {
		m.data = appendBounded(m.data, []byte{'\n'})
	}
	m.data = appendBounded(m.data, value)
	m.hasData = true
}

// dispatch ends the current SSE event.
func (m *refMeter) dispatch() {
	if m.hasData && !m.dataOverflow {
		m.ambiguous = m.ambiguous || m.checkAmbiguity && ambiguousJSON(m.data)
		if ev, ok := refParseEvent(m.data); ok {
			m.tally.add(m.format, ev)
		} else if s := string(bytes.TrimSpace(m.data)); s != "[DONE]" {
			m.tally.outputTextBytes += int64(len(m.data))
		}
	}
	m.data, m.hasData, m.dataOverflow = m.data[:0], false, false
}

// refIsUsageOnlyChunk reports whether the SSE event ev is the final chunk an
// OpenAI stream sends when asked for usage: "choices" empty, "usage" set.
func refIsUsageOnlyChunk(ev []byte) bool {
	if !bytes.Contains(ev, []byte(`"usage"`)) {
		return false
	}
	var data []byte
	for _, line := range bytes.FieldsFunc(ev, func(r rune) bool { return r == '\n' || r == '\r' }) {
		if v, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimPrefix(v, []byte(" "))...)
		}
	}
	var chunk struct {
		Choices *[]json.RawMessage `json:"choices"`
		Usage   json.RawMessage    `json:"usage"`
	}
	if json.Unmarshal(data, &chunk) != nil {
		return false
	}
	return chunk.Choices != nil && len(*chunk.Choices) == 0 && len(chunk.Usage) > 0 && string(chunk.Usage) != "null"
}
