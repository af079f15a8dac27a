package fleetguard

import (
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/ratelimit"
)

func init() {
	caddy.RegisterModule(FleetLimit{})
}

// FleetLimit is the `http.handlers.fleetlimit` handler: a rate limit per key
// that holds across every Caddy instance sharing the fleetguard store.
type FleetLimit struct {
	// Zones by name. A zone name is a counter identity across the fleet: two
	// handlers naming the same zone share its counters.
	Zones map[string]*ZoneConfig `json:"zones,omitempty"`
	// DryRun logs and counts denials but lets every request through.
	DryRun bool `json:"dry_run,omitempty"`
	// ErrorBody writes a body with a denial when the server has no
	// handle_errors routes to answer it: on a path of an LLM API (as
	// llmbudget recognises them) that API's own rate-limit error, elsewhere a
	// line naming the zone and the wait. handle_errors routes, where there
	// are any, answer instead. Default true.
	ErrorBody *bool `json:"error_body,omitempty"`
	// RateLimitHeaders says which responses carry the RateLimit and
	// RateLimit-Policy headers: "always" (admitted and denied), "denied"
	// (only 429s, like caddy-ratelimit; saves the two header fields on every
	// admitted response, measurable on a busy Caddy) or "off". Retry-After is
	// on every denial regardless. Default "always".
	RateLimitHeaders string `json:"ratelimit_headers,omitempty"`

	zones  []zoneRuntime // ordered by ratelimit zone ID, the engine's lock order
	policy string        // RateLimit-Policy header, the same for every response
	// headersOnAdmit and headersOnDeny: RateLimitHeaders compiled.
	headersOnAdmit, headersOnDeny bool
	errorBody                     bool // ErrorBody compiled
	engines                       *engines
	logger                        *zap.Logger
	events                        emitter
}

// ZoneConfig is one zone's policy.
type ZoneConfig struct {
	// Key identifies who is limited, usually with placeholders such as
	// {http.request.header.X-API-Key} or {http.request.remote.host}. A key that
	// resolves to the empty string is a key of its own: every such request
	// shares one counter. Keys are hashed before they are stored or logged.
	Key string `json:"key,omitempty"`
	// Events is how many requests a key may make per Window, fleet-wide.
	Events int64 `json:"events,omitempty"`
	// Window is the length of the sliding window: no interval of this length
	// holds more than Events admitted requests of a key.
	Window caddy.Duration `json:"window,omitempty"`
	// Precision is the number of slots the window is counted in. The count
	// over-reads by at most one slot, never under-reads: a request becomes
	// admissible at most Window/Precision later than under an exact log, and
	// a client sending evenly below (1 - 1/Precision) of the limit is never
	// denied. Each slot costs 4 bytes per tracked key. Default 20, at most 100.
	Precision int `json:"precision,omitempty"`
	// Burst caps how many requests one instance admits at once for a key
	// (a local GCRA). Default: Events.
	Burst int64 `json:"burst,omitempty"`
	// MaxKeys caps how many keys the zone tracks on this instance, and so its
	// memory. A new key that arrives while the zone is full is not tracked
	// (not synced with the fleet, no window count) until idle keys are
	// evicted: it is limited by the local cap alone, Burst at once and Events
	// per Window after on each instance, with a cap of its own that other
	// keys' traffic cannot spend. The zone holds such caps for 16384 keys at
	// once (384 KiB); past that a new key replaces the cap closest to fresh.
	// Default 100000.
	MaxKeys int64 `json:"max_keys,omitempty"`
}

type zoneRuntime struct {
	name         string
	quotedName   string // for the RateLimit item
	key          keyResolver
	limit        ratelimit.Limit
	zone         *ratelimit.Zone
	allowed      prometheus.Counter
	deniedFleet  prometheus.Counter // by the window (the fleet's count)
	deniedLocal  prometheus.Counter // by the local burst cap
	dryRunDenied prometheus.Counter
}

// CaddyModule returns the Caddy module information.
func (FleetLimit) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.fleetlimit",
		New: func() caddy.Module { return new(FleetLimit) },
	}
}

var (
	_ caddy.Provisioner           = (*FleetLimit)(nil)
	_ caddy.Validator             = (*FleetLimit)(nil)
	_ caddyhttp.MiddlewareHandler = (*FleetLimit)(nil)
)

// Validate checks the zones; errors name the zone and the field.
func (h *FleetLimit) Validate() error {
	if len(h.Zones) == 0 {
		return fmt.Errorf("fleetlimit: zones: at least one zone is required")
	}
	if len(h.Zones) > ratelimit.MaxChecks {
		return fmt.Errorf("fleetlimit: zones: at most %d zones per handler, got %d", ratelimit.MaxChecks, len(h.Zones))
	}
	for name, z := range h.Zones {
		if err := z.validate(name); err != nil {
			return err
		}
	}
	switch h.RateLimitHeaders {
	case "", "always", "denied", "off":
	default:
		return fmt.Errorf("fleetlimit: ratelimit_headers %q: want always, denied or off", h.RateLimitHeaders)
	}
	return nil
}

