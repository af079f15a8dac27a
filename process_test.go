package fleetguard

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	"github.com/fleetguard/fleetguard/budget/usage"
	"github.com/fleetguard/fleetguard/internal/redistest"
)

// caddyProcessEnv, set, makes the test binary run Caddy with the Caddyfile it
// names instead of the tests: a Caddy in its own process, for faults that
// end a process (kill -9), without building a binary.
const caddyProcessEnv = "FLEETGUARD_TEST_CADDYFILE"

func TestMain(m *testing.M) {
	if path := os.Getenv(caddyProcessEnv); path != "" {
		os.Args = []string{"caddy", "run", "--config", path, "--adapter", "caddyfile"}
		caddycmd.Main()
		return
	}
	os.Exit(m.Run())
}

// startCaddyProcess runs Caddy with caddyfile in a process of its own and
// waits until addr answers.
func startCaddyProcess(t *testing.T, caddyfile, addr string) *exec.Cmd {
	t.Helper()
	path := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), caddyProcessEnv+"="+path)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	eventuallyValue(t, 20*time.Second, "Caddy in its own process answering on "+addr, func() error {
		resp, err := http.Get("http://" + addr + "/")
		if err == nil {
			resp.Body.Close()
		}
		return err
	}, func(err error) bool { return err == nil })
	return cmd
}

// TestKillingCaddyMidStreamIsSettledByTheFleet: a Caddy killed with -9 with
// 20 leased streams in flight settles nothing itself. Until the fleet takes
// it for dead, what stays charged is what the streams held (their prompts
// and leases so far, never their whole caps); once its word has lapsed, the
// next Caddy on the same Redis settles each stream to what it had been
// granted to forward, which gives back the leases ahead and never goes
// below what the upstream billed.
func TestKillingCaddyMidStreamIsSettledByTheFleet(t *testing.T) {
	const streams = 20
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	up.Output, up.Words, up.Interval = 3000, true, 20*time.Millisecond // 50 words a second, as an LLM streams
	port, adminPort := freePort(t), freePort(t)
	caddyfile := fmt.Sprintf(`{
	admin localhost:%d
	fleetguard {
		redis %s
		prefix kill
	}
}
:%d {
	llmbudget {
		budget all {
			limit 1000000
			window 1h
			unit tokens
		}
		budget per_key {
			scope key
			limit 100000
			window 1h
			unit tokens
		}
	}
	reverse_proxy %s
}
`, adminPort, srv.URL(), port, strings.TrimPrefix(up.URL, "http://"))
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	cmd := startCaddyProcess(t, caddyfile, addr)
	c := srv.Client(t)
	ctx := context.Background()
	held := func() (total, perKey int64) {
		keys, err := c.Keys(ctx, "kill:bg:{b}:*").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			if !isBudgetCounter(k) {
				continue
			}
			v, err := c.Get(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			n, _ := strconv.ParseInt(v, 10, 64)
			if strings.Contains(k, ":all:") {
				total += n
			} else {
				perKey += n
			}
		}
		return total, perKey
	}
	reserved := func() int {
		keys, _ := c.Keys(ctx, "kill:bg:{b}:res:*").Result()
		n := 0
		for _, k := range keys {
			if c.HGet(ctx, k, "s").Val() == "r" {
				n++
			}
		}
		return n
	}

	// One short answer proves the model (it bills no output its text does
	// not show), so the next streams lease.
	warm := `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":300,"messages":[{"role":"user","content":"hi"}]}`
	if resp, _ := chat(t, "http://"+addr, warm, "Authorization: Bearer sk-kill"); resp.StatusCode != http.StatusOK {
		t.Fatalf("the warm-up answer: %d", resp.StatusCode)
	}
	eventually(t, 5*time.Second, "the warm-up answer's settle", func() bool { return reserved() == 0 })
	baseTotal, basePerKey := held()
	baseGenerated := up.Generated()

	body := `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
	var bodies []io.ReadCloser
	for range streams {
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk-kill")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, resp.Body)
		go func() { _, _ = io.Copy(io.Discard, resp.Body) }()
	}
	time.Sleep(5 * time.Second) // about 250 words each
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	for _, b := range bodies {
		b.Close()
	}

	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
	total, perKey := held()
	total, perKey = total-baseTotal, perKey-basePerKey
	billed := streams*int64(up.Input) + up.Generated() - baseGenerated
	if total != perKey || total < billed || total > streams*(prompt+4096)*3/4 {
		t.Fatalf("after the kill: %d held in all, %d per key; want the same, at least the %d billed and far below the caps (%d)", total, perKey, billed, streams*(prompt+4096))
	}
	if n := reserved(); n != streams {
		t.Fatalf("%d open reservations after the kill, want the %d streams'", n, streams)
	}

	// The next Caddy speaks for itself once it has a request in flight, and
	// sweeps the silent owner's streams once its word has lapsed.
	startCaddyProcess(t, caddyfile, addr)
	resp2, got := chat(t, "http://"+addr, strings.Replace(body, `"stream":true,`, "", 1), "Authorization: Bearer sk-kill")
	if resp2.StatusCode != http.StatusOK {
		t.Fatalf("after the restart: %d %s", resp2.StatusCode, got)
	}
	eventually(t, 20*time.Second, "the sweep of the killed Caddy's streams", func() bool { return reserved() == 0 })
	_, metricsText := get(t, fmt.Sprintf("http://localhost:%d/metrics", adminPort))
	if want := fmt.Sprintf("fleetguard_llmbudget_swept_reservations_total %d\n", streams); !strings.Contains(metricsText, want) {
		t.Fatalf("the sweeping Caddy's metrics do not show %q", strings.TrimSpace(want))
	}
	after, _ := held()
	swept := after - baseTotal - int64(up.Input) - int64(min(up.Output, 4096))
	t.Logf("%d streams killed: the upstream billed %d; %d held at the kill, %d after the sweep", streams, billed, total, swept)
	// A lease is about twice the count at its last extension, a grant the
	// count and a second of output ahead: the sweep gives back a tenth of
	// what was held beyond the bill at least (the rest is mostly the strict
	// bound's count of a token a byte, which the bill does not reach).
	if swept < billed || total-swept < (total-billed)/10 {
		t.Fatalf("after the sweep: %d charged for %d billed (%d held at the kill); want at least the bill, and the leases ahead given back", swept, billed, total)
	}
}

// isBudgetCounter reports whether a budget store key is a counter, not a
// reservation's record, a top set, the marks of thresholds or denied keys,
// or the limits set at run time.
func isBudgetCounter(key string) bool {
	for _, kind := range []string{":res:", ":top:", ":alerted:", ":denied:"} {
		if strings.Contains(key, kind) {
			return false
		}
	}
	for _, kind := range []string{":limits", ":owners"} {
		if strings.Contains(key, kind) {
			return false
		}
	}
	return true
}
