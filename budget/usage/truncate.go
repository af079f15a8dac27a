package usage

import (
	"bytes"
	"encoding/json"
	"strconv"

	"github.com/fleetguard/fleetguard/budget"
)

// Truncation is the end of a stream cut at its output lease, in the API's
// own terminal form, so a client (the official SDKs among them) reads a
// finished answer that stopped at its length, not a broken stream:
//
//   - OpenAI chat and legacy completions: a last chunk with finish_reason
//     "length", the usage chunk when withUsage, then [DONE];
//   - Responses: response.incomplete, reason max_output_tokens;
//   - Anthropic: content_block_stop of the open block, message_delta with
//     stop_reason "max_tokens", message_stop;
//   - Gemini: a chunk with finishReason "MAX_TOKENS";
//   - Ollama: a last line with done true and done_reason "length".
//
// withheld is the event held back at the lease (the stream's ids and model
// are taken from it); responses is, for Responses, what the stream output
// before it (the response object that ends it is built from it). u is what
// is reported as used. Cold path: it runs once per cut stream.
func Truncation(f Format, withheld []byte, responses *ResponsesOutput, u budget.Usage, withUsage bool) []byte {
	t := terminal{last: eventObject(withheld)}
	switch f {
	case OpenAIChat, OpenAICompletions:
		t.openAI(f, u, withUsage)
	case OpenAIResponses:
		t.responses(responses, u)
	case Anthropic:
		t.anthropic(u)
	case Gemini:
		t.gemini(u)
	case Ollama:
		t.ollama(u)
	}
	return t.out.Bytes()
}

// terminal is a stream's terminal form as it is written: last is the
// withheld event, decoded.
type terminal struct {
	out  bytes.Buffer
	last map[string]any
}

// copyOf puts into obj the fields of the withheld event named, those it has.
func (t *terminal) copyOf(obj map[string]any, keys ...string) map[string]any {
	for _, k := range keys {
		if v, ok := t.last[k]; ok {
			obj[k] = v
		}
	}
	return obj
}

// sse writes one SSE event of v, named event unless it is "".
func (t *terminal) sse(event string, v any) {
	if event != "" {
		t.out.WriteString("event: " + event + "\n")
	}
	b, _ := json.Marshal(v)
	t.out.WriteString("data: ")
	t.out.Write(b)
	t.out.WriteString("\n\n")
}

// openAI ends a Chat Completions or legacy completions stream: a last chunk
// with finish_reason length, the usage chunk if the client asked, [DONE].
func (t *terminal) openAI(f Format, u budget.Usage, withUsage bool) {
	object, choice := "chat.completion.chunk", map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "length"}
	if f == OpenAICompletions {
		object, choice = "text_completion", map[string]any{"index": 0, "text": "", "logprobs": nil, "finish_reason": "length"}
	}
	chunk := t.copyOf(map[string]any{"object": object, "choices": []any{choice}}, "id", "created", "model", "system_fingerprint")
	t.sse("", chunk)
	if withUsage {
		chunk["choices"] = []any{}
		chunk["usage"] = map[string]int64{"prompt_tokens": u.InputTokens, "completion_tokens": u.OutputTokens, "total_tokens": u.InputTokens + u.OutputTokens}
		t.sse("", chunk)
	}
	t.out.WriteString("data: [DONE]\n\n")
}

// responses ends a Responses stream with response.incomplete and the
// response as the client saw it.
func (t *terminal) responses(responses *ResponsesOutput, u budget.Usage) {
	resp := responses.response()
	resp["usage"] = map[string]any{"input_tokens": u.InputTokens, "output_tokens": u.OutputTokens, "total_tokens": u.InputTokens + u.OutputTokens,
		"input_tokens_details": map[string]any{"cached_tokens": u.CachedInputTokens}, "output_tokens_details": map[string]any{"reasoning_tokens": 0}}
	ev := map[string]any{"type": "response.incomplete", "response": resp}
	if n, ok := t.last["sequence_number"].(int64); ok {
		ev["sequence_number"] = n // the withheld event's: it never reached the client
	}
	t.sse("response.incomplete", ev)
}

// anthropic ends a Messages stream: the open content block stopped, a
// message_delta with stop_reason max_tokens, message_stop.
func (t *terminal) anthropic(u budget.Usage) {
	if t.last["type"] == "content_block_delta" || t.last["type"] == "content_block_start" {
		t.sse("content_block_stop", t.copyOf(map[string]any{"type": "content_block_stop"}, "index"))
	}
	t.sse("message_delta", map[string]any{"type": "message_delta", "delta": map[string]any{"stop_reason": "max_tokens", "stop_sequence": nil},
		"usage": map[string]int64{"output_tokens": u.OutputTokens}})
	t.sse("message_stop", map[string]any{"type": "message_stop"})
}

// gemini ends a Gemini stream with a chunk of finishReason MAX_TOKENS.
func (t *terminal) gemini(u budget.Usage) {
	chunk := map[string]any{
		"candidates":    []any{map[string]any{"content": map[string]any{"role": "model", "parts": []any{map[string]any{"text": ""}}}, "finishReason": "MAX_TOKENS", "index": 0}},
		"usageMetadata": map[string]int64{"promptTokenCount": u.InputTokens, "candidatesTokenCount": u.OutputTokens, "totalTokenCount": u.InputTokens + u.OutputTokens},
	}
	t.sse("", t.copyOf(chunk, "modelVersion", "responseId"))
}

// ollama ends an Ollama stream with a done line of done_reason length.
func (t *terminal) ollama(u budget.Usage) {
	line := t.copyOf(map[string]any{"done": true, "done_reason": "length", "prompt_eval_count": u.InputTokens, "eval_count": u.OutputTokens},
		"model", "created_at")
	if _, chat := t.last["message"]; chat {
		line["message"] = map[string]any{"role": "assistant", "content": ""}
	} else {
		line["response"] = ""
	}
	b, _ := json.Marshal(line)
	t.out.Write(b)
	t.out.WriteByte('\n')
}

// eventObject decodes the JSON object an SSE event's data lines (or an
// NDJSON line) carry; nil when there is none.
func eventObject(ev []byte) map[string]any {
	var data []byte
	if bytes.HasPrefix(bytes.TrimLeft(ev, " \t\r\n"), []byte("{")) {
		data = ev
	} else {
		for _, line := range bytes.FieldsFunc(ev, func(r rune) bool { return r == '\n' || r == '\r' }) {
			if rest, ok := bytes.CutPrefix(line, []byte("data:")); ok {
				data = append(data, bytes.TrimPrefix(rest, []byte(" "))...)
			}
		}
	}
	var obj map[string]any
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	if d.Decode(&obj) != nil {
		return nil
	}
	for k, v := range obj {
		if n, ok := v.(json.Number); ok {
			if i, err := strconv.ParseInt(string(n), 10, 64); err == nil {
				obj[k] = i
			} else if f, err := n.Float64(); err == nil {
				obj[k] = f
			}
		}
	}
	return obj
}