func (z *ZoneConfig) validate(name string) error {
	switch {
	case name == "" || strings.ContainsAny(name, "{}:\" \t"):
		return fmt.Errorf("fleetlimit: zone %q: name must be non-empty without braces, colons, quotes or spaces", name)
	case z == nil:
		return fmt.Errorf("fleetlimit: zone %q: empty zone", name)
	case z.Key == "":
		return fmt.Errorf("fleetlimit: zone %q: key is required", name)
	case z.Events <= 0:
		return fmt.Errorf("fleetlimit: zone %q: events must be > 0", name)
	case z.Window <= 0:
		return fmt.Errorf("fleetlimit: zone %q: window must be > 0", name)
	case z.Burst < 0:
		return fmt.Errorf("fleetlimit: zone %q: burst must be >= 0", name)
	case z.MaxKeys < 0 || z.MaxKeys > ratelimit.MaxKeys:
		return fmt.Errorf("fleetlimit: zone %q: max_keys must be between 0 and %d", name, ratelimit.MaxKeys)
	}
	if _, err := z.limit(); err != nil {
		return fmt.Errorf("fleetlimit: zone %q: %w", name, err)
	}
	return nil
}

func (z *ZoneConfig) limit() (ratelimit.Limit, error) {
	return ratelimit.NewLimit(z.Events, time.Duration(z.Window), z.Burst, z.Precision)
}

// Provision resolves the zones against the shared store's rate-limit engine.
func (h *FleetLimit) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := h.Validate(); err != nil {
		return err
	}
	h.errorBody = h.ErrorBody == nil || *h.ErrorBody
	app, err := appFrom(ctx)
	if err != nil {
		return fmt.Errorf("fleetlimit: %w", err)
	}
	h.engines = app.engines
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("fleetlimit: metrics: %w", err)
	}
	if err := h.resolveZones(); err != nil {
		return err
	}
	if h.events, err = newEmitter(ctx); err != nil {
		return fmt.Errorf("fleetlimit: %w", err)
	}
	// max_keys and conflicting definitions are the config's business: the
	// caps apply when the config starts.
	for _, z := range h.zones {
		def := zoneDef{events: z.limit.Events, window: z.limit.Window, precision: z.limit.Precision}
		if err := app.claimZone(z.name, def, z.zone, h.Zones[z.name].MaxKeys); err != nil {
			return fmt.Errorf("fleetlimit: %w", err)
		}
	}
	return nil
}

// resolveZones binds the configured zones to the engine's and precomputes the
// RateLimit-Policy header and when the headers are sent.
func (h *FleetLimit) resolveZones() error {
	h.headersOnAdmit = h.RateLimitHeaders == "" || h.RateLimitHeaders == "always"
	h.headersOnDeny = h.headersOnAdmit || h.RateLimitHeaders == "denied"
	h.zones = h.zones[:0]
	for name, z := range h.Zones {
		limit, err := z.limit()
		if err != nil {
			return fmt.Errorf("fleetlimit: zone %q: %w", name, err)
		}
		zone := h.engines.limiter.Zone(name, &limit)
		h.zones = append(h.zones, zoneRuntime{
			name:         name,
			quotedName:   strconv.Quote(name),
			key:          compileKey(z.Key),
			limit:        limit,
			zone:         zone,
			allowed:      metrics.fleetDecisions.WithLabelValues(name, "allowed"),
			deniedFleet:  metrics.fleetDecisions.WithLabelValues(name, "denied_fleet"),
			deniedLocal:  metrics.fleetDecisions.WithLabelValues(name, "denied_local"),
			dryRunDenied: metrics.fleetDecisions.WithLabelValues(name, "dry_run_denied"),
		})
	}
	sort.Slice(h.zones, func(i, j int) bool { return h.zones[i].zone.ID() < h.zones[j].zone.ID() })
	policies := make([]string, len(h.zones))
	for i, z := range h.zones {
		policies[i] = policyItem(z.name, z.limit.Events, z.limit.Window)
	}
	h.policy = joinItems(policies)
	return nil
}

// ServeHTTP gates the request on every zone, then calls next. It never waits
// on the store.
func (h *FleetLimit) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if err := h.gate(w, r); err != nil {
		return err
	}
	return next.ServeHTTP(w, r)
}

// gate decides the request: nil admits it (a dry-run denial included), else
// the 429 to return. It returns before next runs, and its frames are small:
// ServeHTTP's frame stays on the stack under every later handler, and when
// room for MaxChecks zones was in it, the handlers outgrew a connection
// goroutine's first stack, each GC shrank it again, and the next request
// copied it once more (runtime.newstack, 0.7% of Caddy's CPU under wrk).
//
//go:noinline
func (h *FleetLimit) gate(w http.ResponseWriter, r *http.Request) error {
	n := len(h.zones)
	if n > 2 {
		return h.gateMany(w, r)
	}
	var c [2]ratelimit.Check // the usual zone or two
	var v [2]ratelimit.Verdict
	return h.decide(w, r, c[:n], v[:n])
}

