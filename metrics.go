package fleetguard

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fleetguard/fleetguard/budget"
)

// metrics are created once per process and registered into every config's
// registry, so their values survive a reload. No label carries a user key; a
// model label only takes a model named in a price book (else "other").
var metrics = struct {
	fleetDecisions     *prometheus.CounterVec
	reconcilePasses    *prometheus.CounterVec
	reconcileDuration  prometheus.Histogram
	earlySyncs         prometheus.Counter
	storeErrors        *prometheus.CounterVec
	storeState         prometheus.Collector
	llmCharged         *prometheus.CounterVec
	llmChargedUSD      *prometheus.CounterVec
	llmRequests        *prometheus.CounterVec
	llmTokens          *prometheus.CounterVec
	llmCost            *prometheus.CounterVec
	llmSettles         *prometheus.CounterVec
	llmSettleOutcomes  *prometheus.CounterVec
	llmResolved        *prometheus.CounterVec
	llmUsageRatio      prometheus.Histogram
	llmInvalidUsage    prometheus.Counter
	llmOversizedEvents prometheus.Counter
	llmLeaseExtensions *prometheus.CounterVec
	llmTruncations     prometheus.Counter
	llmSwept           prometheus.Counter
	llmSettleWaits     prometheus.Counter
	llmThresholds      *prometheus.CounterVec
	llmKeysDenied      *prometheus.CounterVec
	budgetStandings    prometheus.Collector
	panics             *prometheus.CounterVec
}{
	fleetDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "requests_total",
		Help:      "Requests decided by fleetlimit, by zone and decision: allowed, denied_fleet (the window, the fleet's count), denied_local (the local burst cap), dry_run_denied (would have been denied; admitted by dry_run).",
	}, []string{"zone", "decision"}),
	reconcilePasses: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "reconcile_passes_total",
		Help:      "Reconcile passes that synced keys with the store, by result (ok, error). Errors mean limits are per instance until the store returns.",
	}, []string{"result"}),
	reconcileDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "reconcile_duration_seconds",
		Help:      "How long the store took to sync a reconcile pass (one pipelined round trip for all its keys), failed passes included.",
		Buckets:   []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
	}),
	earlySyncs: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "early_syncs_total",
		Help:      "Early reconcile passes: passes run between intervals for keys queued for a lease call (past three quarters of their floor, a grant to renew, a hot key to mark).",
	}),
	storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Name:      "store_errors_total",
		Help:      "Store operations that failed, by operation: sync (a reconcile pass), reserve, settle, release (a budget reservation), resolve (a background release or settle that gave up: drift).",
	}, []string{"op"}),
	storeState: storeCollector{},
	llmCharged: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "charged_total",
		Help:      "What settled requests were charged, by budget, in the budget's unit (tokens, or micro-dollars for usd budgets: charged_usd_total has them in dollars).",
	}, []string{"budget", "unit"}),
	llmChargedUSD: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "charged_usd_total",
		Help:      "What settled requests were charged, in USD, by usd budget.",
	}, []string{"budget"}),
	llmRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "requests_total",
		Help:      "LLM requests by budget and decision: admitted (counted for every budget of the handler), denied (for the budget that refused), shadow_denied (would have been denied; forwarded by shadow), store_error and fail_open (for every budget of the handler), rejected (a bad or unbudgetable request, refused before any budget: budget is empty).",
	}, []string{"budget", "decision"}),
	llmTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "tokens_total",
		Help:      "Tokens of settled requests whose usage was reported or estimated, by model (as named in the price book, else other) and kind (input, cached_input, output; cached_input is part of input).",
	}, []string{"model", "kind"}),
	llmCost: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "cost_usd_total",
		Help:      "Cost in USD of settled requests whose usage was reported or estimated, by model as named in the price book (unpriced models cost nothing here).",
	}, []string{"model"}),
	llmSettles: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "settles_total",
		Help:      "Reservations settled, by usage_source: reported (upstream usage), estimated, reserved (no usage: the reservation is kept), abandoned (the client left after forwarding: kept) or released.",
	}, []string{"usage_source"}),
	llmSettleOutcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "settle_outcomes_total",
		Help:      "What became of settles and releases: ok (applied), lost (no reservation was found to apply to: its record expired or the store lost its data; nothing was applied), unknown (the store's reply was lost; resolved in the background, see resolved_total), failed (the background gave up: the counters keep the reservation).",
	}, []string{"outcome"}),
	llmResolved: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "resolved_total",
		Help:      "Reserves and settles whose outcome was unknown (the store's reply was lost), resolved in the background by reservation id, by kind and outcome: reserve released (it had run), cancelled (it had not; it charges nothing) or failed; settle applied, applied_before (the failed attempt had applied) or failed (drift remains).",
	}, []string{"kind", "outcome"}),
	llmUsageRatio: prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "usage_ratio",
		Help:      "Reported tokens over reserved tokens per settled request: how close the estimates are (1 = exact; low = max_tokens far above what responses use).",
		Buckets:   []float64{.01, .02, .05, .1, .2, .3, .5, .7, .9, 1, 1.1, 1.5, 2, 5},
	}),
	llmInvalidUsage: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "invalid_usage_total",
		Help:      "Responses whose reported usage no request can have (a negative count, or one past 2^40 tokens or 2^53 micro-dollars): settled as usage unknown, keeping the reservation.",
	}),
	llmOversizedEvents: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "oversized_events_total",
		Help:      "Streamed responses with an event larger than 1 MiB while llmbudget was taking the usage chunk out of the stream: from there on the stream passes unchanged (a usage chunk may reach the client), and it is still metered.",
	}),
	llmLeaseExtensions: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "lease_extensions_total",
		Help:      "Output lease extensions of streamed responses, by outcome: granted, refused (a budget had no room: the stream ends at its lease) or failed (the store did not answer: the stream ends at its lease).",
	}, []string{"outcome"}),
	llmTruncations: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "truncations_total",
		Help:      "Streamed responses ended at their output lease, in the API's own terminal form (finish_reason length, stop_reason max_tokens...), because an extension was refused or failed; the upstream request is cancelled.",
	}),
	llmSwept: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "swept_reservations_total",
		Help:      "Reservations of another instance that fell silent (killed, or cut off from the store) which this instance settled: each to what its stream had been granted, or to its whole hold.",
	}),
	llmSettleWaits: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "settle_waits_total",
		Help:      "Refused requests that waited (up to settle_wait) for requests in flight to settle before their 429 or 402, since those hold more than they will be charged.",
	}),
	llmThresholds: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "threshold_crossings_total",
		Help:      "Thresholds of a budget's alert_at that a scope value reached in a window, by budget and threshold (percent of the limit): counted once for the whole fleet, by the instance whose settle reached it first, which also emits llmbudget_threshold. Sum over instances.",
	}, []string{"budget", "threshold"}),
	llmKeysDenied: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "keys_denied_total",
		Help:      "Keys a key budget denied, each once per window for the whole fleet (counted by the instance whose denial was the first), by budget. Sum over instances; its increase over a window is the number of keys that ran out.",
	}, []string{"budget"}),
	budgetStandings: budgetCollector{},
	panics: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Name:      "panics_total",
		Help:      "Panics recovered in fleetguard's background work, by where (llmbudget settle, reconciler pass, budget resolve...): each is logged with its stack, and Caddy keeps serving.",
	}, []string{"where"}),
}

