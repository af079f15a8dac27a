package fleetguard

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/fakellm"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// upstream is a local LLM API (internal/fakellm) that reports 30 input and
// 70 output tokens per request.
type upstream struct {
	*fakellm.Server
	URL string
}

func newFakeLLM(t *testing.T) *upstream {
	s := fakellm.New()
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	return &upstream{Server: s, URL: ts.URL}
}

// llmSite is a site on port with llmbudget (the budgets, keyed by the
// Authorization and X-Team headers, gpt-4o* priced, settles not waited
// for) in front of upstream, with the global options global.
func llmSite(port int, upstream, global, budgets string) testCaddyfile {
	return testCaddyfile{Global: []string{global}, Port: port, Upstream: upstream, LLMBudget: []string{
		"principal {http.request.header.Authorization}",
		"team {http.request.header.X-Team}",
		budgets,
		"price gpt-4o* 2.50 10.00 1.25",
		"max_request_body 4KiB",
		"settle_wait 0",
	}}
}

func llmCaddyfile(port int, upstream, global, budgets string) string {
	return llmSite(port, upstream, global, budgets).String()
}

const chatBody = `{"model":"gpt-4o","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`

func chat(t *testing.T, url, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	return do(t, http.MethodPost, url+"/v1/chat/completions", body, append([]string{"Content-Type: application/json"}, headers...)...)
}

type apiErrorBody struct {
	Error struct{ Type, Code, Message string } `json:"error"`
}

func decodeError(t *testing.T, body string) apiErrorBody {
	t.Helper()
	var e apiErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Code == "" || e.Error.Message == "" {
		t.Fatalf("error body %q is not {\"error\":{type,code,message}}: %v", body, err)
	}
	return e
}

func TestLLMBudgetTokenBudgetAdmitsEightThenDenies(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "", `budget per_key {
			scope key
			unit tokens
			limit 1000
			window 1h
		}`))
	for i := 1; i <= 8; i++ {
		// The settle runs after the response: a client that sends its next
		// request at once may find the last reservation not settled yet.
		waitSettles()
		resp, body := chat(t, url, chatBody, "Authorization: Bearer alice")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"per_key";r=`) || resp.Header.Get("RateLimit-Policy") != `"per_key";q=1000;w=3600` {
			t.Fatalf("request %d: RateLimit headers %q / %q", i, resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy"))
		}
	}
	waitSettles() // the 8 settles have run: 800 of 1000 used
	resp, body := chat(t, url, chatBody, "Authorization: Bearer alice")
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("9th request: %d %s, want 429", resp.StatusCode, body)
	}
	e := decodeError(t, body)
	if e.Error.Code != "token_budget_exceeded" || !strings.Contains(e.Error.Message, `"per_key"`) {
		t.Fatalf("error body %+v must name the budget", e)
	}
	retry, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || retry < 1 || retry > 3600 {
		t.Fatalf("Retry-After %q, want seconds to the window's end", resp.Header.Get("Retry-After"))
	}
	if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"per_key";r=200;t=`) {
		t.Fatalf("RateLimit on the denial: %q (800 of 1000 used)", resp.Header.Get("RateLimit"))
	}
	// SDKs sleep Retry-After before retrying a 429: past max_retry_after
	// (60 s) they are told not to retry.
	if want := map[bool]string{true: "false", false: ""}[retry > 60]; resp.Header.Get("X-Should-Retry") != want {
		t.Fatalf("Retry-After %d: X-Should-Retry %q, want %q", retry, resp.Header.Get("X-Should-Retry"), want)
	}
	// A request that can never fit says so, and what to lower.
	resp, body = chat(t, url, `{"model":"gpt-4o","max_tokens":4000,"messages":[]}`, "Authorization: Bearer carol")
	if e := decodeError(t, body); resp.StatusCode != http.StatusTooManyRequests || e.Error.Code != "request_exceeds_budget" ||
		!strings.Contains(e.Error.Message, "lower max_tokens") || resp.Header.Get("X-Should-Retry") != "false" || resp.Header.Get("Retry-After") != "" {
		t.Fatalf("a request over the whole limit: %d %s %v", resp.StatusCode, body, resp.Header)
	}
	if up.Hits() != 8 {
		t.Fatalf("upstream saw %d requests, want 8: a denied request is not forwarded", up.Hits())
	}
	// Another principal has its own budget.
	if resp, _ := chat(t, url, chatBody, "Authorization: Bearer bob"); resp.StatusCode != http.StatusOK {
		t.Fatalf("bob: %d", resp.StatusCode)
	}
	// The upstream got the body intact and no Accept-Encoding.
	if got := up.LastBody(); got != chatBody {
		t.Fatalf("upstream body %q, want %q", got, chatBody)
	}
}

