package fleetguard

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// BenchmarkFleetLimitServeHTTP is the whole handler for a known key: resolve
// the key placeholder, hash it, gate and record, write the RateLimit headers.
func BenchmarkFleetLimitServeHTTP(b *testing.B) {
	benchServeHTTP(b, map[string]string{"per_key": "{http.request.header.X-API-Key}"})
}

// BenchmarkFleetLimitServeHTTPTwoZones is a route with a per-key and a
// per-address zone.
func BenchmarkFleetLimitServeHTTPTwoZones(b *testing.B) {
	benchServeHTTP(b, map[string]string{"per_key": "{http.request.header.X-API-Key}", "per_ip": "{http.request.remote.host}"})
}

// BenchmarkFleetLimitServeHTTPReplacerKey is a key only Caddy's replacer
// resolves (text around a placeholder).
func BenchmarkFleetLimitServeHTTPReplacerKey(b *testing.B) {
	benchServeHTTP(b, map[string]string{"per_key": "key-{http.request.header.X-API-Key}"})
}

// benchServeHTTP runs the handler with zones (name to key) on one request.
// The request carries Caddy's own HTTP replacer, and the response headers are
// cleared between requests as a new response's would be (a map that already
// holds Caddy's Server header, so its storage is there).
func benchServeHTTP(b *testing.B, keys map[string]string) {
	eng, err := newEngines(memoryIdentity("bench"), nil, time.Second, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = eng.Destruct() })
	h := &FleetLimit{Zones: map[string]*ZoneConfig{}}
	for name, key := range keys {
		h.Zones[name] = &ZoneConfig{Key: key, Events: 1 << 31, Window: caddy.Duration(time.Hour)}
	}
	h.engines, h.logger = eng, zap.NewNop()
	if err := h.resolveZones(); err != nil {
		b.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.RemoteAddr = "192.0.2.1:41234"
	req.Header.Set("X-API-Key", "sk-live-0123456789abcdef")
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), nil, &caddyhttp.Server{})
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	w := httptest.NewRecorder()
	hdr := w.Header()
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		clear(hdr)
		if err := h.ServeHTTP(w, req, next); err != nil {
			b.Fatal(err)
		}
	}
	if hdr.Get("RateLimit") == "" || hdr.Get("RateLimit-Policy") == "" {
		b.Fatalf("the handler sent no RateLimit headers: %v", hdr)
	}
}
