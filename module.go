// Package fleetguard is the Caddy adapter of fleetguard: the `fleetguard` app
// that owns the shared store, and the HTTP handlers `fleetlimit` (a fleet-wide
// rate limit) and `llmbudget` (hard LLM token and dollar budgets).
//
// The engines live in the ratelimit and budget packages, which know nothing of
// Caddy; this package turns Caddyfile and JSON into their values and their
// decisions into HTTP responses, placeholders, logs and metrics.
//
// docs/architecture.md lays out the packages and their files, walks each
// handler's ServeHTTP in phases, and lists what lives in the store.
package fleetguard

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/ratelimit"
)

func init() {
	caddy.RegisterModule(App{})
}

// DefaultPrefix starts every store key when the config does not say.
const DefaultPrefix = "fleetguard"

// App is the `fleetguard` app: the store that every fleetguard handler of a
// config shares. Without it (no global option) handlers use the embedded
// memory store, which limits a single instance.
type App struct {
	// Redis is a redis:// or rediss:// URL. Empty (and no RedisCluster or
	// RedisSentinel): the embedded memory store. Set at most one of Redis,
	// RedisCluster and RedisSentinel.
	Redis string `json:"redis,omitempty"`
	// RedisCluster is a Redis Cluster in go-redis's URL form:
	// redis://[user:pass@]host:port?addr=host2:port2&addr=host3:port3.
	RedisCluster string `json:"redis_cluster,omitempty"`
	// RedisSentinel is a Redis master found through Redis Sentinel, in
	// go-redis's failover URL form (redis.ParseFailoverURL):
	//
	//	redis://[sentinel_user:sentinel_pass@]sentinel1:26379[/db]?addr=sentinel2:26379&master_name=mymaster[&username=user&password=pass][&db=n]
	//
	// The URL's host and every addr are sentinels; master_name (required) is
	// the name they monitor. The user info authenticates to the sentinels, the
	// username and password parameters to the master. rediss:// turns TLS on
	// for every connection, each verified against the host it dials (the
	// master at the address the sentinels announce). After a failover the
	// client follows the sentinels to the new master. replica_only,
	// route_by_latency and route_randomly are refused: every command writes.
	// Empty: not used.
	RedisSentinel string `json:"redis_sentinel,omitempty"`
	// Prefix starts every store key; fleets sharing a Redis keep apart by it.
	// Default "fleetguard".
	Prefix string `json:"prefix,omitempty"`
	// SyncInterval is the period of the fleet reconciler. Default 250ms.
	SyncInterval caddy.Duration `json:"sync_interval,omitempty"`
	// NearLimit switches the fleet limit's floors: "on" (default) lets each
	// instance slot admit its floor of a key with no store call; "off"
	// admits every request of a shared store (Redis) on leases.
	NearLimit string `json:"near_limit,omitempty"`
	// MaxInstances is the number of numbered instance slots of the fleet
	// limit (1 to 64; default 16): each slot may admit FloorFraction (1/2)
	// × events / max_instances of a key per window with no store call (its
	// floor), and the rest goes by leases the store counts. Set it to the
	// fleet's largest size: below it each floor is smaller than it could be
	// (more store calls); past it the instances without a slot admit on
	// leases only. Every instance of a fleet should say the same: the store
	// keeps the number the held slots were taken under, and an instance
	// that says otherwise takes no slot (every key on leases, and a warning
	// logged) until none is held under it.
	MaxInstances int `json:"max_instances,omitempty"`

	engines  *engines
	acquired bool

	// What this config sets on the shared store, applied in Start (after
	// every app of the config has provisioned) and undone in Stop if the
	// config never took over (a load that failed while starting).
	interval time.Duration
	maxKeys  map[*ratelimit.Zone]int64
	zones    map[string]zoneDef // for refusing one zone defined two ways
	undo     storeSettings
	applied  bool
}

// zoneDef is what identifies a zone's limit in a config.
type zoneDef struct {
	events    int64
	window    time.Duration
	precision int
}