// TestLLMBudgetUSDBudget: a dollar budget admits what fits, in dollars, and
// its denial reads as the provider's own exhausted quota (429
// insufficient_quota), or 402 with usd_denial_status 402.
func TestLLMBudgetUSDBudget(t *testing.T) {
	for _, tt := range []struct {
		option string
		status int
		code   string
	}{
		{"", http.StatusTooManyRequests, "insufficient_quota"},
		{"usd_denial_status 402", http.StatusPaymentRequired, "usd_budget_exceeded"},
	} {
		up := newFakeLLM(t)
		port := freePort(t)
		url := fmt.Sprintf("http://127.0.0.1:%d", port)
		// gpt-4o: 200 output tokens reserve 200 x $10/1M = $0.002 (+ the
		// prompt); an actual request costs 30 x 2.5 + 70 x 10 = 775
		// micro-dollars.
		startCaddy(t, llmCaddyfile(port, up.URL, fmt.Sprintf("fleetguard {\n prefix usd%d\n }", port), `budget team_usd {
			scope team
			unit usd
			limit 0.004
			window 1h
		}
		`+tt.option))
		admitted := 0
		var last *http.Response
		var lastBody string
		for i := 0; i < 10; i++ {
			waitSettles() // each request sees the last one settled
			last, lastBody = chat(t, url, chatBody, "X-Team: red")
			if last.StatusCode != http.StatusOK {
				break
			}
			admitted++
		}
		// $0.004 = 4000 micro-dollars; each reservation needs about 2030
		// and each request settles to 775: 775k + 2030 <= 4000 admits
		// k = 0, 1, 2.
		if admitted != 3 || last.StatusCode != tt.status {
			t.Fatalf("%q: admitted %d then %d %s; want 3 then %d", tt.option, admitted, last.StatusCode, lastBody, tt.status)
		}
		// Dollars read as dollars; with $0.001675 left the request does not
		// fit, which is not "exhausted".
		if e := decodeError(t, lastBody); e.Error.Code != tt.code ||
			!strings.Contains(e.Error.Message, "$0.001675 of $0.004 left") || !strings.Contains(e.Error.Message, "does not fit") ||
			strings.Contains(e.Error.Message, "micro") || strings.Contains(e.Error.Message, "exhausted") ||
			!strings.Contains(e.Error.Message, "the window resets at ") || strings.Contains(e.Error.Message, "in flight") {
			t.Fatalf("%q: code %q, message %q: want %s, dollars, \"does not fit\", the reset as a time and no word of requests in flight (none is)", tt.option, e.Error.Code, e.Error.Message, tt.code)
		}
		if last.Header.Get("Retry-After") == "" {
			t.Fatalf("%q: the denial carries no Retry-After", tt.option)
		}
		// A model with no price is never free under a dollar budget.
		resp, body := chat(t, url, `{"model":"mystery-1","max_tokens":5,"messages":[]}`, "X-Team: blue")
		if resp.StatusCode != http.StatusPaymentRequired || decodeError(t, body).Error.Code != "model_not_priced" {
			t.Fatalf("unpriced model: %d %s, want 402 model_not_priced", resp.StatusCode, body)
		}
	}
}

