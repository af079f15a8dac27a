package fleetguard

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are created once per process and registered into every config's
// registry, so their values survive a reload. No label carries a user key.
var metrics = struct {
	fleetDecisions    *prometheus.CounterVec
	reconcilePasses   *prometheus.CounterVec
	earlySyncs        prometheus.Counter
	llmCharged        *prometheus.CounterVec
	llmRequests       *prometheus.CounterVec
	llmSettles        *prometheus.CounterVec
	llmSettleFailures prometheus.Counter
	llmResolved       *prometheus.CounterVec
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
	earlySyncs: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "early_syncs_total",
		Help:      "Early reconcile passes run for keys near their limit or new to this instance (near_limit on).",
	}),
	llmCharged: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "charged_total",
		Help:      "What settled requests were charged, by budget, in the budget's unit (tokens, or micro-dollars for usd budgets).",
	}, []string{"budget", "unit"}),
	llmRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "requests_total",
		Help:      "LLM requests seen by llmbudget, by decision (admitted, denied, rejected, store_error, fail_open).",
	}, []string{"decision"}),
	llmSettles: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "settles_total",
		Help:      "Reservations settled, by usage_source: reported (upstream usage), estimated, reserved (no usage: the reservation is kept) or released.",
	}, []string{"usage_source"}),
	llmSettleFailures: prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "settle_failures_total",
		Help:      "Settles that failed after retries: the counters keep the reservation (drift).",
	}),
	llmResolved: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "llmbudget",
		Name:      "resolved_total",
		Help:      "Reserves and settles whose outcome was unknown (the store's reply was lost), resolved in the background by reservation id, by kind and outcome: reserve released (it had run), cancelled (it had not; it charges nothing) or failed; settle applied, applied_before (the failed attempt had applied) or failed (drift remains).",
	}, []string{"kind", "outcome"}),
}

func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{metrics.fleetDecisions, metrics.reconcilePasses, metrics.earlySyncs, metrics.llmCharged, metrics.llmRequests, metrics.llmSettles, metrics.llmSettleFailures, metrics.llmResolved} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// observePass counts a reconcile pass.
func observePass(err error) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	metrics.reconcilePasses.WithLabelValues(result).Inc()
}
