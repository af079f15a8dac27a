package fleetguard

import (
	"errors"
	"fmt"
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
	"github.com/fleetguard/fleetguard/internal/safego"
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

// enginePool holds the engines of each store, by storeIdentity. Configs
// acquire them in Provision and release them in Cleanup; a reload acquires
// the same engines before the old config releases them, so counters survive
// and no reconciler goroutine leaks.
var enginePool = caddy.NewUsagePool()

// engines are what the configs that name one store share across reloads:
// the client of the store (the embedded memory store, or Redis: "the budget
// store" of the logs), the rate-limit and budget engines on it, and what the
// handlers keep beside them. (budget.Store and ratelimit.SlotStore are the
// engines' interfaces to the store.)
type engines struct {
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
	// for room (waitForRoom, llmbudget_serve.go).
	inFlight inFlight

	// histories are what recent streamed answers of each model say about
	// their output leases (llmbudget_lease.go), merged with the fleet's
	// on a Redis store (llmbudget_learned.go) until stopLearned closes.
	histories   histories
	stopLearned chan struct{}
	learnedDone sync.WaitGroup

	// logger is the logger of the config that built the store, for what
	// happens in the background, outside any config.
	logger *zap.Logger
}

// reportPanic logs and counts a panic recovered in background work.
func (e *engines) reportPanic(where string, value any, stack []byte) {
	metrics.panics.WithLabelValues(where).Inc()
	e.logger.Error("recovered a panic in fleetguard's background work; Caddy keeps serving",
		zap.String("where", where), zap.Any("panic", value), zap.ByteString("stack", stack))
}

// newEngines builds and starts the engines of the store id names; connect
// is nil for the embedded memory store. Their logs name the store: it
// outlives the config whose logger it has.
func newEngines(id storeIdentity, connect func() redis.UniversalClient, interval time.Duration, logger *zap.Logger) (*engines, error) {
	e := &engines{identity: id, settleSlots: make(chan struct{}, maxPendingSettles)}
	prefix := id.name.prefix
	logger = logger.With(zap.Stringer("store", id))
	e.logger = logger
	var slots ratelimit.SlotStore // none alone: a Solo engine calls no store
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
	e.budgets.OnSweep = func(n int) {
		metrics.llmSwept.Add(float64(n))
		budgetLog.Warn("settled the open reservations of an instance that fell silent (killed, or cut off from the store)", zap.Int("reservations", n))
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
	if e.client != nil {
		e.stopLearned = make(chan struct{})
		e.learnedDone.Go(func() { e.syncLearned(e.stopLearned, shutdownFlushTimeout) })
	}
	return e, nil
}

// Destruct stops the reconciler after a last push and closes the client.
func (e *engines) Destruct() error {
	e.limiter.Close(shutdownFlushTimeout)
	e.waitSettles(settleTimeout)
	if e.stopLearned != nil {
		close(e.stopLearned)
		e.learnedDone.Wait()
	}
	e.budgets.Close(shutdownFlushTimeout)
	if e.client != nil {
		if err := e.client.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
			return err
		}
	}
	return nil
}

// enginesFrom returns the engines of the config's fleetguard app, loading an
// empty app (embedded memory store) when the config has none.
func enginesFrom(ctx caddy.Context) (*engines, error) {
	a, err := appFrom(ctx)
	if err != nil {
		return nil, err
	}
	return a.engines, nil
}

// budgetStoreFailed logs the first failure of an outage.
func (e *engines) budgetStoreFailed(log *zap.Logger, failOpen bool, err error) {
	if e.budgetStoreDown.CompareAndSwap(false, true) {
		msg := "budget store unreachable; denying budgeted requests with 503 until it returns"
		if failOpen {
			msg = "budget store unreachable; admitting budgeted requests unbudgeted (fail_open) until it returns"
		}
		log.Error(msg, zap.Error(err))
	}
}

// budgetStoreOK logs the end of an outage.
func (e *engines) budgetStoreOK(log *zap.Logger) {
	if e.budgetStoreDown.Load() && e.budgetStoreDown.CompareAndSwap(true, false) {
		log.Info("budget store reachable again")
	}
}

// maxPendingSettles bounds the settles running in the background.
const maxPendingSettles = 1024

// settleLater runs settle in the background, or now when too many are
// pending.
func (e *engines) settleLater(settle func()) {
	select {
	case e.settleSlots <- struct{}{}:
	default:
		defer e.inFlight.done()
		defer safego.Recover("llmbudget settle", e.reportPanic)
		settle()
		return
	}
	e.settles.Add(1)
	go func() {
		defer func() { <-e.settleSlots; e.settles.Done() }()
		defer e.inFlight.done()
		defer safego.Recover("llmbudget settle", e.reportPanic)
		settle()
	}()
}

// waitSettles waits at most timeout for the pending settles.
func (e *engines) waitSettles(timeout time.Duration) {
	done := make(chan struct{})
	go func() { e.settles.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(timeout):
	}
}

// inFlight counts a store's reservations not yet settled and tells those
// waiting for room when one settles.
type inFlight struct {
	n       atomic.Int64
	mu      sync.Mutex
	settled chan struct{} // closed, and replaced, at each settle
}

func (f *inFlight) reserved() { f.n.Add(1) }

// done is called once a reservation's settle has run.
func (f *inFlight) done() {
	f.n.Add(-1)
	f.mu.Lock()
	if f.settled != nil {
		close(f.settled)
		f.settled = nil
	}
	f.mu.Unlock()
}

// next is closed at the next settle.
func (f *inFlight) next() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.settled == nil {
		f.settled = make(chan struct{})
	}
	return f.settled
}
