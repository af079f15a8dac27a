// Command ceiling prints, for text of every density, how the prompt estimate
// and the strict output bound of llmbudget compare with what o200k (OpenAI's
// tokenizer, which fakellm.Billed bills) counts: each is an upper bound
// (ratio at least 1), and the ratio is what a hold costs over the bill. So
// does the count of an OpenAI model's stream: budget/bpe's o200k count of
// each event's text alone, for events of 24 and of 8 bytes, against o200k's
// count of the whole text. The
// ceiling itself, through a real Caddy for every API, density and history,
// is the test suite's TestTheCeilingHoldsForAnyTextInEveryAPI; run it with
// longer texts and its per-case figures:
//
//	go run ./bench/ceiling
//	go test -run 'TestTheCeilingHoldsForAnyTextInEveryAPI' -v -ceiling.bytes 3000 . | grep counter
package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/fakellm"
)

func main() {
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "text\tbytes\to200k\tprompt estimate / o200k\toutput bound / o200k\tper-event count / o200k, 24 B events\t8 B events")
	counter := bpe.Load(bpe.O200k)
	for _, t := range texts() {
		content, _ := json.Marshal(t.text)
		body := `{"model":"gpt-4o","max_tokens":10,"messages":[{"role":"user","content":` + string(content) + `}]}`
		req, err := usage.ParseRequest(usage.OpenAIChat, "/v1/chat/completions", []byte(body))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		tok := fakellm.Tokens(t.text)
		if whole := counter.Count([]byte(t.text)); whole != tok {
			fmt.Fprintf(os.Stderr, "%s: budget/bpe counts %d, tiktoken-go %d\n", t.name, whole, tok)
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.2f\n", t.name, len(t.text), tok,
			float64(req.PromptTokens)/float64(tok), float64(usage.OutputTokenBound(int64(len(t.text))))/float64(tok),
			float64(perEvent(counter, t.text, 24))/float64(tok), float64(perEvent(counter, t.text, 8))/float64(tok))
	}
	w.Flush()
}

// texts are about 40,000 bytes each of every density, the random ones from
// a fixed seed, so every run measures the same texts.
func texts() []struct{ name, text string } {
	rng := rand.New(rand.NewPCG(7, 9))
	random := func(n int, alphabet string) string {
		var b strings.Builder
		for range n {
			b.WriteByte(alphabet[rng.IntN(len(alphabet))])
		}
		return b.String()
	}
	raw := make([]byte, 30000)
	for i := range raw {
		raw[i] = byte(rng.Uint32())
	}
	var csv, logs strings.Builder
	for csv.Len() < 40000 {
		fmt.Fprintf(&csv, "2026-%02d-%02d,%d.%02d,%d,-0.%04d\n", rng.IntN(12)+1, rng.IntN(28)+1, rng.IntN(100000), rng.IntN(100), rng.IntN(1000), rng.IntN(10000))
		fmt.Fprintf(&logs, "2026-11-03T12:%02d:%02d.%03dZ INFO request id=%08x path=/v1/chat/completions status=%d dur=%dms\n", rng.IntN(60), rng.IntN(60), rng.IntN(1000), rng.Uint32(), 200+rng.IntN(300), rng.IntN(2000))
	}
	repeat := func(s string) string { return strings.Repeat(s, 40000/len(s)+1) }
	return []struct{ name, text string }{
		{"English prose", repeat("The river runs north through eleven countries before it reaches the sea, and its delta feeds millions of people. ")},
		{"Go code", repeat("func (s *server) handle(w http.ResponseWriter, r *http.Request) {\n\tif err := s.check(r); err != nil {\n\t\thttp.Error(w, err.Error(), 400)\n\t}\n}\n")},
		{"JSON", repeat(`{"city":"Paris","days":[1,2,3],"units":"metric","limit":25,"coords":[48.8566,2.3522]}`)},
		{"logs", logs.String()},
		{"CSV of numbers", csv.String()},
		{"CJK", repeat("日本語のテキストは一文字ずつ数えられる。中文的文本也是如此。한국어도 마찬가지다。")},
		{"emoji", repeat("🎉👍🏽🚀✨🔥👨‍👩‍👧 ")},
		{"random hex", random(40000, "0123456789abcdef")},
		{"random base64", base64.StdEncoding.EncodeToString(raw)},
	}
}

// perEvent is the sum of counter's counts of text's events of size bytes
// (whole characters), as a meter that counted each event alone would have.
func perEvent(counter *bpe.Counter, text string, size int) int64 {
	var n int64
	for len(text) > 0 {
		k := min(size, len(text))
		for k < len(text) && text[k]&0xC0 == 0x80 {
			k++ // whole characters, as an upstream sends them
		}
		n += counter.Count([]byte(text[:k]))
		text = text[k:]
	}
	return n
}