// storeSettings are the store-wide settings a config applies.
type storeSettings struct {
	owner        *App
	interval     time.Duration
	nearLimit    bool
	maxInstances int
	maxKeys      map[*ratelimit.Zone]int64
}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "fleetguard",
		New: func() caddy.Module { return new(App) },
	}
}

var (
	_ caddy.App          = (*App)(nil)
	_ caddy.Provisioner  = (*App)(nil)
	_ caddy.CleanerUpper = (*App)(nil)
)

// Provision acquires the shared store the config names.
func (a *App) Provision(ctx caddy.Context) error {
	if a.Prefix == "" {
		a.Prefix = DefaultPrefix
	}
	if strings.ContainsAny(a.Prefix, "{} \t\n") {
		return fmt.Errorf("fleetguard: prefix %q: must not contain braces or spaces", a.Prefix)
	}
	if a.NearLimit != "" && a.NearLimit != "on" && a.NearLimit != "off" {
		return fmt.Errorf("fleetguard: near_limit %q: want on or off", a.NearLimit)
	}
	if a.MaxInstances < 0 || a.MaxInstances > 64 {
		return fmt.Errorf("fleetguard: max_instances %d: must be between 1 and 64", a.MaxInstances)
	}
	if a.SyncInterval < 0 {
		return fmt.Errorf("fleetguard: sync_interval %s: must not be negative", time.Duration(a.SyncInterval))
	}
	interval := time.Duration(a.SyncInterval)
	if interval == 0 {
		interval = ratelimit.DefaultSyncInterval
	}
	logger := ctx.Logger()

	id, connect, err := a.configuredStore()
	if err != nil {
		return err
	}
	val, _, err := enginePool.LoadOrNew(id, func() (caddy.Destructor, error) {
		return newEngines(id, connect, interval, logger)
	})
	if err != nil {
		return fmt.Errorf("fleetguard: starting the engine: %w", err)
	}
	a.engines = val.(*engines)
	a.acquired = true
	a.interval = interval
	if connect != nil && !a.engines.limiter.Healthy() {
		// The design degrades rather than refusing the config, so this is a
		// warning; but one that says plainly what it means, also under
		// `caddy validate`.
		logger.Warn("fleetguard: the Redis store does not answer; the config is valid and loads, but until Redis answers, fleetlimit limits each instance on its own (not the fleet) and llmbudget answers budgeted requests 503 (or forwards them unbudgeted with fail_open)",
			zap.Stringer("store", id))
	}
	return nil
}

// claimZone records that a handler of this config uses zone name with def;
// one name defined two ways in one config is refused, naming both.
func (a *App) claimZone(name string, def zoneDef, z *ratelimit.Zone, maxKeys int64) error {
	if prev, ok := a.zones[name]; ok && prev != def {
		return fmt.Errorf("zone %q is defined twice in this config: events %d per %s (precision %d) and events %d per %s (precision %d); a zone name is one counter across the fleet",
			name, prev.events, prev.window, prev.precision, def.events, def.window, def.precision)
	}
	if a.zones == nil {
		a.zones, a.maxKeys = make(map[string]zoneDef), make(map[*ratelimit.Zone]int64)
	}
	a.zones[name] = def
	a.maxKeys[z] = maxKeys
	return nil
}

// Start implements caddy.App: the config's store-wide settings (sync
// interval, near-limit mechanisms, zone key caps) take effect now that the
// whole config has provisioned, so a load that fails earlier changes nothing.
func (a *App) Start() error {
	e := a.engines
	e.settingsMu.Lock()
	defer e.settingsMu.Unlock()
	a.undo = storeSettings{owner: e.settingsOwner, interval: e.limiter.SyncInterval(), nearLimit: e.limiter.NearLimit(),
		maxInstances: e.limiter.MaxInstances(), maxKeys: make(map[*ratelimit.Zone]int64, len(a.maxKeys))}
	for z, n := range a.maxKeys {
		a.undo.maxKeys[z] = z.MaxKeys()
		z.SetMaxKeys(n)
	}
	e.limiter.SetSyncInterval(a.interval)
	e.limiter.SetNearLimit(a.NearLimit != "off")
	e.limiter.SetMaxInstances(a.MaxInstances)
	e.settingsOwner, a.applied = a, true
	return nil
}

