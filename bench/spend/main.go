// Command spend measures how much of an llmbudget token budget streaming
// clients can spend, for every API × kind of text × history: a real Caddy
// built from this checkout, one budget per model (scope model, so each case
// has its own counter and history), in front of fakellm.Billed, which bills
// o200k counts and streams several tokens an event. For each case,
// -clients clients post at once, each looping until its first refusal. A
// row says how many of the first requests were admitted, the share of the
// limit billed by the answers the upstream got before the first refusal, the
// counter at the end, and the upstream's bill against the counter (at most
// 1: the ceiling).
//
// The last column says whether the ceiling held: the counter at most the
// limit and the bill at most the counter; the command fails when it did
// not. Two more cases of English answers for each API: "hidden", a model on
// no reasoning list that bills 1,000 output tokens more than it streams
// (from its proving answers on), and "input", an upstream that reports 300
// input tokens where the body shows a few (a template, a system prompt it
// adds), for the APIs that report input before the output (Anthropic's
// message_start, Gemini's usage on every chunk): the excess comes out of
// the lease. (Elsewhere input is reported at the end, with the output, and
// input beyond the estimate is charged as reported: README, "The ceiling".)
// And the closed world's cases: "neutral", fields of the API that change
// nothing billed (they must cost nothing); "unknown", a field llmbudget does
// not know, for which the upstream bills 2,000 input tokens the body does
// not show (held at context_window: refused under a smaller budget); "json"
// and "ndjson", the stream labelled application/json or
// application/x-ndjson. Then the transports (-transports): the Responses
// API's WebSocket mode, the Realtime API with text turns, and the Realtime
// API with audio turns its turn detection answers (bench/spend/sockets.go).
//
// History "none" is a model no answer has proven, whose streams hold their
// whole cap; "english" is one -proofs English answers proved first (they
// count as spent): enough for a model counted by a proxy tokenizer (four
// counted answers; the run's first loads the tokenizer). SPEND_KEEP=1 keeps
// the scratch folder with Caddy's log. The
// models other than OpenAI's are billed by cl100k, so that their proxy
// (o200k) is not their tokenizer.
//
//	go run ./bench/spend [-limit 100000] [-clients 64] [-tokens 300] [-formats chat,anthropic] [-texts english,csv] [-histories none,english]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fleetguard/fleetguard/bench/internal/benchkit"
	"github.com/fleetguard/fleetguard/internal/fakellm"
)

var (
	limit      = flag.Int64("limit", 100000, "each case's budget, tokens an hour")
	clients    = flag.Int("clients", 64, "concurrent streaming clients")
	tokens     = flag.Int("tokens", 300, "o200k tokens of each answer")
	chunk      = flag.Int("chunk", 24, "bytes of text an event")
	interval   = flag.Duration("interval", 5*time.Millisecond, "time between events of a stream")
	capTok     = flag.Int("cap", 4096, "the output cap of every request")
	formats    = flag.String("formats", "chat,responses,completions,anthropic,gemini,ollama,compatible", "the APIs, comma-separated")
	texts      = flag.String("texts", "english,csv,code,cjk,base64,json", "the kinds of answer, comma-separated")
	histories  = flag.String("histories", "none,english", "the models' histories, comma-separated: none, english")
	extras     = flag.String("extras", "hidden,input,neutral,unknown,json,ndjson", "cases of English answers, after the histories, comma-separated: hidden (a model on no reasoning list that bills 1,000 output tokens more than it streams), input (the upstream reports 300 input tokens where the body shows a few, before the output: Anthropic and Gemini), neutral (fields that change nothing billed), unknown (a field llmbudget does not know, for which the upstream bills 2,000 input tokens the body does not show), json and ndjson (the stream labelled application/json, application/x-ndjson); empty for none")
	proofs     = flag.Int("proofs", 5, "the English answers of history english: the first answer of a run loads the proxy tokenizer, four counted ones teach it")
	settleWait = flag.Duration("settle-wait", -1, "llmbudget's settle_wait (default: llmbudget's own)")
	caddyBin   = flag.String("caddy", "", "a Caddy built from this checkout (default: build ./cmd/caddy into a scratch folder)")
)

