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

	"github.com/fleetguard/fleetguard/budget"
)

// budgetRegistry is what the admin API knows of the budgets defined by the
// llmbudget handlers of the running configs on one store. A handler adds its
// budgets in Provision and removes them in Cleanup. A reload provisions the
// new config before it cleans up the old one, so for a while both are there:
// the newest registration's config is the one whose definition counts.
type budgetRegistry struct {
	mu   sync.Mutex
	defs map[string][]budgetDef // by budget name
}

// budgetDef is one handler's definition of one budget.
type budgetDef struct {
	budget  budget.Budget
	handler *LLMBudget
	config  *App   // identifies the handler's config
	seq     uint64 // registration order across stores: higher is newer
}

// registrations numbers registrations in the order they happen.
var registrations atomic.Uint64

func (reg *budgetRegistry) add(h *LLMBudget, config *App) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	if reg.defs == nil {
		reg.defs = make(map[string][]budgetDef)
	}
	seq := registrations.Add(1)
	for _, b := range h.budgets {
		reg.defs[b.Name] = append(reg.defs[b.Name], budgetDef{budget: b, handler: h, config: config, seq: seq})
	}
}

func (reg *budgetRegistry) remove(h *LLMBudget) {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	for name, defs := range reg.defs {
		defs = slices.DeleteFunc(defs, func(d budgetDef) bool { return d.handler == h })
		if len(defs) == 0 {
			delete(reg.defs, name)
		} else {
			reg.defs[name] = defs
		}
	}
}

// names lists the budgets defined on the store, sorted.
func (reg *budgetRegistry) names() []string {
	reg.mu.Lock()
	defer reg.mu.Unlock()
	names := make([]string, 0, len(reg.defs))
	for name := range reg.defs {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// lookupBudget finds the running definition of the budget called name, and
// the store that keeps its counters: the definition of the newest config
// that defines it. Two handlers of that config that define it differently
// share one counter under two limits; the admin API does not pick one, and
// says so (errBudgetConflict). errUnknownBudget: no running handler defines it.
func lookupBudget(name string) (*store, budget.Budget, error) {
	var newest *budgetDef
	var newestStore *store
	var candidates []budgetDef // the defs of one store, copied under its lock
	stores.Range(func(_, v any) bool {
		e := v.(*store)
		e.budgetDefs.mu.Lock()
		defs := slices.Clone(e.budgetDefs.defs[name])
		e.budgetDefs.mu.Unlock()
		for i := range defs {
			if newest == nil || defs[i].seq > newest.seq {
				newest, newestStore, candidates = &defs[i], e, defs
			}
		}
		return true
	})
	if newest == nil {
		return nil, budget.Budget{}, fmt.Errorf("%w: no llmbudget handler of the running config defines budget %q", errUnknownBudget, name)
	}
	var differ []string
	for _, d := range candidates {
		if d.config == newest.config && d.budget != newest.budget {
			differ = append(differ, describeBudget(d.budget))
		}
	}
	if len(differ) > 0 {
		return nil, budget.Budget{}, fmt.Errorf("%w: budget %q is defined differently by llmbudget handlers of the running config (%s and %s), so they share one counter under different rules; give each definition its own name",
			errBudgetConflict, name, describeBudget(newest.budget), strings.Join(differ, " and "))
	}
	return newestStore, newest.budget, nil
}

var (
	errUnknownBudget  = errors.New("unknown budget")
	errBudgetConflict = errors.New("conflicting budget definitions")
)

// describeBudget is a definition in the words of the config.
func describeBudget(b budget.Budget) string {
	limit := amountJSON(b.Unit, b.Limit).String()
	return fmt.Sprintf("scope %s, limit %s %s per %s", b.Scope, limit, b.Unit, time.Duration(b.Window))
}

// registerBudgets makes the handler's budgets known to the admin API until
// Cleanup.
func (h *LLMBudget) registerBudgets(ctx caddy.Context) error {
	app, err := appFrom(ctx)
	if err != nil {
		return err
	}
	h.store.budgetDefs.add(h, app)
	h.registered = true
	return nil
}

// unregisterBudgets undoes registerBudgets; it does nothing if Provision did
// not get that far.
func (h *LLMBudget) unregisterBudgets() {
	if h.registered {
		h.store.budgetDefs.remove(h)
		h.registered = false
	}
}
