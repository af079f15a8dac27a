package fleetguard

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/fleetguard/fleetguard/internal/wait"
)

// testCaddy is a real Caddy running in this test process, driven through its
// admin API like an operator would.
type testCaddy struct {
	t     *testing.T
	admin string // host:port of the admin endpoint
}

// freePort returns a loopback port nobody listens on right now.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startCaddy adapts a Caddyfile (in which {ADMIN} stands for the admin
// address) and runs it until the test ends.
func startCaddy(t *testing.T, caddyfile string) *testCaddy {
	t.Helper()
	tc := &testCaddy{t: t, admin: fmt.Sprintf("localhost:%d", freePort(t))}
	cfg := tc.adapt(caddyfile)
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading Caddy: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Stop(); err != nil {
			t.Logf("stopping Caddy: %v", err)
		}
	})
	return tc
}

func (tc *testCaddy) adapt(caddyfile string) []byte {
	tc.t.Helper()
	src := strings.ReplaceAll(caddyfile, "{ADMIN}", tc.admin)
	adapter := caddyconfig.GetAdapter("caddyfile")
	cfg, warnings, err := adapter.Adapt([]byte(src), nil)
	if err != nil {
		tc.t.Fatalf("adapting Caddyfile: %v", err)
	}
	for _, w := range warnings {
		tc.t.Logf("Caddyfile warning: %s", w.String())
	}
	return cfg
}

// load posts a config to the admin API's /load and returns the status and
// body of the answer.
func (tc *testCaddy) load(contentType, body string) (int, string) {
	tc.t.Helper()
	body = strings.ReplaceAll(body, "{ADMIN}", tc.admin)
	post := func() (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodPost, "http://"+tc.admin+"/load", strings.NewReader(body))
		req.Header.Set("Content-Type", contentType)
		// A load that sets "admin" replaces Caddy's admin server, closing its
		// connections: a kept-alive one reused for the next POST (which the
		// transport does not retry) would fail with EOF.
		req.Close = true
		return http.DefaultClient.Do(req)
	}
	resp, err := post()
	if err != nil {
		// The admin server that took the load can be replaced before it
		// answers (EOF). Posting the same config again is harmless: Caddy
		// answers 200 for a config it already runs, or the error again.
		var retry error
		if !wait.Poll(5*time.Second, func() bool { resp, retry = post(); return retry == nil }) {
			tc.t.Fatalf("POST /load: %v, then %v", err, retry)
		}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var apiErr struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(b, &apiErr) == nil && apiErr.Error != "" {
		return resp.StatusCode, apiErr.Error
	}
	return resp.StatusCode, string(b)
}

// get sends a request with optional headers ("Name: value").
func get(t *testing.T, url string, headers ...string) (*http.Response, string) {
	t.Helper()
	return do(t, http.MethodGet, url, "", headers...)
}