// apis are the formats a case can speak: the model its clients name, the
// path and the body.
var apis = map[string]struct {
	model      string
	path, body func(model string, cap int) string
}{
	"chat": {"gpt-4o", fixed("/v1/chat/completions"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"messages":[{"role":"user","content":"go"}]}`, m, c)
	}},
	"responses": {"gpt-4o", fixed("/v1/responses"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"stream":true,"max_output_tokens":%d,"input":"go"}`, m, c)
	}},
	"completions": {"gpt-4o", fixed("/v1/completions"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"prompt":"go"}`, m, c)
	}},
	"anthropic": {"claude-sonnet-4-5", fixed("/v1/messages"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"go"}]}`, m, c)
	}},
	"gemini": {"gemini-2.0-flash", func(m string, _ int) string { return "/v1beta/models/" + m + ":streamGenerateContent?alt=sse" },
		func(_ string, c int) string {
			return fmt.Sprintf(`{"contents":[{"role":"user","parts":[{"text":"go"}]}],"generationConfig":{"maxOutputTokens":%d}}`, c)
		}},
	"ollama": {"llama3.1", fixed("/api/chat"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"go"}],"options":{"num_predict":%d}}`, m, c)
	}},
	// An OpenAI-compatible server (vLLM, LiteLLM) serving a model whose
	// tokenizer llmbudget does not know.
	"compatible": {"qwen2.5-72b", fixed("/v1/chat/completions"), func(m string, c int) string {
		return fmt.Sprintf(`{"model":%q,"stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"messages":[{"role":"user","content":"go"}]}`, m, c)
	}},
}

func fixed(path string) func(string, int) string { return func(string, int) string { return path } }

// neutralFields are fields of each API that change nothing billed, for the
// case "neutral": they must cost nothing.
var neutralFields = map[string]string{
	"chat":        `"user":"u1","metadata":{"k":"v"},"store":false,"temperature":0.2,"top_p":1,"seed":7,`,
	"compatible":  `"user":"u1","temperature":0.2,"top_k":40,"min_p":0.05,"repetition_penalty":1.1,`,
	"responses":   `"user":"u1","metadata":{"k":"v"},"store":false,"temperature":0.2,"truncation":"auto",`,
	"completions": `"user":"u1","temperature":0.2,"stop":["END"],"seed":7,`,
	"anthropic":   `"metadata":{"user_id":"u1"},"temperature":0.2,"top_k":40,"stop_sequences":["END"],`,
	"gemini":      `"safetySettings":[],"labels":{"team":"a"},`,
	"ollama":      `"keep_alive":"5m",`,
}

func main() {
	flag.Parse()
	benchkit.Main("spend", run)
}

func run(ctx context.Context) error {
	dir, bin, cleanup, err := benchkit.Workspace(ctx, "spend", "SPEND_KEEP", *caddyBin)
	if err != nil {
		return err
	}
	defer cleanup()
	up, upAddr, stopUpstream, err := startUpstream()
	if err != nil {
		return err
	}
	defer stopUpstream()
	sockets, stopSockets, err := startSocketUpstreams()
	if err != nil {
		return err
	}
	defer stopSockets()
	c, err := startCaddy(dir, bin, upAddr, sockets.addrs())
	if err != nil {
		return err
	}
	defer c.stop()
	cases, err := spendCases(up)
	if err != nil {
		return err
	}

	fmt.Printf("spend: a budget of %d tokens an hour per case, %d streaming clients at once, answers of %d o200k tokens in events of %d bytes %s apart, cap %d\n",
		*limit, *clients, *tokens, *chunk, *interval, *capTok)
	fmt.Printf(rowFormat, "format", "model", "text", "history", "first wave", "spent before 1st refusal", "counter", "bill/counter", "ceiling")
	broken := 0
	for _, cs := range cases {
		cs.c, cs.up = c, up
		cs.model = fmt.Sprintf("%s-%s-%s-%s", apis[cs.format].model, cs.format, cs.text, cs.history)
		row, held, err := cs.run(ctx)
		if err != nil {
			return fmt.Errorf("%s %s %s: %w", cs.format, cs.text, cs.history, err)
		}
		if !held {
			broken++
		}
		fmt.Print(row)
	}
	for _, t := range sockets.cases() {
		row, held, err := t.run(ctx, c)
		if err != nil {
			return fmt.Errorf("%s: %w", t.name, err)
		}
		if !held {
			broken++
		}
		fmt.Print(row)
	}
	if broken > 0 {
		return fmt.Errorf("the ceiling broke in %d cases", broken)
	}
	return nil
}

// startUpstream serves fakellm.Billed, in this process so its answers can
// be read.
func startUpstream() (up *fakellm.Billed, addr string, stop func(), err error) {
	// Models of other providers bill by another tokenizer than the proxy
	// llmbudget counts them by (o200k).
	other := map[string]func(string) int64{}
	for _, api := range apis {
		if !strings.HasPrefix(api.model, "gpt-") {
			other[api.model] = fakellm.CL100kTokens
		}
	}
	up = &fakellm.Billed{Texts: answers(*tokens), ChunkBytes: *chunk, Interval: *interval, Tokenizers: other}
	upLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", nil, err
	}
	upSrv := &http.Server{Handler: up}
	go func() { _ = upSrv.Serve(upLn) }()
	return up, upLn.Addr().String(), func() { _ = upSrv.Close() }, nil
}

