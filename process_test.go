package fleetguard

import (
	"bufio"
	"context"
	"fmt"
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

// TestKillingCaddyMidStreamKeepsOnlyTheLease: a Caddy killed with -9 in the
// middle of a leased stream settles nothing; what stays charged is what the
// stream held (its prompt and its lease so far, which bounds what the
// upstream generated up to the kill), never its whole cap, never twice. The
// next Caddy on the same Redis serves and settles as before.
func TestKillingCaddyMidStreamKeepsOnlyTheLease(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	up.Output, up.Words, up.Interval = 3000, true, 2*time.Millisecond
	port := freePort(t)
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
`, freePort(t), srv.URL(), port, strings.TrimPrefix(up.URL, "http://"))
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

	// One short answer proves the model (it bills no output its text does
	// not show), so the next stream leases.
	warm := `{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"max_tokens":300,"messages":[{"role":"user","content":"hi"}]}`
	if resp, _ := chat(t, "http://"+addr, warm, "Authorization: Bearer sk-kill"); resp.StatusCode != http.StatusOK {
		t.Fatalf("the warm-up answer: %d", resp.StatusCode)
	}
	eventually(t, 5*time.Second, "the warm-up answer's settle", func() bool {
		n, _ := c.Keys(ctx, "kill:bg:{b}:res:*").Result()
		return len(n) == 0
	})
	baseTotal, basePerKey := held()

	body := `{"model":"gpt-4o","stream":true,"max_tokens":4096,"messages":[{"role":"user","content":"go on"}]}`
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer sk-kill")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	words := 0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() && words < 300 {
		if strings.Contains(sc.Text(), `"content"`) {
			words++
		}
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	resp.Body.Close()

	all, _ := held()
	total, perKey := held()
	total, perKey = total-baseTotal, perKey-basePerKey
	prompt := promptEstimate(t, usage.OpenAIChat, "/v1/chat/completions", body)
	// 300 words of 4.5 bytes are 1,350 tokens by the strict bound: the
	// lease covered them, a step or two ahead at most.
	if total != perKey || total < prompt+1350 || total > prompt+2*1350 {
		t.Fatalf("after the kill: %d held in all, %d per key; want the same, about the prompt (%d) and the lease over 300 words, far below the cap 4096", total, perKey, prompt)
	}
	t.Logf("killed after %d words: %d held (prompt %d); the upstream generated %d", words, total, prompt, up.Generated())
	// The record stays until it expires: nothing settles it twice.
	if n, _ := c.Keys(ctx, "kill:bg:{b}:res:*").Result(); len(n) != 1 {
		t.Fatalf("%d reservation records after the kill, want the one that was cut", len(n))
	}

	startCaddyProcess(t, caddyfile, addr)
	resp2, got := chat(t, "http://"+addr, strings.Replace(body, `"stream":true,`, "", 1), "Authorization: Bearer sk-kill")
	if resp2.StatusCode != http.StatusOK {
		t.Fatalf("after the restart: %d %s", resp2.StatusCode, got)
	}
	eventuallyValue(t, 5*time.Second, fmt.Sprintf("after a request on the new Caddy, %d held + what it reported", all), func() int64 {
		after, _ := held()
		return after
	}, func(after int64) bool { return after == all+int64(up.Input)+int64(min(up.Output, 4096)) })
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
	return !strings.HasSuffix(key, ":limits")
}
