package fleetguard

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget/usage"
)

// A fleetlimit denial is a caddyhttp.Error, so the server's handle_errors
// routes answer it. A server with none writes its status and no body, which
// the official LLM SDKs report as "429 status code (no body)": so where no
// handle_errors route would, fleetlimit writes a body of its own. On a path
// llmbudget recognises as an LLM API it is that API's own rate-limit error
// (OpenAI rate_limit_exceeded, Anthropic rate_limit_error, Gemini
// RESOURCE_EXHAUSTED), which each SDK raises as its rate-limit error, with
// x-should-retry: false when the wait is longer than the SDKs should sleep;
// elsewhere a line of text naming the zone and the wait.

// hasErrorRoutes reports whether the request's server has handle_errors
// routes, which answer a handler's error themselves.
func hasErrorRoutes(r *http.Request) bool {
	srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	return !ok || srv.Errors != nil && len(srv.Errors.Routes) > 0
}

// writeDenial writes fleetlimit's own 429 body for a denial by zone, whose
// wait is retry seconds.
func writeDenial(w http.ResponseWriter, r *http.Request, zone string, retry int64) error {
	msg := fmt.Sprintf("rate limit of zone %q exceeded; retry in %ds", zone, retry)
	// SDKs sleep out a shorter wait by themselves (llmbudget's
	// max_retry_after default).
	if time.Duration(retry)*time.Second > defaultMaxRetryAfter {
		w.Header().Set("X-Should-Retry", "false")
	}
	format := usage.FormatFromPath(usage.NormalizePath(r.URL.Path))
	if format == usage.Unknown {
		body := msg + "\n"
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.WriteHeader(http.StatusTooManyRequests)
		_, err := w.Write([]byte(body))
		return err
	}
	return writeError(w, format, http.StatusTooManyRequests, "requests", "rate_limit_exceeded", msg)
}
