// Command fakellm runs internal/fakellm, a local OpenAI- and
// Anthropic-compatible upstream that reports a fixed usage, for trying
// fleetguard by hand and in the bench scripts.
package main

import (
	"flag"
	"log"
	"net/http"

	"github.com/fleetguard/fleetguard/internal/fakellm"
)

func main() {
	s := fakellm.New()
	addr := flag.String("addr", "127.0.0.1:11434", "listen address")
	flag.IntVar(&s.Input, "input", 30, "input tokens reported per request")
	flag.IntVar(&s.Output, "output", 70, "output tokens reported per request")
	flag.DurationVar(&s.Delay, "delay", 0, "wait before answering")
	flag.IntVar(&s.Chunks, "chunks", 20, "chunks per streamed answer")
	flag.DurationVar(&s.Interval, "interval", 50_000_000, "time between streamed chunks")
	flag.BoolVar(&s.Words, "words", false, "stream chat completions one word-like token per chunk, output chunks in all (-chunks unused)")
	flag.BoolVar(&s.OverwriteCap, "overwrite-cap", false, "report -output tokens whatever the request's output cap (max_tokens, max_completion_tokens, max_output_tokens); by default an answer stops at the cap")
	flag.Float64Var(&s.Jitter, "jitter", 0, "vary each answer's output by up to this fraction either way (0.2: ±20%)")
	flag.Parse()
	log.Printf("fakellm on %s: %d input + %d output tokens per request", *addr, s.Input, s.Output)
	log.Fatal(http.ListenAndServe(*addr, s))
}
