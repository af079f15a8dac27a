// Command fakellm is a local OpenAI- and Anthropic-compatible upstream for
// trying fleetguard by hand and in bench scripts. Every answer reports a fixed
// usage. Chat completions with "stream": true are streamed as -chunks SSE
// chunks -interval apart, with a usage chunk only when the request sets
// stream_options.include_usage, as OpenAI does; /v1/messages streams the
// Anthropic event sequence.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:11434", "listen address")
	input := flag.Int("input", 30, "input tokens reported per request")
	output := flag.Int("output", 70, "output tokens reported per request")
	delay := flag.Duration("delay", 0, "wait before answering")
	chunks := flag.Int("chunks", 20, "chunks per streamed answer")
	interval := flag.Duration("interval", 50*time.Millisecond, "time between streamed chunks")
	flag.Parse()

	var served atomic.Int64
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		var req struct {
			Model         string `json:"model"`
			Stream        bool   `json:"stream"`
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &req)
		time.Sleep(*delay)
		anthropic := strings.HasSuffix(r.URL.Path, "/messages")
		switch {
		case req.Stream && anthropic:
			streamAnthropic(w, req.Model, *input, *output, *chunks, *interval)
		case req.Stream:
			streamChat(w, req.Model, *input, *output, *chunks, *interval, req.StreamOptions.IncludeUsage)
		case anthropic:
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"msg_fake","type":"message","role":"assistant","model":%q,"content":[{"type":"text","text":"hello"}],"stop_reason":"end_turn","usage":{"input_tokens":%d,"output_tokens":%d}}`, req.Model, *input, *output)
		default:
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"chatcmpl-fake","object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, req.Model, *input, *output, *input+*output)
		}
	})
	log.Printf("fakellm on %s: %d input + %d output tokens per request", *addr, *input, *output)
	log.Fatal(http.ListenAndServe(*addr, nil))
}

func flush(w http.ResponseWriter) { _ = http.NewResponseController(w).Flush() }

func streamChat(w http.ResponseWriter, model string, input, output, chunks int, interval time.Duration, includeUsage bool) {
	w.Header().Set("Content-Type", "text/event-stream")
	for i := 0; i < chunks; i++ {
		usage := ""
		if includeUsage {
			usage = `,"usage":null`
		}
		fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok%d \"}}]%s}\n\n", model, i, usage)
		flush(w)
		time.Sleep(interval)
	}
	if includeUsage {
		fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"model\":%q,\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", model, input, output, input+output)
	}
	io.WriteString(w, "data: [DONE]\n\n")
	flush(w)
}

func streamAnthropic(w http.ResponseWriter, model string, input, output, chunks int, interval time.Duration) {
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg\",\"type\":\"message\",\"role\":\"assistant\",\"model\":%q,\"content\":[],\"usage\":{\"input_tokens\":%d,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n", model, input)
	io.WriteString(w, "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n")
	flush(w)
	for i := 0; i < chunks; i++ {
		fmt.Fprintf(w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"tok%d \"}}\n\n", i)
		flush(w)
		time.Sleep(interval)
	}
	io.WriteString(w, "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n")
	fmt.Fprintf(w, "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":%d}}\n\n", output/2)
	fmt.Fprintf(w, "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":%d}}\n\n", output)
	io.WriteString(w, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n")
	flush(w)
}
