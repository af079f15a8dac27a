package fleetguard

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/fleetguard/fleetguard/budget"
)

// bindCounters looks up the handler's requests_total series once, off the
// request path.
func (h *LLMBudget) bindCounters() {
	h.decisions = make([][numDecisions]prometheus.Counter, len(h.budgets))
	h.firstUSD = 0
	for i, b := range h.budgets {
		for d := range numDecisions {
			h.decisions[i][d] = metrics.llmRequests.WithLabelValues(b.Name, decisionNames[d])
		}
		if b.Unit == budget.USD && h.budgets[h.firstUSD].Unit != budget.USD {
			h.firstUSD = i
		}
	}
	h.rejected = metrics.llmRequests.WithLabelValues("", "rejected")
	h.shadowRejected = metrics.llmRequests.WithLabelValues("", "shadow_rejected")
	// The series a dashboard queries, at 0 until the first settle.
	for _, b := range h.budgets {
		metrics.llmCharged.WithLabelValues(b.Name, b.Unit.String())
	}
	for model := range h.Prices {
		metrics.llmCost.WithLabelValues(model)
		for _, kind := range []string{"input", "cached_input", "output"} {
			metrics.llmTokens.WithLabelValues(model, kind)
		}
	}
}

// decision is what llmbudget did with a request, a label of requests_total.
type decision int

const (
	admitted decision = iota
	denied
	shadowDenied
	storeError
	failOpen
	numDecisions
)

var decisionNames = [numDecisions]string{"admitted", "denied", "shadow_denied", "store_error", "fail_open"}

// countAll counts a decision that concerns every budget of the handler.
func (h *LLMBudget) countAll(d decision) {
	for i := range h.decisions {
		h.decisions[i][d].Inc()
	}
}

// budgetIndex is the index of b among the handler's budgets.
func (h *LLMBudget) budgetIndex(b *budget.Budget) int {
	for i := range h.budgets {
		if h.budgets[i].Name == b.Name {
			return i
		}
	}
	return 0
}
