package fleetguard

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// lifecycleCaddyfile is one of two configs that differ (sync interval, a
// header) but share the store, a zone and a budget.
func lifecycleCaddyfile(port int, redisURL, upstream string, variant int) string {
	return fmt.Sprintf(`{
	admin {ADMIN}
	fleetguard {
		redis %s
		prefix life
		sync_interval %dms
	}
}
:%d {
	header X-Variant %d
	handle /limited {
		fleetlimit {
			zone life_zone {
				key {http.request.header.X-API-Key}
				events 1000
				window 1h
			}
		}
		respond "ok"
	}
	handle {
		llmbudget {
			store_timeout 2s
			budget life_tokens {
				limit 100000
				window 1h
				unit tokens
			}
		}
		reverse_proxy %s
	}
}`, redisURL, 50+10*variant, port, variant, strings.TrimPrefix(upstream, "http://"))
}

// Ten reloads between two configs while both handlers count: the counters
// survive every reload, and after Caddy stops no goroutine of fleetguard or
// of its Redis client remains and the client is closed.
func TestTenReloadsKeepCountersAndLeakNothing(t *testing.T) {
	srv := redistest.Start(t)
	up := newFakeLLM(t)
	rc := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rc.Close()
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	// Everything started so far (Redis readers, the upstream, other tests'
	// leftovers) is not this test's to judge.
	ignore := goleak.IgnoreCurrent()

	tc := &testCaddy{t: t, admin: fmt.Sprintf("localhost:%d", freePort(t))}
	if err := caddy.Load(tc.adapt(lifecycleCaddyfile(port, srv.URL(), up.URL, 0)), true); err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = caddy.Stop()
		}
	}()
	var shared *engines
	enginePool.Range(func(_, v any) bool {
		if e := v.(*engines); e.identity.name.prefix == "life" {
			shared = e
		}
		return true
	})
	if shared == nil || shared.client == nil {
		t.Fatal("no Redis store for prefix life")
	}

	for i := 1; i <= 11; i++ {
		resp, _ := get(t, url+"/limited", "X-API-Key: life-key")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("round %d: fleetlimit %d", i, resp.StatusCode)
		}
		// 1000 per hour, one request per round, on this slot's floor (F =
		// 1000/2/16 = 31): the window remembers them all.
		if want := fmt.Sprintf(`"life_zone";r=%d;`, 31-i); !strings.HasPrefix(resp.Header.Get("RateLimit"), want) {
			t.Fatalf("round %d: RateLimit %q, want %s…: the zone's counts did not survive the reloads", i, resp.Header.Get("RateLimit"), want)
		}
		if want := fmt.Sprint((i + 1) % 2); resp.Header.Get("X-Variant") != want {
			t.Fatalf("round %d: served by variant %q, want %s", i, resp.Header.Get("X-Variant"), want)
		}
		if resp, body := chat(t, url, chatBody, "Authorization: Bearer life"); resp.StatusCode != http.StatusOK {
			t.Fatalf("round %d: llmbudget %d %s", i, resp.StatusCode, body)
		}
		if got := budgetCounter(t, rc, "life", "life_tokens"); got != int64(100*i) {
			t.Fatalf("round %d: budget counter %d, want %d (100 per request): it did not survive the reloads", i, got, 100*i)
		}
		if i == 11 {
			break
		}
		if code, body := tc.load("text/caddyfile", lifecycleCaddyfile(port, srv.URL(), up.URL, i%2)); code != http.StatusOK {
			t.Fatalf("reload %d: %d %s", i, code, body)
		}
		var same bool
		enginePool.Range(func(_, v any) bool { same = same || v.(*engines) == shared; return true })
		if !same {
			t.Fatalf("reload %d replaced the store: counters and the client would start over", i)
		}
	}

	if err := caddy.Stop(); err != nil {
		t.Fatal(err)
	}
	stopped = true
	if err := shared.client.Ping(t.Context()).Err(); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("after stop, the Redis client answers %v, want %v", err, redis.ErrClosed)
	}
	goleak.VerifyNone(t, ignore,
		// Not fleetguard's: Caddy's admin server and storage lock outlive a
		// stop by design, and the test upstream still serves the keep-alive
		// connections reverse_proxy left idle.
		goleak.IgnoreAnyFunction("github.com/caddyserver/certmagic.keepLockfileFresh"),
		goleak.IgnoreAnyFunction("github.com/caddyserver/caddy/v2.replaceLocalAdminServer.func2"),
		goleak.IgnoreAnyFunction("net/http.(*conn).serve"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
	)
}

// A Redis that does not answer at load is a warning, not an error (the
// design degrades), and the warning says plainly what the config will do.
func TestUnreachableRedisAtLoadIsSaidPlainly(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	port := freePort(t)
	dead := freePort(t) // nothing listens there
	tc := startCaddy(t, testCaddyfile{Port: port, Global: []string{
		"log {\n output file " + logFile + "\n level WARN\n }",
		fmt.Sprintf("fleetguard {\n redis redis://127.0.0.1:%d/0\n prefix unreachable%d\n }", dead, port),
	}}.String())
	_ = tc
	raw, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(raw), "the Redis store does not answer; the config is valid and loads") {
		t.Fatalf("the load log does not say the store is unreachable:\n%s", raw)
	}
}
