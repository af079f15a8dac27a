package usage

import (
	"strings"
	"testing"
)

// stream frames payloads as format f's streams do: SSE events, or NDJSON
// lines for Ollama.
func stream(f Format, payloads ...string) (Framing, []byte) {
	var b strings.Builder
	for _, p := range payloads {
		if f == Ollama {
			b.WriteString(p + "\n")
		} else {
			b.WriteString("data: " + p + "\n\n")
		}
	}
	if f == Ollama {
		return NDJSON, []byte(b.String())
	}
	return SSE, []byte(b.String())
}

// TestMeterCountsEveryOutputField: the output each API streams, as it
// streams it, counts toward the estimate of a stream cut before its usage,
// read alike by the reference; a format reads its own fields only.
func TestMeterCountsEveryOutputField(t *testing.T) {
	tests := []struct {
		name    string
		format  Format
		payload string
		want    int64
	}{
		{"legacy completions text", OpenAICompletions,
			`{"id":"cmpl-1","object":"text_completion","created":1730000000,"choices":[{"text":"Hello","index":0,"logprobs":null,"finish_reason":null}],"model":"gpt-3.5-turbo-instruct"}`, 5},
		{"chat content", OpenAIChat, `{"choices":[{"index":0,"delta":{"content":"Hello"}}]}`, 5},
		{"vLLM and OpenRouter reasoning", OpenAIChat, `{"choices":[{"index":0,"delta":{"reasoning":"Think"}}]}`, 5},
		{"DeepSeek reasoning_content", OpenAIChat, `{"choices":[{"index":0,"delta":{"reasoning_content":"Think"}}]}`, 5},
		{"reasoning under both names counts once", OpenAIChat,
			`{"choices":[{"index":0,"delta":{"reasoning":"Think","reasoning_content":"Think"}}]}`, 5},
		{"refusal", OpenAIChat, `{"choices":[{"index":0,"delta":{"refusal":"No"}}]}`, 2},
		{"tool call name and arguments", OpenAIChat,
			`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{}"}}]}}]}`, 13},
		{"function_call", OpenAIChat, `{"choices":[{"index":0,"delta":{"function_call":{"name":"f","arguments":"{\"a\":1}"}}}]}`, 8},
		{"audio transcript, not its data", OpenAIChat,
			`{"choices":[{"index":0,"delta":{"audio":{"id":"audio_1","transcript":"Hi there","data":"UklGRg=="}}}]}`, 8},
		{"Responses output text", OpenAIResponses, `{"type":"response.output_text.delta","item_id":"msg_1","delta":"Hello"}`, 5},
		{"Responses reasoning summary", OpenAIResponses, `{"type":"response.reasoning_summary_text.delta","item_id":"rs_1","delta":"Plan"}`, 4},
		{"Responses function call arguments", OpenAIResponses, `{"type":"response.function_call_arguments.delta","item_id":"fc_1","delta":"{\"x\":"}`, 5},
		{"Responses encrypted reasoning", OpenAIResponses,
			`{"type":"response.output_item.done","output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[],"encrypted_content":"gAAAA"}}`, 5},
		{"Anthropic text", Anthropic, `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}`, 5},
		{"Anthropic thinking", Anthropic, `{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Hmm"}}`, 3},
		{"Anthropic signature", Anthropic, `{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQB"}}`, 4},
		{"Anthropic tool input", Anthropic, `{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a\""}}`, 4},
		{"Anthropic redacted thinking", Anthropic, `{"type":"content_block_start","index":0,"content_block":{"type":"redacted_thinking","data":"EmwK"}}`, 4},
		{"Anthropic tool use start", Anthropic,
			`{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"convert","input":{}}}`, 9},
		{"Gemini text", Gemini, `{"candidates":[{"content":{"parts":[{"text":"Nile"}],"role":"model"},"index":0}]}`, 4},
		{"Gemini thought", Gemini, `{"candidates":[{"content":{"parts":[{"text":"Considering","thought":true}],"role":"model"},"index":0}]}`, 11},
		{"Gemini thought signature", Gemini, `{"candidates":[{"content":{"parts":[{"text":"","thoughtSignature":"CiQB"}],"role":"model"},"index":0}]}`, 4},
		{"Gemini function call, its args as written", Gemini,
			`{"candidates":[{"content":{"parts":[{"functionCall":{"name":"log","args":{"a": 1}}}],"role":"model"},"index":0}]}`, 11},
		{"Gemini executable code", Gemini,
			`{"candidates":[{"content":{"parts":[{"executableCode":{"language":"PYTHON","code":"print(1)"}}],"role":"model"},"index":0}]}`, 8},
		{"Ollama chat content", Ollama, `{"model":"qwen3","message":{"role":"assistant","content":"Blue"},"done":false}`, 4},
		{"Ollama chat thinking", Ollama, `{"model":"qwen3","message":{"role":"assistant","content":"","thinking":"Hmm"},"done":false}`, 3},
		{"Ollama chat tool call", Ollama,
			`{"model":"qwen3","message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},"done":false}`, 8},
		{"Ollama generate response", Ollama, `{"model":"qwen3","response":"Blue","done":false}`, 4},
		{"Ollama generate thinking", Ollama, `{"model":"qwen3","response":"","thinking":"Hmm","done":false}`, 3},
		{"chat does not read completions' text", OpenAIChat, `{"choices":[{"index":0,"text":"Hello"}]}`, 0},
		{"completions do not read chat's delta", OpenAICompletions, `{"choices":[{"index":0,"delta":{"content":"Hello"}}]}`, 0},
		{"Anthropic does not read a string delta", Anthropic, `{"type":"content_block_delta","delta":"Hello"}`, 0},
		{"Responses do not read Ollama's response", OpenAIResponses, `{"response":"Hello"}`, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			framing, s := stream(tt.format, tt.payload)
			got := meter(tt.format, framing, s)
			if got.OutputTextBytes != tt.want {
				t.Errorf("%d bytes of output, want %d", got.OutputTextBytes, tt.want)
			}
			if want, _ := refMeterRead(tt.format, framing, s); got != want {
				t.Errorf("read %+v, the reference %+v", got, want)
			}
		})
	}
}

