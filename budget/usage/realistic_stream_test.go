package usage

import (
	"fmt"
	"strings"
	"testing"
)

// Long streams as upstreams send them (a template, eventTemplate, reads
// most of their events): n text deltas each.
var realisticStreams = []struct {
	name    string
	format  Format
	framing Framing
	stream  func(n int) []byte
}{
	{"openai_chat", OpenAIChat, SSE, realisticChatStream},
	{"openai_responses", OpenAIResponses, SSE, realisticResponsesStream},
	{"anthropic", Anthropic, SSE, realisticAnthropicStream},
	{"ollama", Ollama, NDJSON, realisticOllamaStream},
}

var (
	realisticWords = []string{" the", " proxy", " hums", ",", " light", " on", " the", " wire", ".", " \u00e9t\u00e9", " \"quoted\""}
	// OpenAI pads each streamed event to hide the text's length.
	realisticPads = []string{"x", "Zq", "a1b", "kLmN", "pqrs9", "AbCdEf"}
)

func word(i int) string { return realisticWords[i%len(realisticWords)] }

// realisticChatStream is a chat completion: each chunk as OpenAI sends it,
// with its obfuscation field, and the usage chunk last.
func realisticChatStream(n int) []byte {
	var b strings.Builder
	chunk := func(delta, finish, pad string) {
		fmt.Fprintf(&b, `data: {"id":"chatcmpl-CK2mJ0wDqfHjYpUu6v3GZ9xT1aB2c","object":"chat.completion.chunk","created":1759000000,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_560af6e559","choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":%s}],"usage":null,"obfuscation":"%s"}`+"\n\n", delta, finish, pad)
	}
	chunk(`{"role":"assistant","content":"","refusal":null}`, "null", "Qk")
	for i := 0; i < n; i++ {
		chunk(fmt.Sprintf(`{"content":%q}`, word(i)), "null", realisticPads[i%len(realisticPads)])
	}
	chunk(`{}`, `"stop"`, "Ab1")
	fmt.Fprintf(&b, `data: {"id":"chatcmpl-CK2mJ0wDqfHjYpUu6v3GZ9xT1aB2c","object":"chat.completion.chunk","created":1759000000,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_560af6e559","choices":[],"usage":{"prompt_tokens":19,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"obfuscation":"zz"}`+"\n\ndata: [DONE]\n\n", n, n+19)
	return []byte(b.String())
}

// realisticResponsesStream is a Responses API stream: sequence numbers and
// obfuscation change with every event.
func realisticResponsesStream(n int) []byte {
	var b strings.Builder
	b.WriteString("event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_68c1\",\"object\":\"response\",\"status\":\"in_progress\",\"usage\":null}}\n\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":%d,\"item_id\":\"msg_68c1a2b3c4d5e6f708192a3b4c5d6e7f\",\"output_index\":0,\"content_index\":0,\"delta\":%q,\"logprobs\":[],\"obfuscation\":%q}\n\n", i+1, word(i), realisticPads[i%len(realisticPads)])
	}
	fmt.Fprintf(&b, "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":%d,\"response\":{\"id\":\"resp_68c1\",\"object\":\"response\",\"status\":\"completed\",\"usage\":{\"input_tokens\":36,\"input_tokens_details\":{\"cached_tokens\":10},\"output_tokens\":%d,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":%d}}}\n\n", n+1, n, n+36)
	return []byte(b.String())
}

// realisticAnthropicStream is a Messages stream: text deltas, then a tool
// call's partial JSON.
func realisticAnthropicStream(n int) []byte {
	var b strings.Builder
	b.WriteString("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n")
	b.WriteString("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	for i := 0; i < n; i++ {
		if i == n/2 {
			b.WriteString("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n")
			b.WriteString("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_01\",\"name\":\"get_weather\",\"input\":{}}}\n\n")
		}
		if i < n/2 {
			fmt.Fprintf(&b, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":%q}}\n\n", word(i))
		} else {
			fmt.Fprintf(&b, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":%q}}\n\n", `{"city": "`+word(i))
		}
	}
	fmt.Fprintf(&b, "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":1}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":%d}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n", n)
	return []byte(b.String())
}

// realisticOllamaStream is Ollama's native chat stream: a timestamp on
// every line.
func realisticOllamaStream(n int) []byte {
	var b strings.Builder
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "{\"model\":\"llama3.2\",\"created_at\":\"2026-11-30T12:00:%02d.%06dZ\",\"message\":{\"role\":\"assistant\",\"content\":%q},\"done\":false}\n", i/1000%60, i*7919%1000000, word(i))
	}
	fmt.Fprintf(&b, "{\"model\":\"llama3.2\",\"created_at\":\"2026-11-30T12:01:00Z\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done_reason\":\"stop\",\"done\":true,\"total_duration\":4883583458,\"prompt_eval_count\":26,\"eval_count\":%d}\n", n)
	return []byte(b.String())
}

// BenchmarkMeterRealistic meters a long stream (200 deltas) with a new
// Meter, in 512-byte writes.
func BenchmarkMeterRealistic(b *testing.B) {
	for _, c := range realisticStreams {
		b.Run(c.name, func(b *testing.B) {
			stream := c.stream(200)
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			for b.Loop() {
				m := NewMeter(c.format, c.framing)
				writeIn512(m, stream)
				m.Close()
			}
		})
	}
}

// TestRealisticStreamsMatchReference: on long streams, whose events the
// template mostly reads, the meter reads what the reference read, in
// writes of several sizes.
func TestRealisticStreamsMatchReference(t *testing.T) {
	for _, c := range realisticStreams {
		stream := c.stream(200)
		want, ambiguous := refMeterRead(c.format, c.framing, stream)
		if ambiguous || !want.Complete || want.OutputTextBytes == 0 {
			t.Fatalf("%s: the reference read %+v (ambiguous %v)", c.name, want, ambiguous)
		}
		for _, n := range []int{1, 7, 100, 512, 4096, len(stream)} {
			if got := meter(c.format, c.framing, inWritesOf(stream, n)...); got != want {
				t.Fatalf("%s in writes of %d: %+v, the reference %+v", c.name, n, got, want)
			}
		}
	}
}

// TestTemplateReadsRealisticStreams: a long stream's deltas are read by the
// template, not in full (else BenchmarkMeterRealistic measures nothing new).
func TestTemplateReadsRealisticStreams(t *testing.T) {
	for _, c := range realisticStreams {
		m := NewMeter(c.format, c.framing)
		m.Write(c.stream(200))
		if m.template == nil || m.template.hits < 150 {
			t.Errorf("%s: %+v: the template read fewer than 150 of 200 deltas", c.name, m.template)
		}
	}
}
