// Package fleetguard is the Caddy adapter of fleetguard: the `fleetguard` app
// that owns the shared store, and the HTTP handlers `fleetlimit` (a fleet-wide
// rate limit) and `llmbudget` (hard LLM token and dollar budgets).
//
// The engines live in the ratelimit and budget packages, which know nothing of
// Caddy; this package turns Caddyfile and JSON into their values and their
// decisions into HTTP responses, placeholders, logs and metrics.
package fleetguard

import (
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/internal/safego"
	"github.com/fleetguard/fleetguard/ratelimit"
)

func init() {
	caddy.RegisterModule(App{})
}

// DefaultPrefix starts every store key when the config does not say.
const DefaultPrefix = "fleetguard"

// shutdownFlushTimeout bounds the last push of pending counts when an engine
// is destroyed, so a dead Redis cannot hold up a Caddy shutdown.
const shutdownFlushTimeout = 2 * time.Second

// engines holds one engine per store identity. Configs acquire it in
// Provision and release it in Cleanup; a reload acquires the same engine
// before the old config releases it, so counters survive and no reconciler
// goroutine leaks.
var engines = caddy.NewUsagePool()

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
	// NearLimit switches the fleet limit's near-limit mechanisms: early sync
	// of a key that has spent half its headroom, each instance admitting only
	// its share of a small headroom, and a small first-contact share for a key
	// new to an instance. "on" or "off"; default "on". They matter only on a
	// shared store (Redis).
	NearLimit string `json:"near_limit,omitempty"`

	engine   *engine
	poolKey  string
	acquired bool

	// What this config sets on the shared engine, applied in Start (after
	// every app of the config has provisioned) and undone in Stop if the
	// config never took over (a load that failed while starting).
	interval time.Duration
	maxKeys  map[*ratelimit.Zone]int64
	zones    map[string]zoneDef // for refusing one zone defined two ways
	undo     engineSettings
	applied  bool
}

// zoneDef is what identifies a zone's limit in a config.
type zoneDef struct {
	events    int64
	window    time.Duration
	precision int
}

