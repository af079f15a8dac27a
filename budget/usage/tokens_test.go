package usage

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/fleetguard/fleetguard/budget/bpe"
)

// TestTheMeterCountsEachOutputValueByTheTokenizer: with CountTokens, a
// stream's reading has the tokenizer's count of each output value alone,
// read in full or by the template, escapes decoded; a payload that does
// not parse counts nothing, and a value counted as written counts its
// bytes.
func TestTheMeterCountsEachOutputValueByTheTokenizer(t *testing.T) {
	c := bpe.Load(bpe.O200k)
	deltas := []string{"Hello", ",", " world", "!\n", " 日本語の", "テキスト", " \"quoted\"", " tab\there", " café", " 🙂"}
	m := NewMeter(OpenAIChat, SSE)
	m.CountTokens(c)
	var want, wantText, unparsed int64
	for i := range 60 {
		d := deltas[i%len(deltas)]
		content, _ := json.Marshal(d)
		ev := fmt.Sprintf(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":%s}}]}`+"\n\n", content)
		if i == 30 {
			// Cut: not JSON, so the tokenizer counts none of it and the
			// meter counts it whole as text.
			cut := `{"choices":[{"delta":{"content":"lost"}}]`
			_, _ = m.Write([]byte("data: " + cut + "\n\n"))
			unparsed += int64(len(cut))
		}
		_, _ = m.Write([]byte(ev))
		want += c.Count([]byte(d))
		wantText += int64(len(d))
	}
	r := m.Reading()
	if r.OutputTokens != want || r.OutputTokensText != wantText || r.OutputTextBytes != wantText+unparsed {
		t.Errorf("tokens %d of %d text bytes (meter: %d); want %d of %d (meter: %d)", r.OutputTokens, r.OutputTokensText, r.OutputTextBytes, want, wantText, wantText+unparsed)
	}
	if m.template == nil || m.template.hits == 0 {
		t.Error("the stream was not read by its template")
	}

	// A signature (of thinking billed) is no text the model wrote: a token
	// a byte, the thinking itself by the tokenizer.
	const sig = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxHvqs0yP8mS1cNIjAi"
	a := NewMeter(Anthropic, SSE)
	a.CountTokens(c)
	_, _ = a.Write([]byte(`data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me think."}}` + "\n\n"))
	_, _ = a.Write([]byte(`data: {"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"` + sig + `"}}` + "\n\n"))
	if r, want := a.Reading(), c.Count([]byte("Let me think."))+int64(len(sig)); r.OutputTokens != want || r.OutputTokensText != r.OutputTextBytes {
		t.Errorf("Anthropic thinking and signature: %d tokens of %d bytes (meter %d), want %d", r.OutputTokens, r.OutputTokensText, r.OutputTextBytes, want)
	}

	// Gemini's arguments are counted as written, a token a byte.
	g := NewMeter(Gemini, SSE)
	g.CountTokens(c)
	_, _ = g.Write([]byte(`data: {"candidates":[{"content":{"parts":[{"functionCall":{"name":"f","args":{"a":1}}}]}}]}` + "\n\n"))
	if r := g.Reading(); r.OutputTokens != 1+int64(len(`{"a":1}`)) || r.OutputTokensText != r.OutputTextBytes {
		t.Errorf("Gemini: %d tokens of %d bytes, meter %d", r.OutputTokens, r.OutputTokensText, r.OutputTextBytes)
	}
}

// TestCountingTokensAllocatesNothingAnEvent: a metered stream that counts
// tokens allocates nothing an event once it runs.
func TestCountingTokensAllocatesNothingAnEvent(t *testing.T) {
	m := NewMeter(OpenAIChat, SSE)
	m.CountTokens(bpe.Load(bpe.O200k))
	events := [][]byte{
		[]byte(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" the budget"}}]}` + "\n\n"),
		[]byte(`data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" caf\u00e9 \"x\"\n"}}]}` + "\n\n"),
	}
	for i := range 40 {
		_, _ = m.Write(events[i%2])
	}
	i := 0
	if n := testing.AllocsPerRun(200, func() { _, _ = m.Write(events[i%2]); i++ }); n != 0 {
		t.Errorf("%.1f allocations an event", n)
	}
}