// gateMany is gate for more than two zones, with room for MaxChecks.
//
//go:noinline
func (h *FleetLimit) gateMany(w http.ResponseWriter, r *http.Request) error {
	var c [ratelimit.MaxChecks]ratelimit.Check
	var v [ratelimit.MaxChecks]ratelimit.Verdict
	n := len(h.zones)
	return h.decide(w, r, c[:n], v[:n])
}

// leaseWait bounds how long a request waits for its key's grant: two
// passes (the one under way may not carry the call), each a round trip
// once the reconciler gets the CPU.
const leaseWait = 200 * time.Millisecond

// decide checks every zone, filling checks and verdicts (one per zone).
func (h *FleetLimit) decide(w http.ResponseWriter, r *http.Request, checks []ratelimit.Check, verdicts []ratelimit.Verdict) error {
	for i := range h.zones {
		z := &h.zones[i]
		checks[i] = ratelimit.Check{Zone: z.zone, Limit: &z.limit, Key: z.key.hash(r)}
	}
	lim := h.engines.limiter
	denied := lim.Allow(time.Now().UnixNano(), checks, verdicts)
	for try := 0; try < 2 && denied >= 0 && verdicts[denied].Leasing; try++ {
		// The key waits for a grant (a key on leases near its limit, whose
		// grants cover the requests that wait; a limit with no floor; an
		// instance with no slot): the reconciler asks for it at once; wait
		// for that pass rather than refuse a request the fleet has room for.
		lim.AwaitPass(leaseWait / 2)
		denied = lim.Allow(time.Now().UnixNano(), checks, verdicts)
	}
	// A dry-run denial is an admitted response.
	if refused := denied >= 0 && !h.DryRun; refused && h.headersOnDeny || !refused && h.headersOnAdmit {
		h.setZoneHeaders(w.Header(), verdicts)
	}
	if denied < 0 {
		for i := range h.zones {
			h.zones[i].allowed.Inc()
		}
		return nil
	}
	return h.deny(w, r, denied, checks[denied].Key, verdicts[denied])
}

// deny answers a request that zone h.zones[denied] refused: nil in dry-run
// mode (it is admitted), else the 429. Its log fields and event data are in
// a frame of its own, off the admitted request's stack.
//
//go:noinline
func (h *FleetLimit) deny(w http.ResponseWriter, r *http.Request, denied int, key keyhash.Hash, v ratelimit.Verdict) error {
	z := &h.zones[denied]
	retry := ceilSeconds(v.RetryAfter)
	if h.events.wants(eventFleetlimitExceeded) {
		h.events.emit(eventFleetlimitExceeded, map[string]any{
			"zone":        z.name,
			"key_hash":    key.String(),
			"fleet":       v.Fleet,
			"retry_after": retry,
			"dry_run":     h.DryRun,
		})
	}
	if h.DryRun {
		z.dryRunDenied.Inc()
		h.logger.Info("dry run: request would be rate limited",
			zap.String("zone", z.name),
			zap.Bool("fleet", v.Fleet),
			zap.Int64("retry_after", retry))
		return nil
	}
	if v.Fleet {
		z.deniedFleet.Inc()
	} else {
		z.deniedLocal.Inc()
	}
	if ce := h.logger.Check(zap.DebugLevel, "request rate limited"); ce != nil {
		ce.Write(zap.String("zone", z.name), zap.String("key_hash", key.String()),
			zap.Bool("fleet", v.Fleet), zap.Int64("retry_after", retry))
	}
	w.Header().Set("Retry-After", strconv.FormatInt(retry, 10))
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	repl.Set("http.fleetlimit.zone", z.name)
	repl.Set("http.fleetlimit.retry_after", retry)
	if h.errorBody && !hasErrorRoutes(r) {
		return writeDenial(w, r, z.name, retry) // (fleetlimit_body.go)
	}
	return caddyhttp.Error(http.StatusTooManyRequests,
		fmt.Errorf("fleetlimit: zone %q: rate limit exceeded, retry after %ds", z.name, retry))
}

// setZoneHeaders sets RateLimit-Policy and RateLimit with an item per
// zone; a denying zone's reset is when a retry can succeed. RateLimit is
// rendered into the values' own allocation (a longer one moves to the heap).
func (h *FleetLimit) setZoneHeaders(hdr http.Header, verdicts []ratelimit.Verdict) {
	v := new(rateLimitValues)
	buf := v.buf[:0]
	for i, vd := range verdicts {
		reset := vd.Reset
		if !vd.Allowed {
			reset = vd.RetryAfter
		}
		buf = appendQuotedRateLimitItem(buf, h.zones[i].quotedName, vd.Remaining, reset)
	}
	// buf is written no more: the string may share its bytes.
	appendRateLimitValues(hdr, &v.vals, h.policy, unsafe.String(unsafe.SliceData(buf), len(buf)))
}