// Stop implements caddy.App. The store outlives the config (see Cleanup);
// but if this config's settings are still the store's, no newer config took
// over: the load failed after Start (another app did not start), so they are
// undone.
func (a *App) Stop() error {
	e := a.engines
	if e == nil || !a.applied {
		return nil
	}
	e.settingsMu.Lock()
	defer e.settingsMu.Unlock()
	if e.settingsOwner != a {
		return nil
	}
	for z, n := range a.undo.maxKeys {
		z.SetMaxKeys(n)
	}
	e.limiter.SetSyncInterval(a.undo.interval)
	e.limiter.SetNearLimit(a.undo.nearLimit)
	e.limiter.SetMaxInstances(a.undo.maxInstances)
	e.settingsOwner = a.undo.owner
	return nil
}

// Cleanup releases this config's hold on the store; the last holder's
// release stops it.
func (a *App) Cleanup() error {
	if !a.acquired {
		return nil
	}
	a.acquired = false
	_, err := enginePool.Delete(a.engines.identity)
	return err
}

// appFrom returns the config's fleetguard app (an empty one when the config
// has none).
func appFrom(ctx caddy.Context) (*App, error) {
	appIface, err := ctx.App("fleetguard")
	if err != nil {
		return nil, fmt.Errorf("loading the fleetguard app: %w", err)
	}
	return appIface.(*App), nil
}

// Short dial and I/O timeouts: the reconciler runs every few hundred ms, and a
// Redis that answers slower than that is treated as down. The client never
// retries on its own (-1): a re-sent sync step or reserve script whose first
// reply was lost would count twice; where a retry is safe the engines retry.
const (
	redisTimeout    = 500 * time.Millisecond
	redisMaxRetries = -1
	// One dial attempt per connection: go-redis's default (5 with backoff)
	// makes every pass and reserve wait about half a second on a dead Redis.
	redisDialAttempts = 1
)

// limitClient gives a client of any of go-redis's three kinds the settings
// above, whatever its URL says.
func limitClient(dialTimeout, readTimeout, writeTimeout *time.Duration, maxRetries, dialAttempts *int, contextTimeout *bool) {
	*dialTimeout, *readTimeout, *writeTimeout = redisTimeout, redisTimeout, redisTimeout
	*maxRetries, *dialAttempts = redisMaxRetries, redisDialAttempts
	*contextTimeout = true // a reserve waits at most store_timeout
}

// configuredStore validates the store options and returns the identity of
// the store they name and how to connect to it; connect is nil for the
// embedded memory store.
func (a *App) configuredStore() (storeIdentity, func() redis.UniversalClient, error) {
	if set := a.storeFields(); len(set) > 1 {
		both := "both"
		if len(set) > 2 {
			both = "all"
		}
		return storeIdentity{}, nil, fmt.Errorf("fleetguard: %s are %s set; set one of redis, redis_cluster and redis_sentinel", joinNames(set), both)
	}
	switch {
	case a.Redis != "":
		opts, err := parseRedisURL("redis", a.Redis, redis.ParseURL)
		if err != nil {
			return storeIdentity{}, nil, err
		}
		limitClient(&opts.DialTimeout, &opts.ReadTimeout, &opts.WriteTimeout, &opts.MaxRetries, &opts.DialerRetries, &opts.ContextTimeoutEnabled)
		return redisIdentity(opts, a.Prefix), func() redis.UniversalClient { return redis.NewClient(opts) }, nil
	case a.RedisCluster != "":
		opts, err := parseRedisURL("redis_cluster", a.RedisCluster, redis.ParseClusterURL)
		if err != nil {
			return storeIdentity{}, nil, err
		}
		limitClient(&opts.DialTimeout, &opts.ReadTimeout, &opts.WriteTimeout, &opts.MaxRetries, &opts.DialerRetries, &opts.ContextTimeoutEnabled)
		return clusterIdentity(opts, a.Prefix), func() redis.UniversalClient { return redis.NewClusterClient(opts) }, nil
	case a.RedisSentinel != "":
		opts, err := parseRedisURL("redis_sentinel", a.RedisSentinel, parseSentinelURL)
		if err != nil {
			return storeIdentity{}, nil, err
		}
		// The limits apply to the sentinel queries too, which need no retry
		// of their own: a master lookup that fails asks every sentinel at once.
		limitClient(&opts.DialTimeout, &opts.ReadTimeout, &opts.WriteTimeout, &opts.MaxRetries, &opts.DialerRetries, &opts.ContextTimeoutEnabled)
		return sentinelIdentity(opts, a.Prefix), func() redis.UniversalClient { return redis.NewFailoverClient(opts) }, nil
	}
	return memoryIdentity(a.Prefix), nil, nil
}

