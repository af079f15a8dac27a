package usage

import (
	"bytes"
	"os"
	"testing"
)

// TestTemplateReadsRepeatedKeysLikeAFullRead: where a key is given twice
// (the last counts), a template reads the next event as a full read does.
// encoding/json merges repeats, so the reference cannot be the judge here.
func TestTemplateReadsRepeatedKeysLikeAFullRead(t *testing.T) {
	for _, c := range []struct {
		events []string
		text   int64
	}{
		{[]string{ // an empty text, overridden by a later delta
			`{"choices":[{"delta":{"content":""},"delta":{}}]}`,
			`{"choices":[{"delta":{"content":"abc"},"delta":{}}]}`,
		}, 0},
		{[]string{ // the first of two texts, which does not count
			`{"choices":[{"delta":{"content":"ab","content":"cd"}}]}`,
			`{"choices":[{"delta":{"content":"xyz","content":"cd"}}]}`,
		}, 4},
		{[]string{
			`{"choices":[{"delta":{"content":"ab","content":null}}]}`,
			`{"choices":[{"delta":{"content":"xyz","content":null}}]}`,
		}, 0},
		{[]string{ // a text, overridden by a delta without one
			`{"choices":[{"delta":{"content":"ab"},"delta":{}}]}`,
			`{"choices":[{"delta":{"content":"xyz"},"delta":{}}]}`,
		}, 0},
		{[]string{
			`{"choices":[{"delta":{"content":"ab"},"delta":{"content":"cd"}}]}`,
			`{"choices":[{"delta":{"content":"xyz"},"delta":{"content":"cd"}}]}`,
		}, 4},
	} {
		var stream []byte
		for _, e := range c.events {
			stream = append(stream, "data: "+e+"\n\n"...)
		}
		// meter also compares with a meter that keeps no template.
		if got := meter(OpenAIChat, SSE, stream).OutputTextBytes; got != c.text {
			t.Errorf("%q: %d bytes of text, want %d", c.events, got, c.text)
		}
	}
}

// TestTallyAddIsIdempotentButForText: folding an event twice changes only
// the text counted, which a template hit relies on (see eventTemplate).
func TestTallyAddIsIdempotentButForText(t *testing.T) {
	var events [][]byte
	for _, c := range streamCases(t) {
		b, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range bytes.Split(b, []byte("\n")) {
			events = append(events, bytes.TrimPrefix(bytes.TrimSpace(line), []byte("data: ")))
		}
	}
	for _, p := range payloads {
		events = append(events, []byte(p))
	}
	for _, es := range memoStreams {
		for _, e := range es {
			events = append(events, []byte(e))
		}
	}
	n := 0
	for _, f := range []Format{OpenAIChat, OpenAIResponses, Anthropic, Gemini, Ollama, OpenAICompletions} {
		for _, before := range events { // a tally in the state another event left
			for _, e := range events {
				var ev, evBefore event
				if !readEvent(e, &ev, f, nil, nil) {
					continue
				}
				var once tally
				if readEvent(before, &evBefore, f, nil, nil) {
					once.add(f, &evBefore)
				}
				once.add(f, &ev)
				twice := once
				twice.add(f, &ev)
				once.outputTextBytes += ev.textBytes()
				if twice != once {
					t.Fatalf("%s %s after %s: folded twice %+v, once %+v", f, e, before, twice, once)
				}
				n++
			}
		}
	}
	if n < 1000 {
		t.Fatalf("only %d events checked", n)
	}
}

// TestTemplateReadsAnEventWithoutHoles: an event with no value to skip
// (Anthropic's ping) is read by comparison when it repeats.
func TestTemplateReadsAnEventWithoutHoles(t *testing.T) {
	m := NewMeter(Anthropic, SSE)
	m.reads = templateAfter
	for range 5 {
		m.Write([]byte("event: ping\ndata: {\"type\": \"ping\"}\n\n"))
	}
	if m.template == nil || m.template.hits != 4 {
		t.Fatalf("template %+v: want 4 hits of 5 pings", m.template)
	}
}
