package fleetguard

import (
	"context"
	"maps"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/fleetguard/fleetguard/budget"
)

// The budgets' own gauges, read from the store when /metrics is scraped
// (the store keeps the fleet's counters; a gauge kept per instance would
// say only what that instance saw). Only scope values whose number the
// config bounds get a series: a global budget's one, and the teams and
// models the config names (limit_for, the price table's exact model
// names). Key scopes get none per key (no label per user key): their
// denied keys are counted in keys_denied_total instead.
var (
	budgetUsedDesc = prometheus.NewDesc("fleetguard_llmbudget_used",
		"What a budget's scope value has used in the current window, fleet-wide, in the budget's unit (tokens, or micro-dollars for usd budgets; reservations in flight included), by budget and value: global, or a team or model the config names.",
		[]string{"budget", "value"}, nil)
	budgetLimitDesc = prometheus.NewDesc("fleetguard_llmbudget_limit",
		"The limit in force for a budget's scope value (set through the admin API, limit_for, or the budget's own), in the budget's unit, by budget and value as fleetguard_llmbudget_used.",
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
}

func (budgetCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), scrapeTimeout)
	defer cancel()
	defs := runningDefs()
	for _, name := range slices.Sorted(maps.Keys(defs)) {
		rb, ok := resolveBudget(defs[name])
		if !ok || rb.conflict() || rb.store.budgets.Down() {
			continue // a conflict has no one limit; a store down, no answer
		}
		b := rb.definitions[0]
		ids, values := namedValues(&b)
		if len(ids) == 0 {
			continue
		}
		used, limits, err := rb.store.budgets.Standings(ctx, &b, ids)
		if err != nil {
			continue // left out of this scrape rather than shown as 0
		}
		for i := range ids {
			ch <- prometheus.MustNewConstMetric(budgetUsedDesc, prometheus.GaugeValue, float64(used[i]), b.Name, values[i])
			ch <- prometheus.MustNewConstMetric(budgetLimitDesc, prometheus.GaugeValue, float64(limits[i]), b.Name, values[i])
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

// deniedNotes bounds the store calls in flight that note denied keys: past
// it, a denial goes unnoted (keys_denied_total counts a little low) rather
// than pile up calls while the store is slow.
var deniedNotes = make(chan struct{}, 16)

// noteDeniedKey counts, off the request path, a key that a key budget
// denied for the first time in its window, fleet-wide: the store says
// which instance's denial was the first.
func (h *LLMBudget) noteDeniedKey(d *budget.Denial, dims budget.Dims) {
	if d.Budget.Scope != budget.PerKey {
		return
	}
	select {
	case deniedNotes <- struct{}{}:
	default:
		return
	}
	b, id, eng := d.Budget, budget.ScopeID(d.Budget, dims), h.store.budgets
	go func() {
		defer func() { <-deniedNotes }()
		ctx, cancel := context.WithTimeout(context.Background(), settleTimeout)
		defer cancel()
		if first, err := eng.NoteDenied(ctx, b, id); err == nil && first {
			metrics.llmKeysDenied.WithLabelValues(b.Name).Inc()
		}
	}()
}