// storeFields names the store options that are set.
func (a *App) storeFields() []string {
	var set []string
	for _, f := range []struct{ name, value string }{
		{"redis", a.Redis}, {"redis_cluster", a.RedisCluster}, {"redis_sentinel", a.RedisSentinel},
	} {
		if f.value != "" {
			set = append(set, f.name)
		}
	}
	return set
}

// joinNames lists names as "a and b" or "a, b and c".
func joinNames(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// parseRedisURL reads the URL of the store option named option with parse,
// go-redis's parser for its kind of client. Its errors name the option and
// never echo a password.
func parseRedisURL[Options any](option, raw string, parse func(string) (*Options, error)) (*Options, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") || u.Host == "" {
		return nil, fmt.Errorf("fleetguard: %s: %q is not a redis:// or rediss:// URL with a host", option, redactURL(raw))
	}
	opts, err := parse(raw)
	if err != nil {
		return nil, fmt.Errorf("fleetguard: %s: %w", option, err)
	}
	return opts, nil
}

// parseSentinelURL is redis.ParseFailoverURL made strict: a parameter other
// than addr given twice is refused (go-redis would take the last), and so are
// the routing options that send commands to replicas, which fleetguard's
// writes cannot use (NewFailoverClient panics on two of them).
func parseSentinelURL(raw string) (*redis.FailoverOptions, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, err
	}
	for name, values := range u.Query() {
		if name != "addr" && len(values) > 1 {
			return nil, fmt.Errorf("the URL parameter %s is given %d times", name, len(values))
		}
	}
	opts, err := redis.ParseFailoverURL(raw)
	if err != nil {
		return nil, err
	}
	switch {
	case opts.MasterName == "":
		return nil, errors.New("the URL parameter master_name is required (the name the sentinels monitor, as in ?master_name=mymaster)")
	case opts.ReplicaOnly || opts.RouteByLatency || opts.RouteRandomly:
		return nil, errors.New("replica_only, route_by_latency and route_randomly are not supported: every fleetguard command writes, so it goes to the master")
	}
	if opts.TLSConfig != nil {
		// go-redis names the first sentinel's host as the server for every
		// connection; verify each against the host it dials instead.
		opts.TLSConfig.ServerName = ""
	}
	return opts, nil
}

// redactURL shows a store URL in an error without its secrets: the user
// info's password, and the query, which may hold one (a Sentinel URL's
// password parameter).
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		if i := strings.LastIndex(raw, "@"); i >= 0 {
			raw = "…@" + raw[i+1:]
		}
		if i := strings.Index(raw, "?"); i >= 0 {
			raw = raw[:i] + "?…"
		}
		return raw
	}
	if u.RawQuery != "" || u.ForceQuery {
		u.RawQuery, u.ForceQuery = "…", false
	}
	return u.Redacted()
}

var routeRedisLogOnce sync.Once

// routeRedisLog sends go-redis's own messages (one per failed dial, every
// reconcile pass during an outage) to Caddy's log at debug level. The
// reconciler already warns once per outage; stderr lines per pass would
// drown that. go-redis has one logger per process, so this also applies to
// other modules of the same Caddy build that use go-redis.
func routeRedisLog() {
	routeRedisLogOnce.Do(func() {
		redis.SetLogger(redisLogger{})
	})
}

type redisLogger struct{}

func (redisLogger) Printf(_ context.Context, format string, v ...any) {
	caddy.Log().Named("fleetguard.redis").Debug(fmt.Sprintf(format, v...))
}
