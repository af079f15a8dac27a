package fleetguard

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are created once per process and registered into every config's
// registry, so their values survive a reload. No label carries a user key.
var metrics = struct {
	fleetDecisions *prometheus.CounterVec
}{
	fleetDecisions: prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "fleetguard",
		Subsystem: "fleetlimit",
		Name:      "requests_total",
		Help:      "Requests decided by fleetlimit, by zone and decision (allowed, denied; dry-run denials count as denied).",
	}, []string{"zone", "decision"}),
}

func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{metrics.fleetDecisions} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}