func registerMetrics(reg *prometheus.Registry) error {
	precreateOnce.Do(precreate)
	if reg == nil {
		return nil
	}
	for _, c := range collectors() {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// precreateOnce creates, at 0, the series whose labels are known before any
// event, so that a dashboard shows 0 rather than "No data" on a fresh
// instance. Series per zone, budget and model are created by the handlers
// that define them.
var precreateOnce sync.Once

func precreate() {
	m := &metrics
	for _, op := range []string{"sync", "reserve", "settle", "release", "resolve"} {
		m.storeErrors.WithLabelValues(op)
	}
	for _, result := range []string{"ok", "error"} {
		m.reconcilePasses.WithLabelValues(result)
	}
	for _, source := range usageSources {
		m.llmSettles.WithLabelValues(source.String())
	}
	for _, outcome := range []string{"ok", "lost", "unknown", "failed"} {
		m.llmSettleOutcomes.WithLabelValues(outcome)
	}
	for _, outcome := range []string{"granted", "refused", "failed"} {
		m.llmLeaseExtensions.WithLabelValues(outcome)
	}
	for kind, outcomes := range map[string][]string{
		"reserve": {"released", "cancelled", "failed"},
		"settle":  {"applied", "applied_before", "failed"},
	} {
		for _, outcome := range outcomes {
			m.llmResolved.WithLabelValues(kind, outcome)
		}
	}
}

// collectors are every fleetguard metric.
func collectors() []prometheus.Collector {
	m := &metrics
	return []prometheus.Collector{m.fleetDecisions, m.reconcilePasses, m.reconcileDuration, m.earlySyncs, m.storeErrors, m.storeState,
		m.llmCharged, m.llmChargedUSD, m.llmRequests, m.llmTokens, m.llmCost, m.llmSettles, m.llmSettleOutcomes, m.llmResolved, m.llmUsageRatio,
		m.llmInvalidUsage, m.llmOversizedEvents, m.llmLeaseExtensions, m.llmTruncations, m.llmSwept, m.llmSettleWaits, m.llmThresholds, m.llmKeysDenied, m.budgetStandings, m.panics}
}

// observePass counts a reconcile pass.
func observePass(took time.Duration, err error) {
	result := "ok"
	if err != nil {
		result = "error"
		metrics.storeErrors.WithLabelValues("sync").Inc()
	}
	metrics.reconcilePasses.WithLabelValues(result).Inc()
	metrics.reconcileDuration.Observe(took.Seconds())
}

// observeResolve counts a background resolution.
func observeResolve(kind, outcome string) {
	metrics.llmResolved.WithLabelValues(kind, outcome).Inc()
	if outcome == "failed" {
		metrics.storeErrors.WithLabelValues("resolve").Inc()
		if kind == "settle" {
			metrics.llmSettleOutcomes.WithLabelValues("failed").Inc()
		}
	}
}

var (
	trackedKeysDesc = prometheus.NewDesc("fleetguard_fleetlimit_tracked_keys",
		"Keys a zone tracks on this instance (bounded by max_keys; keys past it are limited by the local cap alone and not counted here).", []string{"zone"}, nil)
	storeHealthyDesc = prometheus.NewDesc("fleetguard_store_healthy",
		"1 while the store answers, 0 while it does not, by store and component: fleetlimit (the reconciler; 0 means limits are per instance) and llmbudget (the reservation breaker; 0 means budgeted requests get 503 or fail_open).",
		[]string{"store", "component"}, nil)
)

// storeCollector reports the state of every store in the pool when scraped:
// the stores outlive configs, so gauges are read, not kept.
type storeCollector struct{}

func (storeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- trackedKeysDesc
	ch <- storeHealthyDesc
}

func (storeCollector) Collect(ch chan<- prometheus.Metric) {
	// Stores that differ only by credentials share a name (a reload that
	// rotates a password overlaps two); each name is one series, healthy
	// while all of its stores are, since a duplicate fails the scrape.
	type health struct{ fleetlimit, llmbudget bool }
	byName := make(map[string]health)
	keys := make(map[string]int64)
	enginePool.Range(func(_, value any) bool {
		e := value.(*engines)
		name := e.identity.String()
		h, seen := byName[name]
		if !seen {
			h = health{true, true}
		}
		byName[name] = health{h.fleetlimit && e.limiter.Healthy(), h.llmbudget && !e.budgets.Down()}
		for _, z := range e.limiter.Zones() {
			keys[z.Name()] += z.Keys()
		}
		return true
	})
	for name, h := range byName {
		ch <- prometheus.MustNewConstMetric(storeHealthyDesc, prometheus.GaugeValue, boolGauge(h.fleetlimit), name, "fleetlimit")
		ch <- prometheus.MustNewConstMetric(storeHealthyDesc, prometheus.GaugeValue, boolGauge(h.llmbudget), name, "llmbudget")
	}
	for zone, n := range keys {
		ch <- prometheus.MustNewConstMetric(trackedKeysDesc, prometheus.GaugeValue, float64(n), zone)
	}
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// The budgets' own gauges, read from the store when /metrics is scraped
// (the store keeps the fleet's counters; a gauge kept per instance would
// say only what that instance saw). Only scope values whose number the
// config bounds get a series: a global budget's one, and the teams and
// models the config names (limit_for, the price table's exact model
// names). Key scopes get none per key (no label per user key): their
// denied keys are counted in keys_denied_total instead.
var (
	budgetUsedDesc = prometheus.NewDesc("fleetguard_llmbudget_used",
		"What a budget's scope value has used in the current window, fleet-wide, in the budget's unit (tokens, or micro-dollars for usd budgets: used_usd has them in dollars; reservations in flight included), by budget and value: global, or a team or model the config names.",
		[]string{"budget", "value"}, nil)
	budgetLimitDesc = prometheus.NewDesc("fleetguard_llmbudget_limit",
		"The limit in force for a budget's scope value (set through the admin API, limit_for, or the budget's own), in the budget's unit, by budget and value as fleetguard_llmbudget_used.",
		[]string{"budget", "value"}, nil)
	budgetUsedUSDDesc = prometheus.NewDesc("fleetguard_llmbudget_used_usd",
		"fleetguard_llmbudget_used of a usd budget, in USD.",
		[]string{"budget", "value"}, nil)
	budgetLimitUSDDesc = prometheus.NewDesc("fleetguard_llmbudget_limit_usd",
		"fleetguard_llmbudget_limit of a usd budget, in USD.",
		[]string{"budget", "value"}, nil)
)

// scrapeTimeout bounds the store calls of one scrape.
const scrapeTimeout = time.Second

// budgetCollector reports each running budget's used and limit per named
// scope value when scraped.
type budgetCollector struct{}

func (budgetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- budgetUsedDesc
	ch <- budgetLimitDesc
	ch <- budgetUsedUSDDesc
	ch <- budgetLimitUSDDesc
}

func (budgetCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	defs := runningDefs()
	for _, name := range slices.Sorted(maps.Keys(defs)) {
		rb, ok := resolveBudget(defs[name])
		if !ok || rb.conflict() || rb.engines.budgets.Down() {
			continue // a conflict has no one limit; a store down, no answer
		}
		b := rb.definitions[0]
		ids, values := namedValues(&b)
		if len(ids) == 0 {
			continue
		}
		used, limits, err := rb.engines.budgets.Standings(ctx, &b, ids)
		if err != nil {
			continue // left out of this scrape rather than shown as 0
		}
		for i := range ids {
			ch <- prometheus.MustNewConstMetric(budgetUsedDesc, prometheus.GaugeValue, float64(used[i]), b.Name, values[i])
			ch <- prometheus.MustNewConstMetric(budgetLimitDesc, prometheus.GaugeValue, float64(limits[i]), b.Name, values[i])
			if b.Unit == budget.USD {
				ch <- prometheus.MustNewConstMetric(budgetUsedUSDDesc, prometheus.GaugeValue, dollars(used[i]), b.Name, values[i])
				ch <- prometheus.MustNewConstMetric(budgetLimitUSDDesc, prometheus.GaugeValue, dollars(limits[i]), b.Name, values[i])
			}
		}
	}
}

// namedValues are the scope ids and label values of b's series: "global"
// for a global budget, the named teams and models for theirs, none for a
// key budget.
func namedValues(b *budget.Budget) (ids, values []string) {
	if b.Scope == budget.Global {
		return []string{budget.ScopeID(b, budget.Dims{})}, []string{"global"}
	}
	if b.Scope == budget.PerKey {
		return nil, nil
	}
	for _, id := range slices.Sorted(maps.Keys(b.Names)) {
		ids, values = append(ids, id), append(values, b.Names[id])
	}
	return ids, values
}

// dollars is an amount of micro-dollars in dollars, Prometheus's base unit
// for money.
func dollars(micros int64) float64 { return float64(micros) / budget.MicrosPerUSD }
