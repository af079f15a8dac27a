package usage

import (
	"bytes"
	"encoding/json"

	"github.com/fleetguard/fleetguard/budget"
)

// event is the union of the top-level fields that carry usage or output text
// in any supported format: a whole JSON response, one SSE data payload, or
// one NDJSON line.
type event struct {
	Type string `json:"type"`
	// OpenAI chat (final chunk or JSON body), Responses and Anthropic JSON
	// bodies, Anthropic message_delta.
	Usage *Fields `json:"usage"`
	// Anthropic message_start carries usage inside message; Ollama chat
	// carries the output text there.
	Message *struct {
		Usage   *Fields         `json:"usage"`
		Content json.RawMessage `json:"content"`
	} `json:"message"`
	// Responses events carry the response object; Ollama's generate API has a
	// string here.
	Response json.RawMessage `json:"response"`
	// Output text: chat chunks.
	Choices []struct {
		Delta *struct {
			Content          *string `json:"content"`
			ReasoningContent *string `json:"reasoning_content"`
			Refusal          *string `json:"refusal"`
			ToolCalls        []struct {
				Function struct {
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"delta"`
	} `json:"choices"`
	// Output text: Responses (a string) and Anthropic (an object) deltas.
	Delta json.RawMessage `json:"delta"`
	// Gemini.
	UsageMetadata *struct {
		PromptTokenCount        int64 `json:"promptTokenCount"`
		CandidatesTokenCount    int64 `json:"candidatesTokenCount"`
		ThoughtsTokenCount      int64 `json:"thoughtsTokenCount"`
		CachedContentTokenCount int64 `json:"cachedContentTokenCount"`
	} `json:"usageMetadata"`
	Candidates []struct {
		Content struct {
			Parts []struct {
				Text string `json:"text"`
			} `json:"parts"`
		} `json:"content"`
	} `json:"candidates"`
	// Ollama's native API.
	Done            bool   `json:"done"`
	PromptEvalCount *int64 `json:"prompt_eval_count"`
	EvalCount       *int64 `json:"eval_count"`
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

// add folds one parsed event into the tally.
func (t *tally) add(f Format, ev *event) {
	t.addText(ev)
	switch {
	case ev.Type == "message_start" && ev.Message != nil && ev.Message.Usage != nil:
		if u, ok := ev.Message.Usage.Usage(Anthropic); ok {
			t.usage.InputTokens, t.usage.CachedInputTokens = u.InputTokens, u.CachedInputTokens
			t.usage.OutputTokens = max(t.usage.OutputTokens, u.OutputTokens)
			t.inputKnown = true
		}
	case ev.Type == "message_delta" && ev.Usage != nil:
		// Cumulative: the last value wins, never a sum. Newer API versions
		// repeat the input counts here too.
		fields := ev.Usage
		if fields.OutputTokens != nil {
			t.usage.OutputTokens = max(*fields.OutputTokens, 0)
		}
		if fields.InputTokens != nil || fields.CacheReadInputTokens != nil || fields.CacheCreationInputTokens != nil {
			if u, ok := fields.Usage(Anthropic); ok && u.InputTokens > 0 {
				t.usage.InputTokens, t.usage.CachedInputTokens = u.InputTokens, u.CachedInputTokens
				t.inputKnown = true
			}
		}
		t.complete = true
	case ev.Type == "response.completed" || ev.Type == "response.incomplete" || ev.Type == "response.failed":
		var resp struct {
			Usage *Fields `json:"usage"`
		}
		if json.Unmarshal(ev.Response, &resp) == nil && resp.Usage != nil {
			t.set(resp.Usage.Usage(OpenAIResponses))
		}
	case ev.UsageMetadata != nil:
		m := ev.UsageMetadata
		t.set(budget.Usage{
			InputTokens:       max(m.PromptTokenCount, 0),
			CachedInputTokens: max(m.CachedContentTokenCount, 0),
			OutputTokens:      max(m.CandidatesTokenCount, 0) + max(m.ThoughtsTokenCount, 0),
		}, true)
	case ev.PromptEvalCount != nil || ev.EvalCount != nil:
		// Ollama reports the counts on its final object only.
		var in, out int64
		if ev.PromptEvalCount != nil {
			in = max(*ev.PromptEvalCount, 0)
		}
		if ev.EvalCount != nil {
			out = max(*ev.EvalCount, 0)
		}
		t.set(budget.Usage{InputTokens: in, OutputTokens: out}, true)
	case ev.Usage != nil:
		// A chat chunk with "usage": null decodes to nil and lands elsewhere.
		t.set(ev.Usage.Usage(f))
	}
}

func (t *tally) set(u budget.Usage, ok bool) {
	if ok {
		t.usage, t.complete, t.inputKnown = u, true, true
	}
}

// addText counts the generated text an event carries.
func (t *tally) addText(ev *event) {
	for _, c := range ev.Choices {
		d := c.Delta
		if d == nil {
			continue
		}
		for _, s := range []*string{d.Content, d.ReasoningContent, d.Refusal} {
			if s != nil {
				t.outputTextBytes += int64(len(*s))
			}
		}
		for _, tc := range d.ToolCalls {
			t.outputTextBytes += int64(len(tc.Function.Arguments))
		}
	}
	if len(ev.Delta) > 0 {
		switch ev.Delta[0] {
		case '"': // Responses: response.output_text.delta and friends
			var s string
			if json.Unmarshal(ev.Delta, &s) == nil {
				t.outputTextBytes += int64(len(s))
			}
		case '{': // Anthropic content_block_delta
			var d struct {
				Text        string `json:"text"`
				PartialJSON string `json:"partial_json"`
				Thinking    string `json:"thinking"`
			}
			if json.Unmarshal(ev.Delta, &d) == nil {
				t.outputTextBytes += int64(len(d.Text) + len(d.PartialJSON) + len(d.Thinking))
			}
		}
	}
	for _, c := range ev.Candidates {
		for _, p := range c.Content.Parts {
			t.outputTextBytes += int64(len(p.Text))
		}
	}
	if ev.Message != nil && len(ev.Message.Content) > 0 && ev.Message.Content[0] == '"' {
		var s string
		if json.Unmarshal(ev.Message.Content, &s) == nil {
			t.outputTextBytes += int64(len(s))
		}
	}
	if len(ev.Response) > 0 && ev.Response[0] == '"' {
		var s string
		if json.Unmarshal(ev.Response, &s) == nil {
			t.outputTextBytes += int64(len(s))
		}
	}
}

// parseEvent decodes one JSON payload; false when it is not a JSON object.
func parseEvent(data []byte) (*event, bool) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 || data[0] != '{' {
		return nil, false
	}
	var ev event
	if json.Unmarshal(data, &ev) != nil {
		return nil, false
	}
	return &ev, true
}