func do(t *testing.T, method, url, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	for _, h := range headers {
		name, value, _ := strings.Cut(h, ":")
		req.Header.Set(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	// A connection per request: a reload closes the old server's
	// connections, and a request sent on one it was closing reads EOF.
	req.Close = true
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func adaptCaddyfile(src string) ([]byte, []caddyconfig.Warning, error) {
	return caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), nil)
}

type caddyconfigWarning = caddyconfig.Warning

func adaptCaddyfileFile(src []byte, filename string) ([]byte, []caddyconfig.Warning, error) {
	return caddyconfig.GetAdapter("caddyfile").Adapt(src, map[string]any{"filename": filename})
}

// testCaddyfile is the Caddyfile of a test's Caddy: global options and one site
// on Port with llmbudget, fleetlimit or both in front of an upstream. String
// renders it; a test that wants a variant sets a field, never patches the
// text. Each line of a block may itself be a block ("budget g {\n…\nunit tokens\n}").
type testCaddyfile struct {
	// Admin is the admin endpoint; startCaddy's own ({ADMIN}) when empty.
	Admin string
	// Global are global options after admin: a fleetguard block, metrics,
	// a log block.
	Global []string
	Port   int
	// FleetLimit are the fleetlimit block's lines; no fleetlimit when nil.
	FleetLimit []string
	// LLMBudget are the llmbudget block's lines; no llmbudget when nil.
	LLMBudget []string
	// Directives are more directives of the site (handle_errors, log).
	Directives []string
	// Upstream is the URL reverse_proxy proxies to; the site responds "ok"
	// when it is empty.
	Upstream string
}

func (c testCaddyfile) String() string {
	var b strings.Builder
	b.WriteString("{\n\tadmin " + cmp.Or(c.Admin, "{ADMIN}") + "\n")
	for _, g := range c.Global {
		b.WriteString("\t" + g + "\n")
	}
	fmt.Fprintf(&b, "}\n:%d {\n", c.Port)
	block := func(name string, lines []string) {
		if lines == nil {
			return
		}
		b.WriteString("\t" + name + " {\n")
		for _, l := range lines {
			b.WriteString("\t\t" + l + "\n")
		}
		b.WriteString("\t}\n")
	}
	block("fleetlimit", c.FleetLimit)
	block("llmbudget", c.LLMBudget)
	for _, d := range c.Directives {
		b.WriteString("\t" + d + "\n")
	}
	if c.Upstream == "" {
		b.WriteString("\trespond \"ok\"\n")
	} else {
		b.WriteString("\treverse_proxy " + strings.TrimPrefix(c.Upstream, "http://") + "\n")
	}
	b.WriteString("}\n")
	return b.String()
}

// provisionedPrefixes numbers the memory stores of provisionedHandler.
var provisionedPrefixes atomic.Int64

// provisionedHandler loads an llmbudget handler of cfg (its JSON config) as
// Caddy loads one from a config: the fleetguard app of app (a memory store
// of a prefix of its own when app is nil or names none) and the events app
// loaded, then the module decoded, provisioned and validated, so the handler
// is compiled once and its metrics and budgets bound as in a running Caddy.
// The test's end cleans both up as a config's unload does.
func provisionedHandler(t testing.TB, cfg *LLMBudget, app *App) *LLMBudget {
	t.Helper()
	h, err := provisionHandler(t, cfg, app)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// provisionHandler is provisionedHandler returning the error of a config
// that does not load.
func provisionHandler(t testing.TB, cfg *LLMBudget, app *App) (*LLMBudget, error) {
	t.Helper()
	if app == nil {
		app = &App{}
	}
	if app.Prefix == "" {
		app.Prefix = fmt.Sprintf("provisioned%d", provisionedPrefixes.Add(1))
	}
	appJSON, err := json.Marshal(app)
	if err != nil {
		t.Fatal(err)
	}
	handlerJSON, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	config := &caddy.Config{}
	root, err := caddy.ProvisionContext(config)
	if err != nil {
		t.Fatal(err)
	}
	// The app is loaded into a context of the test's, which cleans it up;
	// ProvisionContext's own context is never cancelled.
	config.AppsRaw = caddy.ModuleMap{"fleetguard": appJSON}
	ctx, cancel := caddy.NewContext(root)
	t.Cleanup(cancel)
	if _, err := ctx.App("fleetguard"); err != nil {
		t.Fatal(err)
	}
	h, err := ctx.LoadModuleByID("http.handlers.llmbudget", handlerJSON)
	if err != nil {
		return nil, err
	}
	return h.(*LLMBudget), nil
}

// eventually waits until cond holds, checking every 10 ms, and fails the
// test saying what did not happen when timeout passes first. Every test that
// waits for something to happen waits through it or eventuallyValue (and
// the other packages' tests through internal/wait, as these do): one loop
// polls, and every failed wait reads alike.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	wait.Until(t, timeout, what, cond)
}

// eventuallyValue reads until ok accepts what read returns, and returns that;
// when timeout passes first it fails the test with the last value read, so
// the failure shows how far the wait got.
func eventuallyValue[T any](t testing.TB, timeout time.Duration, what string, read func() T, ok func(T) bool) T {
	t.Helper()
	var v T
	if !wait.Poll(timeout, func() bool { v = read(); return ok(v) }) {
		t.Fatalf("after %s: %s did not happen; last read: %+v", timeout, what, v)
	}
	return v
}