func TestLLMBudgetRejectsBadRequestsWithoutForwarding(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "", `budget g {
			limit 100000
			window 1h
			unit tokens
		}`))
	tests := []struct {
		name, body string
		status     int
		code       string
	}{
		{"not JSON", "model=gpt-4o", 400, "invalid_request"},
		{"no model", `{"messages":[]}`, 400, "invalid_request"},
		{"negative max_tokens", `{"model":"gpt-4o","max_tokens":-1,"messages":[]}`, 400, "invalid_request"},
		{"absurd max_tokens", `{"model":"gpt-4o","max_tokens":50000000,"messages":[]}`, 400, "invalid_request"},
		{"body over max_request_body", `{"model":"gpt-4o","messages":[{"role":"user","content":"` + strings.Repeat("x", 5000) + `"}]}`, 413, "request_too_large"},
		{"case-variant model", `{"model":"gpt-4o","MODEL":"gpt-4o-mini","messages":[]}`, 400, "ambiguous_request"},
		{"case-variant cap beside the real one", `{"model":"gpt-4o","max_tokens":2000,"Max_Tokens":1,"messages":[]}`, 400, "ambiguous_request"},
		{"duplicate cap", `{"model":"gpt-4o","max_tokens":2000,"max_tokens":1,"messages":[]}`, 400, "ambiguous_request"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, body := chat(t, url, tt.body)
			if resp.StatusCode != tt.status || decodeError(t, body).Error.Code != tt.code {
				t.Fatalf("%d %s, want %d %s", resp.StatusCode, body, tt.status, tt.code)
			}
		})
	}
	if up.Hits() != 0 {
		t.Fatalf("upstream saw %d requests; rejected requests are never forwarded", up.Hits())
	}
	// Paths that are not LLM calls pass through unbudgeted.
	if resp, _ := get(t, url+"/v1/models"); resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/models: %d", resp.StatusCode)
	}
}

func TestLLMBudgetSettlesFromTheResponse(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix settle\n }", `budget g {
			limit 100000
			window 1h
			unit tokens
		}`))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rc.Close()
	counter := func() int64 {
		waitSettles()
		keys, err := rc.Keys(context.Background(), "settle:bg:{b}:g:*").Result()
		if err != nil || len(keys) != 1 {
			t.Fatalf("budget keys %v %v", keys, err)
		}
		n, _ := rc.Get(context.Background(), keys[0]).Int64()
		return n
	}
	if resp, _ := chat(t, url, chatBody); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	if got := counter(); got != 100 {
		t.Fatalf("after a reported usage of 100: counter %d", got)
	}
	// A non-2xx upstream answer is released in full.
	if resp, _ := chat(t, url, chatBody, "X-Fake-Status: 500"); resp.StatusCode != 500 {
		t.Fatal(resp.StatusCode)
	}
	if got := counter(); got != 100 {
		t.Fatalf("after an upstream 500: counter %d, want 100", got)
	}
	// A success with no usage keeps the whole reservation.
	if resp, _ := chat(t, url, chatBody, "X-Fake-No-Usage: 1"); resp.StatusCode != 200 {
		t.Fatal(resp.StatusCode)
	}
	if got := counter(); got <= 300 {
		t.Fatalf("after a response without usage: counter %d, want 100 + the reservation (> 300)", got)
	}
	// Anthropic format, recognised by its path.
	before := counter()
	resp, body := do(t, http.MethodPost, url+"/v1/messages", `{"model":"claude-x","max_tokens":70,"messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := counter(); got != before+100 {
		t.Fatalf("Anthropic usage: counter %d, want %d", got, before+100)
	}
	// Redis down: fail closed with 503 and nothing forwarded.
	hits := up.Hits()
	srv.Stop()
	resp, body = chat(t, url, chatBody)
	if resp.StatusCode != http.StatusServiceUnavailable || decodeError(t, body).Error.Code != "budget_store_unavailable" {
		t.Fatalf("store down: %d %s, want 503", resp.StatusCode, body)
	}
	if up.Hits() != hits {
		t.Fatal("a request is not forwarded when the store fails closed")
	}
}

func TestLLMBudgetFailOpen(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	srv.Stop()
	site := llmSite(port, up.URL, "fleetguard {\n redis "+srv.URL()+"\n }", `budget g {
			limit 1000
			window 1h
			unit tokens
		}`)
	site.LLMBudget = append(site.LLMBudget, "fail_open")
	startCaddy(t, site.String())
	if resp, body := chat(t, url, chatBody); resp.StatusCode != 200 {
		t.Fatalf("fail_open with the store down: %d %s, want 200", resp.StatusCode, body)
	}
}

