package fleetguard

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/keyhash"
	"github.com/fleetguard/fleetguard/ratelimit"
)

// storeIdentity tells stores apart: the configs whose stores have equal
// identities share one pool entry (one client, one reconciler), so the
// identity holds everything that changes the connection. It is comparable,
// so it keys the pool itself.
type storeIdentity struct {
	// name is the public part: what the status, the logs and the store label
	// of the metrics show.
	name storeName
	// credentials are the secret part, only compared: a reload that rotates a
	// password gets a new client. They are never shown, not even hashed: a
	// hash of a password is material for offline guessing.
	credentials storeCredentials
}

// storeKind is the kind of store a config names, one per store option.
type storeKind string

const (
	storeMemory   storeKind = "memory"
	storeRedis    storeKind = "redis"    // redis
	storeCluster  storeKind = "cluster"  // redis_cluster
	storeSentinel storeKind = "sentinel" // redis_sentinel
)

// storeName is the public part of a store's identity.
type storeName struct {
	kind storeKind
	// addrs are where the client starts: the server, the cluster's seed
	// nodes or the sentinels; sorted, since their order in the URL does not
	// make another store, and comma-joined, which keeps the identity
	// comparable.
	addrs  string
	master string // the name the sentinels monitor
	db     int
	prefix string
	tls    bool
}

// storeCredentials are the secret part of a store's identity: who the
// client logs in as, to the server and to the sentinels.
type storeCredentials struct {
	user             string
	password         keyhash.Hash
	sentinelUser     string
	sentinelPassword keyhash.Hash
}

// String is the one form in which a store is shown: the store of
// /fleetguard/status, the store label of /metrics and the store field of the
// logs. It is memory|<prefix>, or
// <kind>|[<master name>@]<addresses>|<db>|<prefix>|<tls or plain>.
func (n storeName) String() string {
	if n.kind == storeMemory {
		return string(n.kind) + "|" + n.prefix
	}
	addrs := n.addrs
	if n.master != "" {
		addrs = n.master + "@" + addrs
	}
	transport := "plain"
	if n.tls {
		transport = "tls"
	}
	return fmt.Sprintf("%s|%s|%d|%s|%s", n.kind, addrs, n.db, n.prefix, transport)
}

// String is the public part alone, so that printing an identity (%v in a
// log or an error) cannot show its credentials.
func (id storeIdentity) String() string { return id.name.String() }

// memoryIdentity is the identity of the embedded memory store.
func memoryIdentity(prefix string) storeIdentity {
	return storeIdentity{name: storeName{kind: storeMemory, prefix: prefix}}
}

// redisIdentity is the identity of the store of a redis URL.
func redisIdentity(opts *redis.Options, prefix string) storeIdentity {
	return storeIdentity{
		name:        storeName{kind: storeRedis, addrs: opts.Addr, db: opts.DB, prefix: prefix, tls: opts.TLSConfig != nil},
		credentials: storeCredentials{user: opts.Username, password: keyhash.Of(opts.Password)},
	}
}

// clusterIdentity is the identity of the store of a redis_cluster URL. A
// cluster has database 0 only.
func clusterIdentity(opts *redis.ClusterOptions, prefix string) storeIdentity {
	return storeIdentity{
		name:        storeName{kind: storeCluster, addrs: sortedAddrs(opts.Addrs), prefix: prefix, tls: opts.TLSConfig != nil},
		credentials: storeCredentials{user: opts.Username, password: keyhash.Of(opts.Password)},
	}
}

// sentinelIdentity is the identity of the store of a redis_sentinel URL.
func sentinelIdentity(opts *redis.FailoverOptions, prefix string) storeIdentity {
	return storeIdentity{
		name: storeName{kind: storeSentinel, addrs: sortedAddrs(opts.SentinelAddrs), master: opts.MasterName,
			db: opts.DB, prefix: prefix, tls: opts.TLSConfig != nil},
		credentials: storeCredentials{user: opts.Username, password: keyhash.Of(opts.Password),
			sentinelUser: opts.SentinelUsername, sentinelPassword: keyhash.Of(opts.SentinelPassword)},
	}
}

// sortedAddrs is addrs in one order, comma-joined.
func sortedAddrs(addrs []string) string {
	return strings.Join(slices.Sorted(slices.Values(addrs)), ",")
}

// shutdownFlushTimeout bounds the last push of pending counts when a store
// is destroyed, so a dead Redis cannot hold up a Caddy shutdown.
const shutdownFlushTimeout = 2 * time.Second

// stores holds one store per storeIdentity. Configs acquire it in Provision
// and release it in Cleanup; a reload acquires the same store before the old
// config releases it, so counters survive and no reconciler goroutine leaks.
var stores = caddy.NewUsagePool()

// store is what the configs that name one store share across reloads: the
// client and the two engines on it.
type store struct {
	limiter *ratelimit.Engine
	budgets *budget.Engine
	client  redis.UniversalClient // nil for the embedded memory store
	// identity is the store's key in the pool.
	identity storeIdentity

	// budgetStoreDown makes a budget store outage one log line, not one per
	// request.
	budgetStoreDown atomic.Bool

	// budgetDefs are the budgets of the running configs, for the admin API.
	budgetDefs budgetRegistry

	// settingsOwner is the config whose store-wide settings are in force.
	settingsMu    sync.Mutex
	settingsOwner *App

	// Settles run after the response, at most maxPendingSettles at once (past
	// that a settle runs on its request's goroutine: backpressure, not loss);
	// Destruct waits for them.
	settleSlots chan struct{}
	settles     sync.WaitGroup
	// inFlight counts reservations not settled yet, for requests waiting
	// for room (llmbudget_wait.go).
	inFlight inFlight

	// histories are what recent streamed answers of each model say about
	// their output leases (llmbudget_lease.go).
	histories histories

	// logger is the logger of the config that built the store, for what
	// happens in the background, outside any config.
	logger *zap.Logger
}

// reportPanic logs and counts a panic recovered in background work.
func (e *store) reportPanic(where string, value any, stack []byte) {
	metrics.panics.WithLabelValues(where).Inc()
	e.logger.Error("recovered a panic in fleetguard's background work; Caddy keeps serving",
		zap.String("where", where), zap.Any("panic", value), zap.ByteString("stack", stack))
}

// newStore builds and starts the store of id; connect is nil for the
// embedded memory store. Its logs name the store: it outlives the config
// whose logger it has.
func newStore(id storeIdentity, connect func() redis.UniversalClient, interval time.Duration, logger *zap.Logger) (*store, error) {
	e := &store{identity: id, settleSlots: make(chan struct{}, maxPendingSettles)}
	prefix := id.name.prefix
	logger = logger.With(zap.Stringer("store", id))
	e.logger = logger
	var slots ratelimit.SlotStore = ratelimit.NewMemoryStore()
	var budgetStore budget.Store = budget.NewMemoryStore()
	if connect != nil {
		routeRedisLog()
		e.client = connect()
		slots = ratelimit.NewRedisStore(e.client)
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
		Store:        slots,
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
func (e *store) Destruct() error {
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

// storeFrom returns the store of the config's fleetguard app, loading an
// empty app (embedded memory store) when the config has none.
func storeFrom(ctx caddy.Context) (*store, error) {
	a, err := appFrom(ctx)
	if err != nil {
		return nil, err
	}
	return a.store, nil
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