// TestMeterCountsCutStreams: a stream cut before its usage report is
// charged for the output it delivered (testdata/streams/*_cut.*: the whole
// reading, at every split, is TestMeterGolden's).
func TestMeterCountsCutStreams(t *testing.T) {
	for _, c := range streamCases(t) {
		if !strings.Contains(c.path, "_cut.") {
			continue
		}
		b := readStream(t, strings.TrimPrefix(c.path, "testdata/streams/"))
		r := meter(c.format, c.framing, b)
		if r.Complete || r.OutputTextBytes == 0 {
			t.Errorf("%s: %+v, want an incomplete reading with the output seen", c.path, r)
		}
	}
}

// TestEveryOutputLineIsRead: each line of each table, in an event of its
// own, is read by the scanner (output_readers.go) and the reference alike.
func TestEveryOutputLineIsRead(t *testing.T) {
	n, names := 0, 0
	for f, lines := range outputTables {
		n += len(lines)
		for _, l := range lines {
			steps := strings.Split(l.path, ".")
			for _, name := range strings.Split(steps[len(steps)-1], "|") {
				value, want := `"out"`, int64(3)
				switch l.kind {
				case jsonField:
					value, want = `{"k": [1, "v"]}`, int64(len(`{"k": [1, "v"]}`))
				case endField:
					value, want = `"STOP"`, 0
				}
				// Each object holds another member too, and each array an
				// element that holds no output.
				for i := len(steps) - 1; i >= 0; i-- {
					step := steps[i]
					if i == len(steps)-1 {
						step = name
					}
					if key, isArray := strings.CutSuffix(step, "[]"); isArray {
						value = `{"other":"x","` + key + `":[{"other":1},` + value + `]}`
					} else {
						value = `{"other":"x","` + step + `":` + value + `}`
					}
				}
				var ev event
				if !readEvent([]byte(value), &ev, Format(f), nil, nil) {
					t.Fatalf("%v %s: %s is not read", Format(f), l.path, value)
				}
				if ev.text != want || ev.finished != (l.kind == endField) {
					t.Errorf("%v %s: %s reads %d bytes (finished %v), want %d (%v)", Format(f), l.path, value, ev.text, ev.finished, want, l.kind == endField)
				}
				if text, ended := refOutput(outputOf(Format(f)), []byte(value)); text != ev.text || ended != ev.finished {
					t.Errorf("%v %s: the reference reads %d (finished %v)", Format(f), l.path, text, ended)
				}
				names++
			}
		}
	}
	if n < 30 || names <= n {
		t.Fatalf("%d names of %d lines read: the tables are not what this test reads", names, n)
	}
}

// TestAnOutputFieldOfAnotherTypeKeepsTheUsage: an output member holding
// another type than its table says counts nothing, and the usage beside it
// is still read; a usage field of the wrong type still drops the event.
func TestAnOutputFieldOfAnotherTypeKeepsTheUsage(t *testing.T) {
	tests := []struct {
		format   Format
		payload  string
		complete bool
	}{
		{OpenAIChat, `{"choices":[{"delta":{"content":5}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}`, true},
		{OpenAIChat, `{"choices":{"delta":"x"},"usage":{"prompt_tokens":3,"completion_tokens":4}}`, true},
		{OpenAICompletions, `{"choices":[{"text":["a"]}],"usage":{"prompt_tokens":3,"completion_tokens":4}}`, true},
		{Gemini, `{"candidates":[{"content":{"parts":[{"text":7}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":4}}`, true},
		{OpenAIChat, `{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":"3"}}`, false},
	}
	for _, tt := range tests {
		framing, s := stream(tt.format, tt.payload)
		got := meter(tt.format, framing, s)
		if got.Complete != tt.complete || got.OutputTextBytes != 0 && tt.complete {
			t.Errorf("%v %s: %+v, want complete %v and no output", tt.format, tt.payload, got, tt.complete)
		}
		if want, _ := refMeterRead(tt.format, framing, s); got != want {
			t.Errorf("%v %s: %+v, the reference %+v", tt.format, tt.payload, got, want)
		}
	}
}

// TestOutputTableErrors: a table the readers cannot read is refused when it
// is compiled (at init).
func TestOutputTableErrors(t *testing.T) {
	for _, lines := range [][]outputLine{
		{{"a.b", textField}, {"a", textField}},
		{{"a", textField}, {"a", textField}},
		{{"a[].b", textField}, {"a.c", textField}},
		{{"a|b", jsonField}},
		{{"a|b.c", textField}},
		{{"a[]", textField}},
		{{"a." + strings.Repeat("x", maxOutputNameBytes+1), textField}},
		{{`a"b`, textField}},
		{{"a..b", textField}},
	} {
		n := &outputNode{}
		var err error
		for _, l := range lines {
			if err = n.add(l.path, l.kind); err != nil {
				break
			}
		}
		if err == nil {
			t.Errorf("%v: compiled", lines)
		}
	}
}