func TestLLMBudgetJSONConfigAndClientGone(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	tc := startCaddy(t, fmt.Sprintf("{\n\tadmin {ADMIN}\n}\n:%d {\n\trespond \"before\"\n}", port))
	cfg := fmt.Sprintf(`{
	"admin": {"listen": "{ADMIN}"},
	"apps": {"http": {"servers": {"s": {
		"listen": [":%d"],
		"routes": [{"handle": [
			{"handler": "llmbudget",
			 "principal": "{http.request.header.Authorization}",
			 "budgets": [{"name": "per_key", "scope": "key", "unit": "tokens", "limit": 1000, "window": "1h"}],
			 "prices": {"gpt-4o*": {"input": 2.5, "output": 10}}},
			{"handler": "reverse_proxy", "upstreams": [{"dial": "%s"}]}
		]}]
	}}}}
}`, port, strings.TrimPrefix(up.URL, "http://"))
	if code, body := tc.load("application/json", cfg); code != http.StatusOK {
		t.Fatalf("POST /load: %d %s", code, body)
	}
	resp, body := chat(t, url, chatBody, "Authorization: Bearer json")
	if resp.StatusCode != http.StatusOK || resp.Header.Get("RateLimit-Policy") != `"per_key";q=1000;w=3600` {
		t.Fatalf("%d %s %v", resp.StatusCode, body, resp.Header)
	}
	remaining := func() int64 {
		// A small request shows what the budget holds after its reservation
		// (the settles before it done); it then settles to the upstream's 100
		// tokens (30 and its cap of 70).
		waitSettles()
		resp, _ := chat(t, url, `{"model":"gpt-4o","max_tokens":70,"messages":[]}`, "Authorization: Bearer json")
		h := resp.Header.Get("RateLimit")
		r, _, _ := strings.Cut(strings.TrimPrefix(h, `"per_key";r=`), ";")
		n, err := strconv.ParseInt(r, 10, 64)
		if err != nil {
			t.Fatalf("RateLimit %q", h)
		}
		return n
	}
	before := remaining()
	// A client that goes away after its request was forwarded, before the
	// upstream answers, keeps its reservation: the upstream bills it.
	// It gives up once the upstream has the request.
	ctx, giveUp := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", strings.NewReader(chatBody))
	req.Header.Set("Authorization", "Bearer json")
	// The upstream holds its answer until the client has given up and the
	// request is settled.
	gate := make(chan struct{})
	up.Gate = gate
	hits, abandoned := up.Hits(), settles("abandoned")
	sent := make(chan error, 1)
	go func() {
		_, err := http.DefaultClient.Do(req)
		sent <- err
	}()
	eventually(t, 5*time.Second, "the upstream receiving the request", func() bool { return up.Hits() != hits })
	giveUp()
	if err := <-sent; err == nil {
		t.Fatal("the client was meant to give up")
	}
	eventually(t, 5*time.Second, "a settle after the client gave up", func() bool { return settles("abandoned") != abandoned })
	close(gate)
	// The 100 tokens of the first remaining() call, and the abandoned
	// request's reservation: 200 max_tokens and its prompt.
	held := 200 + promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", chatBody)
	if after := remaining(); after != before-100-held {
		t.Fatalf("after a client cancel: %d remaining, want %d (the abandoned request keeps its reservation)", after, before-100-held)
	}
	bad := strings.Replace(cfg, `"limit": 1000`, `"limit": -3`, 1)
	if code, body := tc.load("application/json", bad); code == http.StatusOK || !strings.Contains(body, "limit must be > 0") {
		t.Fatalf("bad JSON config: %d %s", code, body)
	}
}

// TestOnRedisCluster runs both handlers on a 3-node Redis Cluster: the budget
// script touches several keys under one hash tag, the fleet counters push one
// transaction per slot. The fleet limit of 10 gives this lone instance a
// floor share of 8: past 6 the key syncs, and its counter reaches the store.
func TestOnRedisCluster(t *testing.T) {
	c := redistest.StartCluster(t)
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	site := llmSite(port, up.URL, "fleetguard {\n redis_cluster "+c.URL()+"\n sync_interval 50ms\n }", `budget per_key {
			scope key
			limit 1000
			window 1h
			unit tokens
		}
		budget all {
			limit 100000
			window 1h
			unit tokens
		}`)
	site.FleetLimit = []string{"zone z {\n key {http.request.header.Authorization}\n events 10\n window 1m\n }"}
	startCaddy(t, site.String())
	for i := 1; i <= 8; i++ {
		waitSettles() // each request sees the last one settled
		if resp, body := chat(t, url, chatBody, "Authorization: Bearer cluster"); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	waitSettles()
	if resp, _ := chat(t, url, chatBody, "Authorization: Bearer cluster"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("9th request: %d, want 429 from the per_key budget", resp.StatusCode)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs()})
	defer cc.Close()
	eventuallyValue(t, 5*time.Second, "one fleet counter key on the cluster", func() int64 {
		var n atomic.Int64 // ForEachMaster visits the nodes concurrently
		_ = cc.ForEachMaster(context.Background(), func(ctx context.Context, node *redis.Client) error {
			keys, _ := node.Keys(ctx, "*:rl3:{z:*").Result()
			n.Add(int64(len(keys)))
			return nil
		})
		return n.Load()
	}, func(n int64) bool { return n == 1 })
}

