package fleetguard

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// A denial on a server without handle_errors carries a body: on an LLM API's
// path that API's own rate-limit error, which its SDK raises as such; else a
// line naming the zone and the wait. error_body off leaves the body empty
// (Caddy's default); handle_errors routes answer where there are any
// (TestFleetLimitCaddyfileAndReload).
func TestAFleetLimitDenialSaysSoInTheAPIsOwnShape(t *testing.T) {
	for _, option := range []string{"", "error_body off"} {
		port := freePort(t)
		startCaddy(t, testCaddyfile{Port: port,
			FleetLimit: []string{fmt.Sprintf("zone per_path {\n key %d{http.request.uri.path}\n events 1\n window 1m\n }", port), option}}.String())
		for _, tt := range []struct {
			path, want string
		}{
			{"/v1/chat/completions", `"code":"rate_limit_exceeded"`},
			{"/v1/messages", `"type":"rate_limit_error"`},
			{"/v1beta/models/gemini-2.0-flash:generateContent", `"status":"RESOURCE_EXHAUSTED"`},
			{"/hello", `rate limit of zone "per_path" exceeded; retry in `},
		} {
			url := fmt.Sprintf("http://127.0.0.1:%d%s", port, tt.path)
			if resp, body := do(t, http.MethodPost, url, "{}"); resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: first request %d %q %v", tt.path, resp.StatusCode, body, resp.Header)
			}
			resp, body := do(t, http.MethodPost, url, "{}")
			if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
				t.Fatalf("%s: %d, Retry-After %q", tt.path, resp.StatusCode, resp.Header.Get("Retry-After"))
			}
			if option != "" {
				if body != "" {
					t.Fatalf("error_body off, %s: body %q", tt.path, body)
				}
				continue
			}
			if !strings.Contains(body, tt.want) || !strings.Contains(body, "per_path") {
				t.Fatalf("%s: body %q, want %s naming the zone", tt.path, body, tt.want)
			}
			if tt.path != "/hello" && !json.Valid([]byte(body)) {
				t.Fatalf("%s: body %q is not JSON", tt.path, body)
			}
		}
	}
}