// spendCases are the cases the flags ask for, in the order they run: for
// each format, its texts by histories, then its extra cases.
func spendCases(up *fakellm.Billed) ([]spendCase, error) {
	var cases []spendCase
	for _, format := range strings.Split(*formats, ",") {
		if _, ok := apis[format]; !ok {
			return nil, fmt.Errorf("-formats: unknown format %q", format)
		}
		for _, text := range strings.Split(*texts, ",") {
			if _, ok := up.Texts[text]; !ok {
				return nil, fmt.Errorf("-texts: unknown text %q", text)
			}
			for _, history := range strings.Split(*histories, ",") {
				if history != "none" && history != "english" {
					return nil, fmt.Errorf("-histories: unknown history %q", history)
				}
				cases = append(cases, spendCase{format: format, text: text, history: history})
			}
		}
		for _, extra := range strings.Split(*extras, ",") {
			cs := spendCase{format: format, text: "english", history: "english"}
			switch extra {
			case "":
				continue
			case "hidden":
				cs.history, cs.headers = "hidden", map[string]string{"X-Fake-Hidden-Output": "1000"}
			case "input":
				if format != "anthropic" && format != "gemini" {
					continue // its input is reported with the output's, at the end
				}
				cs.history, cs.headers = "input", map[string]string{"X-Fake-Input": "300"}
			case "neutral":
				cs.history, cs.field = "neutral", neutralFields[format]
			case "unknown":
				cs.history, cs.field, cs.headers = "unknown", `"frobnicate":true,`, map[string]string{"X-Fake-Input": "2000"}
			case "json", "ndjson":
				cs.history, cs.headers = extra, map[string]string{"X-Fake-Content-Type": map[string]string{"json": "application/json", "ndjson": "application/x-ndjson"}[extra]}
			default:
				return nil, fmt.Errorf("-extras: unknown case %q", extra)
			}
			cases = append(cases, cs)
		}
	}
	return cases, nil
}

// rowFormat is a row of the table, printed as each case ends.
const rowFormat = "%-14s %-18s %-7s %-7s %10s %24s %8s %12s %8s\n"

// answers are the texts of fakellm.Texts cut to n o200k tokens each.
func answers(n int) map[string]string {
	out := map[string]string{}
	for name, text := range fakellm.Texts(n * 8) {
		lo, hi := 0, len(text) // the longest prefix of at most n tokens
		for lo < hi {
			mid := (lo + hi + 1) / 2
			if fakellm.Tokens(strings.ToValidUTF8(text[:mid], "")) <= int64(n) {
				lo = mid
			} else {
				hi = mid - 1
			}
		}
		out[name] = strings.ToValidUTF8(text[:lo], "")
	}
	return out
}

// spendCase is one format × text × history, with a model of its own.
type spendCase struct {
	c                            *caddyProc
	up                           *fakellm.Billed
	format, text, history, model string
	headers                      map[string]string // on every request of the clients
	field                        string            // at the start of every body of the clients: `"name":value,`
}

// outcome is one request as its client saw it.
type outcome struct {
	first    bool
	status   int
	answered time.Time
}

// run runs the case and returns its row, and whether the ceiling held:
// the counter at most the limit, and the bill at most the counter.
func (s spendCase) run(ctx context.Context) (row string, held bool, err error) {
	api := apis[s.format]
	url := s.c.site + api.path(s.model, *capTok)
	if s.history != "none" {
		for range *proofs {
			if code, err := s.post(ctx, url, api.body(s.model, *capTok), "english", s.headers); err != nil || code != http.StatusOK {
				return "", false, fmt.Errorf("a proving answer: %d %v", code, err)
			}
			s.settled(ctx)
		}
	}
	body := api.body(s.model, *capTok)
	outcomes := s.clients(ctx, url, "{"+s.field+body[1:])
	if ctx.Err() != nil {
		return "", false, ctx.Err()
	}
	used, err := s.settled(ctx)
	if err != nil {
		return "", false, err
	}
	row, held = s.row(outcomes, used)
	return row, held, nil
}

// clients runs -clients clients at once, each posting until its first
// refusal, and returns what they saw.
func (s spendCase) clients(ctx context.Context, url, body string) []outcome {
	var (
		mu       sync.Mutex
		outcomes []outcome
		wg       sync.WaitGroup
	)
	ready := make(chan struct{})
	for range *clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-ready
			for first := true; ctx.Err() == nil; first = false {
				code, err := s.post(ctx, url, body, s.text, s.headers)
				mu.Lock()
				outcomes = append(outcomes, outcome{first: first, status: code, answered: time.Now()})
				mu.Unlock()
				if err != nil || code != http.StatusOK {
					return
				}
			}
		}()
	}
	close(ready)
	wg.Wait()
	return outcomes
}