// Budgeting is decided on the normalized path: variants of a budgeted path
// are budgeted, an unknown POST is refused (unknown_paths deny, the default)
// and never forwarded, and embeddings and legacy completions are budgeted.
func TestLLMBudgetPathsAreNormalizedAndUnknownPostsRefused(t *testing.T) {
	url, up, counter := budgetOnRedis(t, redistest.Start(t), "paths")
	for _, p := range []string{"/v1/Chat/Completions", "/v1/chat/completions/.", "/v1/chat/completions%20", "/v1/chat/completions;x=1", "/v1//chat/completions"} {
		before := counter()
		resp, body := do(t, http.MethodPost, url+p, chatBody, "Content-Type: application/json")
		if resp.Header.Get("RateLimit-Policy") == "" {
			t.Fatalf("POST %s: %d %s was forwarded without a reservation", p, resp.StatusCode, body)
		}
		if got := counter() - before; got != 100 {
			t.Fatalf("POST %s: charged %d, want the upstream's 100", p, got)
		}
	}
	hits := up.Hits()
	resp, body := do(t, http.MethodPost, url+"/v1/images/generations", `{"model":"dall-e-3","prompt":"a cat"}`, "Content-Type: application/json")
	if resp.StatusCode != http.StatusNotFound || decodeError(t, body).Error.Code != "unbudgeted_path" || up.Hits() != hits {
		t.Fatalf("an unknown POST: %d %s (upstream hits %d → %d), want 404 unbudgeted_path, not forwarded", resp.StatusCode, body, hits, up.Hits())
	}
	// Embeddings reserve the input only, and settle to the reported usage.
	before := counter()
	resp, body = do(t, http.MethodPost, url+"/v1/embeddings", `{"model":"text-embedding-3-small","input":"some text to embed"}`, "Content-Type: application/json")
	if resp.StatusCode != http.StatusOK || !strings.Contains(resp.Header.Get("RateLimit"), `"g";r=`) {
		t.Fatalf("embeddings: %d %s %v", resp.StatusCode, body, resp.Header)
	}
	r, _, _ := strings.Cut(strings.TrimPrefix(resp.Header.Get("RateLimit"), `"g";r=`), ";")
	if reserved := 100000000 - before - mustInt(t, r); reserved > 20 {
		t.Fatalf("embeddings reserved %d tokens, want the input estimate only (no output)", reserved)
	}
	if got := counter() - before; got != 30 {
		t.Fatalf("embeddings charged %d, want the reported 30 input tokens", got)
	}
	before = counter()
	if resp, body := do(t, http.MethodPost, url+"/v1/completions", `{"model":"gpt-3.5-turbo-instruct","prompt":"Say hi","max_tokens":70}`, "Content-Type: application/json"); resp.StatusCode != http.StatusOK {
		t.Fatalf("legacy completions: %d %s", resp.StatusCode, body)
	}
	if got := counter() - before; got != 100 {
		t.Fatalf("legacy completions charged %d, want 100", got)
	}
}

// budgetOnRedis starts Caddy with one global token budget "g" on srv under
// prefix, in front of a local upstream; counter reads the budget's Redis
// counters once the settles so far have run.
func budgetOnRedis(t *testing.T, srv *redistest.Server, prefix string) (url string, up *upstream, counter func() int64) {
	t.Helper()
	up = newFakeLLM(t)
	port := freePort(t)
	url = fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "fleetguard {\n redis "+srv.URL()+"\n prefix "+prefix+"\n }", `budget g {
			limit 100000000
			window 1h
			unit tokens
		}
		ratelimit_scopes global`))
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { rc.Close() })
	return url, up, func() int64 { return budgetCounter(t, rc, prefix, "g") }
}

// budgetCounter sums the Redis counters of budget under prefix, once the
// settles of the answers so far have run.
func budgetCounter(t *testing.T, rc *redis.Client, prefix, budget string) int64 {
	t.Helper()
	return sumCounters(t, rc, prefix+":bg:{b}:"+budget+":*")
}

