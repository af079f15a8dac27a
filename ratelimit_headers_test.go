package fleetguard

import (
	"net/http"
	"testing"
)

func TestSetRateLimitHeaders(t *testing.T) {
	cases := []struct {
		name                 string
		before               http.Header
		wantPolicy, wantRate string
	}{
		{"alone", http.Header{}, `"z";q=5;w=60`, `"z";r=4;t=60`},
		{"after another handler's items", http.Header{
			"Ratelimit-Policy": {`"b";q=9;w=3600`}, "Ratelimit": {`"b";r=8;t=100`},
		}, `"b";q=9;w=3600, "z";q=5;w=60`, `"b";r=8;t=100, "z";r=4;t=60`},
		{"after an empty value", http.Header{"Ratelimit-Policy": {""}, "Ratelimit": {""}}, `"z";q=5;w=60`, `"z";r=4;t=60`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			appendRateLimitHeaders(c.before, `"z";q=5;w=60`, `"z";r=4;t=60`)
			if got := c.before.Values("RateLimit-Policy"); len(got) != 1 || got[0] != c.wantPolicy {
				t.Errorf("RateLimit-Policy = %q, want [%q]", got, c.wantPolicy)
			}
			if got := c.before.Values("RateLimit"); len(got) != 1 || got[0] != c.wantRate {
				t.Errorf("RateLimit = %q, want [%q]", got, c.wantRate)
			}
		})
	}
}

// The two values share one allocation: a later handler that adds to one
// header must not write over the other, and a rewrite in place (Caddy's
// header handler) must stay in its own response.
func TestSetRateLimitHeadersDoNotAlias(t *testing.T) {
	first, second := http.Header{}, http.Header{}
	appendRateLimitHeaders(first, "policy", "rate")
	appendRateLimitHeaders(second, "policy", "rate")
	first.Add("RateLimit-Policy", "added")
	if got := first.Values("RateLimit"); len(got) != 1 || got[0] != "rate" {
		t.Fatalf("appending to RateLimit-Policy changed RateLimit to %q", got)
	}
	first["Ratelimit-Policy"][0] = "rewritten"
	if got := second.Get("RateLimit-Policy"); got != "policy" {
		t.Fatalf("rewriting one response's RateLimit-Policy changed another's to %q", got)
	}
}