// engineSettings are the engine-wide settings a config applies.
type engineSettings struct {
	owner     *App
	interval  time.Duration
	nearLimit bool
	maxKeys   map[*ratelimit.Zone]int64
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

// Provision acquires the engine for the configured store.
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
	if a.SyncInterval < 0 {
		return fmt.Errorf("fleetguard: sync_interval %s: must not be negative", time.Duration(a.SyncInterval))
	}
	interval := time.Duration(a.SyncInterval)
	if interval == 0 {
		interval = ratelimit.DefaultSyncInterval
	}
	logger := ctx.Logger()

	key, connect, err := a.store()
	if err != nil {
		return err
	}
	val, _, err := engines.LoadOrNew(key, func() (caddy.Destructor, error) {
		e, err := newEngine(connect, a.Prefix, interval, logger)
		if e != nil {
			e.label = storeLabel(key)
		}
		return e, err
	})
	if err != nil {
		return fmt.Errorf("fleetguard: starting the engine: %w", err)
	}
	a.engine = val.(*engine)
	a.poolKey, a.acquired = key, true
	a.interval = interval
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

// Start implements caddy.App: the config's engine-wide settings (sync
// interval, near-limit mechanisms, zone key caps) take effect now that the
// whole config has provisioned, so a load that fails earlier changes nothing.
func (a *App) Start() error {
	e := a.engine
	e.settingsMu.Lock()
	defer e.settingsMu.Unlock()
	a.undo = engineSettings{owner: e.settingsOwner, interval: e.limiter.SyncInterval(), nearLimit: e.limiter.NearLimit(),
		maxKeys: make(map[*ratelimit.Zone]int64, len(a.maxKeys))}
	for z, n := range a.maxKeys {
		a.undo.maxKeys[z] = z.MaxKeys()
		z.SetMaxKeys(n)
	}
	e.limiter.SetSyncInterval(a.interval)
	e.limiter.SetNearLimit(a.NearLimit != "off")
	e.settingsOwner, a.applied = a, true
	return nil
}

// Stop implements caddy.App. The engine outlives the config (see Cleanup);
// but if this config's settings are still the engine's, no newer config took
// over: the load failed after Start (another app did not start), so they are
// undone.
func (a *App) Stop() error {
	e := a.engine
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
	e.settingsOwner = a.undo.owner
	return nil
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

// store validates the store options and returns the identity the engine is
// shared under (never containing a password) and how to connect; connect is
// nil for the embedded memory store.
func (a *App) store() (string, func() redis.UniversalClient, error) {
	if set := a.storeFields(); len(set) > 1 {
		both := "both"
		if len(set) > 2 {
			both = "all"
		}
		return "", nil, fmt.Errorf("fleetguard: %s are %s set; set one of redis, redis_cluster and redis_sentinel", joinNames(set), both)
	}
	switch {
	case a.Redis != "":
		if err := checkRedisURL("redis", a.Redis); err != nil {
			return "", nil, err
		}
		opts, err := redis.ParseURL(a.Redis)
		if err != nil {
			return "", nil, fmt.Errorf("fleetguard: redis: %w", err)
		}
		opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = redisTimeout, redisTimeout, redisTimeout
		opts.MaxRetries, opts.DialerRetries = redisMaxRetries, redisDialAttempts
		opts.ContextTimeoutEnabled = true // a reserve waits at most store_timeout
		key := fmt.Sprintf("redis|%s|%s|%d|%s|%s", opts.Addr, opts.Username, opts.DB, a.Prefix, connectionSecrets(opts.Password, opts.TLSConfig != nil))
		return key, func() redis.UniversalClient { return redis.NewClient(opts) }, nil
	case a.RedisCluster != "":
		if err := checkRedisURL("redis_cluster", a.RedisCluster); err != nil {
			return "", nil, err
		}
		opts, err := redis.ParseClusterURL(a.RedisCluster)
		if err != nil {
			return "", nil, fmt.Errorf("fleetguard: redis_cluster: %w", err)
		}
		opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = redisTimeout, redisTimeout, redisTimeout
		opts.MaxRetries, opts.DialerRetries = redisMaxRetries, redisDialAttempts
		opts.ContextTimeoutEnabled = true
		addrs := append([]string(nil), opts.Addrs...)
		sort.Strings(addrs)
		key := fmt.Sprintf("cluster|%s|%s|%s|%s", strings.Join(addrs, ","), opts.Username, a.Prefix, connectionSecrets(opts.Password, opts.TLSConfig != nil))
		return key, func() redis.UniversalClient { return redis.NewClusterClient(opts) }, nil
	case a.RedisSentinel != "":
		opts, err := parseSentinelURL(a.RedisSentinel)
		if err != nil {
			return "", nil, err
		}
		// The same settings as the other forms; they apply to the sentinel
		// queries too, which need no retry of their own: a master lookup
		// that fails asks every sentinel at once.
		opts.DialTimeout, opts.ReadTimeout, opts.WriteTimeout = redisTimeout, redisTimeout, redisTimeout
		opts.MaxRetries, opts.DialerRetries = redisMaxRetries, redisDialAttempts
		opts.ContextTimeoutEnabled = true
		addrs := append([]string(nil), opts.SentinelAddrs...)
		sort.Strings(addrs)
		sentinelAuth := opts.SentinelUsername
		if opts.SentinelPassword != "" {
			sentinelAuth += ":" + secretHash(opts.SentinelPassword)
		}
		key := fmt.Sprintf("sentinel|%s@%s|%s|%d|%s|%s|%s", opts.MasterName, strings.Join(addrs, ","), opts.Username, opts.DB, a.Prefix,
			connectionSecrets(opts.Password, opts.TLSConfig != nil), sentinelAuth)
		return key, func() redis.UniversalClient { return redis.NewFailoverClient(opts) }, nil
	}
	return "memory|" + a.Prefix, nil, nil
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

// parseSentinelURL reads redis_sentinel strictly: a parameter other than
// addr given twice is refused (go-redis would take the last), and so are the
// routing options that send commands to replicas, which fleetguard's writes
// cannot use (NewFailoverClient panics on two of them).
func parseSentinelURL(raw string) (*redis.FailoverOptions, error) {
	if err := checkRedisURL("redis_sentinel", raw); err != nil {
		return nil, err
	}
	u, _ := url.Parse(raw) // checkRedisURL parsed it
	for name, values := range u.Query() {
		if name != "addr" && len(values) > 1 {
			return nil, fmt.Errorf("fleetguard: redis_sentinel: the URL parameter %s is given %d times", name, len(values))
		}
	}
	opts, err := redis.ParseFailoverURL(raw)
	if err != nil {
		return nil, fmt.Errorf("fleetguard: redis_sentinel: %w", err)
	}
	switch {
	case opts.MasterName == "":
		return nil, errors.New("fleetguard: redis_sentinel: the URL parameter master_name is required (the name the sentinels monitor, as in ?master_name=mymaster)")
	case opts.ReplicaOnly || opts.RouteByLatency || opts.RouteRandomly:
		return nil, errors.New("fleetguard: redis_sentinel: replica_only, route_by_latency and route_randomly are not supported: every fleetguard command writes, so it goes to the master")
	}
	if opts.TLSConfig != nil {
		// go-redis names the first sentinel's host as the server for every
		// connection; verify each against the host it dials instead.
		opts.TLSConfig.ServerName = ""
	}
	return opts, nil
}

// connectionSecrets is the part of a store's identity that changes the
// connection without naming a server: a reload that rotates the password or
// turns TLS on gets a new client. The password appears only as a hash.
func connectionSecrets(password string, tls bool) string {
	id := "plain"
	if tls {
		id = "tls"
	}
	if password != "" {
		id += ":" + secretHash(password)
	}
	return id
}

// secretHash stands for a password in a store's identity.
func secretHash(password string) string {
	return keyhash.Of(password).String()[:16]
}

// checkRedisURL gives a clear error, naming the field and never echoing a
// password, for what is not a redis:// or rediss:// URL with a host.
func checkRedisURL(field, raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") || u.Host == "" {
		return fmt.Errorf("fleetguard: %s: %q is not a redis:// or rediss:// URL with a host", field, redactURL(raw))
	}
	return nil
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

// Cleanup releases this config's hold on the engine; the last holder's
// release stops it.
func (a *App) Cleanup() error {
	if !a.acquired {
		return nil
	}
	a.acquired = false
	_, err := engines.Delete(a.poolKey)
	return err
}

// engine is what the configs of one store share across reloads.
type engine struct {
	limiter *ratelimit.Engine
	budgets *budget.Engine
	client  redis.UniversalClient // nil for the embedded memory store
	label   string                // the store as metrics name it (no secrets)

	// budgetStoreDown makes a budget store outage one log line, not one per
	// request.
	budgetStoreDown atomic.Bool

	// budgetDefs are the budgets of the running configs, for the admin API.
	budgetDefs budgetRegistry

	// settingsOwner is the config whose engine-wide settings are in force.
	settingsMu    sync.Mutex
	settingsOwner *App

	// Settles run after the response, at most maxPendingSettles at once (past
	// that a settle runs on its request's goroutine: backpressure, not loss);
	// Destruct waits for them.
	settleSlots chan struct{}
	settles     sync.WaitGroup

	// logger is the logger of the config that built the engine, for what
	// happens in the background, outside any config.
	logger *zap.Logger
}

// maxPendingSettles bounds the settles running in the background.
const maxPendingSettles = 1024

// settleLater runs settle in the background, or now when too many are
// pending.
func (e *engine) settleLater(settle func()) {
	select {
	case e.settleSlots <- struct{}{}:
	default:
		defer safego.Recover("llmbudget settle", e.reportPanic)
		settle()
		return
	}
	e.settles.Add(1)
	go func() {
		defer func() { <-e.settleSlots; e.settles.Done() }()
		defer safego.Recover("llmbudget settle", e.reportPanic)
		settle()
	}()
}

// reportPanic logs and counts a panic recovered in background work.
func (e *engine) reportPanic(where string, value any, stack []byte) {
	metrics.panics.WithLabelValues(where).Inc()
	e.logger.Error("recovered a panic in fleetguard's background work; Caddy keeps serving",
		zap.String("where", where), zap.Any("panic", value), zap.ByteString("stack", stack))
}

// waitSettles waits at most timeout for the pending settles.
func (e *engine) waitSettles(timeout time.Duration) {
	done := make(chan struct{})
	go func() { e.settles.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(timeout):
	}
}

// budgetStoreFailed logs the first failure of an outage.
func (e *engine) budgetStoreFailed(log *zap.Logger, failOpen bool, err error) {
	if e.budgetStoreDown.CompareAndSwap(false, true) {
		msg := "budget store unreachable; denying budgeted requests with 503 until it returns"
		if failOpen {
			msg = "budget store unreachable; admitting budgeted requests unbudgeted (fail_open) until it returns"
		}
		log.Error(msg, zap.Error(err))
	}
}

// budgetStoreOK logs the end of an outage.
func (e *engine) budgetStoreOK(log *zap.Logger) {
	if e.budgetStoreDown.Load() && e.budgetStoreDown.CompareAndSwap(true, false) {
		log.Info("budget store reachable again")
	}
}

// newEngine builds and starts an engine; connect is nil for the embedded
// memory store.
func newEngine(connect func() redis.UniversalClient, prefix string, interval time.Duration, logger *zap.Logger) (*engine, error) {
	e := &engine{settleSlots: make(chan struct{}, maxPendingSettles), logger: logger}
	var store ratelimit.SlotStore = ratelimit.NewMemoryStore()
	var budgetStore budget.Store = budget.NewMemoryStore()
	if connect != nil {
		routeRedisLog()
		e.client = connect()
		store = ratelimit.NewRedisStore(e.client)
		budgetStore = budget.NewRedisStore(e.client)
	}
	e.budgets = budget.NewEngine(budgetStore, prefix)
	e.budgets.OnPanic = e.reportPanic
	budgetLog := logger.Named("budgets")
	e.budgets.OnResolve = func(r *budget.Reservation, kind, outcome string) {
		observeResolve(kind, outcome)
		if outcome == "failed" {
			// Drift: the counters keep what the reservation held (a settle)
			// or a charge for a request that was refused (a reserve).
			budgetLog.Error("budget counters drifted: the store did not answer a "+kind+" in time, and it was given up",
				zap.String("reservation", r.ID), zap.Strings("budgets", holdNames(r.Holds)))
		}
	}
	lim, err := ratelimit.NewEngine(ratelimit.Options{
		Store:        store,
		Prefix:       prefix,
		SyncInterval: interval,
		Solo:         connect == nil,
		Logger:       logger.Named("reconciler"),
		OnPass:       observePass,
		OnEarlySync:  metrics.earlySyncs.Inc,
		OnPanic:      e.reportPanic,
	})
	if err != nil {
		return nil, err
	}
	e.limiter = lim
	lim.Start()
	return e, nil
}

// Destruct stops the reconciler after a last push and closes the client.
func (e *engine) Destruct() error {
	e.limiter.Close(shutdownFlushTimeout)
	e.waitSettles(settleTimeout)
	e.budgets.Close(shutdownFlushTimeout)
	if e.client != nil {
		if err := e.client.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
			return err
		}
	}
	return nil
}

// engineFrom returns the engine of the config's fleetguard app, loading an
// empty app (embedded memory store) when the config has none.
func engineFrom(ctx caddy.Context) (*engine, error) {
	a, err := appFrom(ctx)
	if err != nil {
		return nil, err
	}
	return a.engine, nil
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