// sumCounters sums the Redis counters matching pattern once the settles of
// the answers so far have run.
func sumCounters(t *testing.T, rc *redis.Client, pattern string) int64 {
	t.Helper()
	waitSettles()
	keys, err := rc.Keys(context.Background(), pattern).Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, k := range keys {
		v, _ := rc.Get(context.Background(), k).Int64()
		n += v
	}
	return n
}

func mustInt(t *testing.T, s string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// A Redis stall longer than store_timeout while requests flow: the requests
// caught in it are answered 503 with Retry-After, and when all is settled the
// counter equals exactly what the admitted requests used (a 503 is never
// charged, whether its reserve ran late or not).
func TestLLMBudgetStallChargesOnlyAdmitted(t *testing.T) {
	srv := redistest.StartWith(t, "--enable-debug-command", "yes")
	url, _, counter := budgetOnRedis(t, srv, "stall")
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()}) // no timeout: it sleeps the server
	defer rc.Close()
	// The stall begins once a few requests were admitted, so that it spares
	// some and catches the ones that follow.
	var admittedSoFar atomic.Int64
	fifthAdmitted := make(chan struct{})
	go func() {
		<-fifthAdmitted
		_ = rc.Do(context.Background(), "DEBUG", "SLEEP", "0.8").Err()
	}()
	type answer struct {
		status int
		retry  string
	}
	answers := make(chan answer, 80)
	var wg sync.WaitGroup
	for i := 0; i < 60; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, _ := chat(t, url, chatBody)
			if resp.StatusCode == http.StatusOK && admittedSoFar.Add(1) == 5 {
				close(fifthAdmitted)
			}
			answers <- answer{resp.StatusCode, resp.Header.Get("Retry-After")}
		}()
		// The pace of the traffic (40 requests a second, 1.5 s of it)
		// spreads it around the 0.8 s stall; it waits for nothing.
		time.Sleep(25 * time.Millisecond)
	}
	wg.Wait()
	close(answers)
	admitted, unavailable := 0, 0
	for a := range answers {
		switch a.status {
		case http.StatusOK:
			admitted++
		case http.StatusServiceUnavailable:
			unavailable++
			if a.retry == "" {
				t.Fatal("a 503 without Retry-After")
			}
		default:
			t.Fatalf("unexpected status %d", a.status)
		}
	}
	if unavailable == 0 || admitted == 0 {
		t.Fatalf("%d admitted, %d unavailable: the stall must catch some requests and spare others", admitted, unavailable)
	}
	want := int64(admitted) * 100
	// 10 s: the background releases of the lost reserves.
	eventuallyValue(t, 10*time.Second, fmt.Sprintf("the counter at %d: the usage of the %d admitted requests (%d answered 503)", want, admitted, unavailable),
		counter, func(n int64) bool { return n == want })
}

// Without a principal, each API's own credential keys the budget: Anthropic
// clients that send only x-api-key get a budget per key.
func TestLLMBudgetDefaultPrincipalIsTheAPICredential(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL,
		LLMBudget: []string{"budget per_key {\n scope key\n limit 300\n window 1h\n unit tokens\n }"}}.String())
	const msg = `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`
	send := func(key string) int {
		resp, _ := do(t, http.MethodPost, url+"/v1/messages", msg, "Content-Type: application/json", "X-Api-Key: "+key, "Anthropic-Version: 2023-06-01")
		waitSettles()
		return resp.StatusCode
	}
	codes := []int{send("sk-ant-one"), send("sk-ant-one"), send("sk-ant-one"), send("sk-ant-one")}
	if codes[0] != 200 || codes[3] != http.StatusTooManyRequests {
		t.Fatalf("one key: %v, want 200s then 429 once its 300 tokens are spent", codes)
	}
	if code := send("sk-ant-two"); code != http.StatusOK {
		t.Fatalf("a never-used key after another ran out: %d, want 200 (its own budget)", code)
	}
}