// row is the case's row of the table, from the clients' outcomes, the
// upstream's bill and the counter (used), and whether the ceiling held.
func (s spendCase) row(outcomes []outcome, used int64) (row string, held bool) {
	var firstWave int
	var firstRefusal time.Time
	for _, o := range outcomes {
		if o.first && o.status == http.StatusOK {
			firstWave++
		}
		if o.status != http.StatusOK && (firstRefusal.IsZero() || o.answered.Before(firstRefusal)) {
			firstRefusal = o.answered
		}
	}
	var spent, billed int64
	for _, a := range s.up.Answers() {
		if a.Model != s.model {
			continue
		}
		billed += a.Billed
		if a.Received.Before(firstRefusal) {
			spent += a.Billed
		}
	}
	return rowOf(s.format, apis[s.format].model, s.text, s.history, firstWave, spent, used, billed)
}

// rowOf is a row of the table, and whether the ceiling held: the counter
// (used) at most the limit, the bill at most the counter.
func rowOf(format, model, text, history string, firstWave int, spent, used, billed int64) (row string, held bool) {
	pct := func(n int64) string { return fmt.Sprintf("%.1f%%", 100*float64(n)/float64(*limit)) }
	ratio := "-"
	if used > 0 {
		ratio = fmt.Sprintf("%.3f", float64(billed)/float64(used))
	}
	held = used <= *limit && billed <= used
	verdict := "held"
	if !held {
		verdict = "BROKEN"
	}
	return fmt.Sprintf(rowFormat, format, model, text, history,
		fmt.Sprintf("%d of %d", firstWave, *clients), pct(spent), pct(used), ratio, verdict), held
}

// post sends one request for an answer of text and reads it whole.
func (s spendCase) post(ctx context.Context, url, body, text string, headers map[string]string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer spend")
	req.Header.Set("X-Fake-Text", text)
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := s.c.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

// settled waits until the upstream has ended every answer and the model's
// counter holds still, and returns it.
func (s spendCase) settled(ctx context.Context) (int64, error) {
	for s.up.InFlight() > 0 && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	prev := int64(-1)
	for ctx.Err() == nil {
		time.Sleep(300 * time.Millisecond)
		used, err := s.c.used(s.model)
		if err != nil || used == prev {
			return used, err
		}
		prev = used
	}
	return 0, ctx.Err()
}

// caddyProc is the Caddy under test.
type caddyProc struct {
	cmd         *exec.Cmd
	site, admin string
	client      *http.Client
}

func startCaddy(dir, bin, upstream string, sockets map[string]string) (*caddyProc, error) {
	sitePort, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	adminPort, err := benchkit.FreePort()
	if err != nil {
		return nil, err
	}
	wait := ""
	if *settleWait >= 0 {
		wait = fmt.Sprintf("\t\tsettle_wait %s\n", *settleWait)
	}
	caddyfile := fmt.Sprintf(`{
	admin 127.0.0.1:%d
}
http://127.0.0.1:%d {
	route {
%s
		llmbudget {
			budget spend {
				scope model
				unit tokens
				limit %d
				window 1h
			}
%s		}
		reverse_proxy %s
	}
}
`, adminPort, sitePort, socketRoutes(sockets), *limit, wait, upstream)
	cfg := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(cfg, []byte(caddyfile), 0o644); err != nil {
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "caddy.log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, "run", "--config", cfg, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &caddyProc{cmd: cmd, site: fmt.Sprintf("http://127.0.0.1:%d", sitePort), admin: fmt.Sprintf("http://127.0.0.1:%d", adminPort),
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: *clients, DisableCompression: true}}}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if _, err := c.used("none"); err == nil {
			return c, nil
		} else if time.Now().After(deadline) {
			c.stop()
			tail, _ := os.ReadFile(logf.Name())
			return nil, fmt.Errorf("caddy did not come up: %w\n%s", err, tail)
		}
	}
}

func (c *caddyProc) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	_ = c.cmd.Wait()
}

// used is the model's counter of budget spend as the admin API shows it.
func (c *caddyProc) used(model string) (int64, error) { return c.usedOf("spend", model) }

// usedOf is the model's counter of a budget as the admin API shows it.
func (c *caddyProc) usedOf(budget, model string) (int64, error) {
	resp, err := http.Get(c.admin + "/fleetguard/budgets/" + budget + "?model=" + model)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("the admin API: %d %s", resp.StatusCode, b)
	}
	var v struct {
		Used json.Number `json:"used"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return 0, err
	}
	return strconv.ParseInt(v.Used.String(), 10, 64)
}