// fleetlimit and llmbudget on one route give one RateLimit list with both.
func TestRateLimitItemsOfBothHandlersJoin(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, testCaddyfile{Port: port, Upstream: up.URL,
		FleetLimit: []string{"zone rps {\n key {http.request.header.Authorization}\n events 100\n window 1m\n }"},
		LLMBudget:  []string{"budget tokens {\n limit 100000\n window 1h\n unit tokens\n }", "ratelimit_scopes global"}}.String())
	resp, body := chat(t, url, chatBody, "Authorization: Bearer joined")
	rl, policy := resp.Header.Get("RateLimit"), resp.Header.Get("RateLimit-Policy")
	if resp.StatusCode != http.StatusOK || !strings.Contains(rl, `"rps";r=`) || !strings.Contains(rl, `"tokens";r=`) ||
		policy != `"rps";q=100;w=60, "tokens";q=100000;w=3600` {
		t.Fatalf("%d %s: RateLimit %q, RateLimit-Policy %q; want both handlers' items in one list", resp.StatusCode, body, rl, policy)
	}
}

// Each API gets its own error shape, so its SDK raises its own error class;
// every shape names the budget. The RateLimit headers parse as Structured
// Field lists of one item per budget.
func TestErrorShapesPerAPIAndRateLimitHeaders(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	startCaddy(t, llmCaddyfile(port, up.URL, "", `budget tiny {
			limit 10
			window 1h
			unit tokens
		}
		ratelimit_scopes global`))
	tests := []struct {
		name, path, body string
		check            func(body string) bool
	}{
		{"openai", "/v1/chat/completions", chatBody, func(b string) bool {
			var e struct {
				Error struct{ Type, Code, Message string } `json:"error"`
			}
			return json.Unmarshal([]byte(b), &e) == nil && e.Error.Code == "request_exceeds_budget" && strings.Contains(e.Error.Message, `"tiny"`)
		}},
		{"anthropic", "/v1/messages", `{"model":"claude-sonnet-4-6","max_tokens":200,"messages":[{"role":"user","content":"hi"}]}`, func(b string) bool {
			var e struct {
				Type  string
				Error struct{ Type, Message string } `json:"error"`
			}
			return json.Unmarshal([]byte(b), &e) == nil && e.Type == "error" && e.Error.Type == "rate_limit_error" && strings.Contains(e.Error.Message, `"tiny"`)
		}},
		{"gemini", "/v1beta/models/gemini-2.5-flash:generateContent", `{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"maxOutputTokens":200}}`, func(b string) bool {
			var e struct {
				Error struct {
					Code    int
					Status  string
					Message string
				} `json:"error"`
			}
			return json.Unmarshal([]byte(b), &e) == nil && e.Error.Code == 429 && e.Error.Status == "RESOURCE_EXHAUSTED" && strings.Contains(e.Error.Message, `"tiny"`)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, body := do(t, http.MethodPost, url+tt.path, tt.body, "Content-Type: application/json")
			if resp.StatusCode != http.StatusTooManyRequests || !tt.check(body) {
				t.Fatalf("%d %s: not the %s error shape naming the budget", resp.StatusCode, body, tt.name)
			}
			items := parseSFList(t, resp.Header.Get("RateLimit"))
			if len(items) != 1 || items[0].name != "tiny" || items[0].params["r"] == "" || items[0].params["t"] == "" {
				t.Fatalf("RateLimit %q: want one item \"tiny\" with r and t", resp.Header.Get("RateLimit"))
			}
			policy := parseSFList(t, resp.Header.Get("RateLimit-Policy"))
			if len(policy) != 1 || policy[0].params["q"] != "10" || policy[0].params["w"] != "3600" {
				t.Fatalf("RateLimit-Policy %q", resp.Header.Get("RateLimit-Policy"))
			}
		})
	}
}

type sfItem struct {
	name   string
	params map[string]string
}

// parseSFList parses an RFC 8941 list of string items with integer
// parameters, the form of the RateLimit headers, strictly: anything else
// fails the test.
func parseSFList(t *testing.T, v string) []sfItem {
	t.Helper()
	var items []sfItem
	for _, member := range strings.Split(v, ",") {
		member = strings.TrimSpace(member)
		parts := strings.Split(member, ";")
		name, err := strconv.Unquote(parts[0])
		if err != nil || !strings.HasPrefix(parts[0], `"`) {
			t.Fatalf("list member %q of %q is not a string item", member, v)
		}
		it := sfItem{name: name, params: map[string]string{}}
		for _, p := range parts[1:] {
			k, val, ok := strings.Cut(p, "=")
			if _, err := strconv.ParseInt(val, 10, 64); !ok || err != nil || k == "" || strings.ToLower(k) != k {
				t.Fatalf("parameter %q of %q is not key=integer", p, v)
			}
			it.params[k] = val
		}
		items = append(items, it)
	}
	return items
}
