package fleetguard

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

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
	// live is each budget's limit in force: the newest definition's. A
	// handler's budgets read it (budget.Budget.Live), so streams admitted
	// under an older config extend under a reload's limits.
	live map[string]*atomic.Int64
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
		reg.defs, reg.live = make(map[string][]budgetDef), make(map[string]*atomic.Int64)
	}
	seq := registrations.Add(1)
	for i := range h.budgets {
		b := &h.budgets[i]
		if reg.live[b.Name] == nil {
			reg.live[b.Name] = new(atomic.Int64)
		}
		b.Live = reg.live[b.Name]
		reg.defs[b.Name] = append(reg.defs[b.Name], budgetDef{budget: *b, handler: h, config: config, seq: seq})
		reg.setLive(b.Name)
	}
}

// setLive makes the newest definition of name its limit in force.
func (reg *budgetRegistry) setLive(name string) {
	defs := reg.defs[name]
	if len(defs) == 0 {
		return
	}
	newest := slices.MaxFunc(defs, func(a, b budgetDef) int { return cmp.Compare(a.seq, b.seq) })
	reg.live[name].Store(newest.budget.Limit)
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
			reg.setLive(name) // a failed load's definitions leave the running ones in force
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

// placedDef is a definition and the store whose registry holds it.
type placedDef struct {
	budgetDef
	engines *engines
}

// runningDefs copies every definition the stores in the pool hold, by
// budget name, each store's under its lock.
func runningDefs() map[string][]placedDef {
	byName := make(map[string][]placedDef)
	enginePool.Range(func(_, v any) bool {
		e := v.(*engines)
		e.budgetDefs.mu.Lock()
		defer e.budgetDefs.mu.Unlock()
		for name, defs := range e.budgetDefs.defs {
			for _, d := range defs {
				byName[name] = append(byName[name], placedDef{budgetDef: d, engines: e})
			}
		}
		return true
	})
	return byName
}

// runningBudget is what the running configs mean by one budget name: the
// definitions that the newest config defining it gives it, and the store
// of that config, which keeps its counters.
type runningBudget struct {
	engines *engines
	// definitions are distinct, sorted by scope, unit, window and limit. Two
	// or more are a conflict: handlers of one config that define one name
	// differently share its counter under different rules, and the admin
	// API does not pick one.
	definitions []budget.Budget
}

func (rb runningBudget) conflict() bool { return len(rb.definitions) > 1 }

// resolveBudget is what defs, the definitions of one name, mean: those of
// the config of the newest registration (see budgetRegistry). ok is false
// for no definition.
func resolveBudget(defs []placedDef) (rb runningBudget, ok bool) {
	if len(defs) == 0 {
		return runningBudget{}, false
	}
	newest := slices.MaxFunc(defs, func(a, b placedDef) int { return cmp.Compare(a.seq, b.seq) })
	rb.engines = newest.engines
	for _, d := range defs {
		if d.config == newest.config && !slices.ContainsFunc(rb.definitions, func(b budget.Budget) bool { return sameBudget(b, d.budget) }) {
			rb.definitions = append(rb.definitions, d.budget)
		}
	}
	slices.SortFunc(rb.definitions, func(a, b budget.Budget) int {
		return cmp.Or(cmp.Compare(a.Scope, b.Scope), cmp.Compare(a.Unit, b.Unit),
			cmp.Compare(a.Window, b.Window), cmp.Compare(a.Calendar, b.Calendar), cmp.Compare(a.Limit, b.Limit))
	})
	return rb, true
}

// sameBudget reports whether a and b define a budget alike, the limits of
// single values (limit_for) and the alerts included (time zones by name:
// each load makes its own *time.Location).
func sameBudget(a, b budget.Budget) bool {
	return a.Name == b.Name && a.Scope == b.Scope && a.Unit == b.Unit && a.Limit == b.Limit &&
		a.Window == b.Window && a.Calendar == b.Calendar && a.Period() == b.Period() &&
		maps.Equal(a.Fixed, b.Fixed) && slices.Equal(a.AlertAt, b.AlertAt)
}

// lookupBudget finds the running definition of the budget called name, and
// the store that keeps its counters (resolveBudget). errUnknownBudget: no
// running handler defines it; errBudgetConflict: the newest config that
// does defines it in more than one way.
func lookupBudget(name string) (*engines, budget.Budget, error) {
	rb, ok := resolveBudget(runningDefs()[name])
	if !ok {
		return nil, budget.Budget{}, fmt.Errorf("%w: no llmbudget handler of the running config defines budget %q", errUnknownBudget, name)
	}
	if rb.conflict() {
		described := make([]string, len(rb.definitions))
		for i, b := range rb.definitions {
			described[i] = describeBudget(b)
		}
		return nil, budget.Budget{}, fmt.Errorf("%w: budget %q is defined differently by llmbudget handlers of the running config (%s), so they share one counter under different rules; give each definition its own name",
			errBudgetConflict, name, strings.Join(described, " and "))
	}
	return rb.engines, rb.definitions[0], nil
}

var (
	errUnknownBudget  = errors.New("unknown budget")
	errBudgetConflict = errors.New("conflicting budget definitions")
)

// describeBudget is a definition in the words of the config.
func describeBudget(b budget.Budget) string {
	limit := amountJSON(b.Unit, b.Limit).String()
	s := fmt.Sprintf("scope %s, limit %s %s per %s", b.Scope, limit, b.Unit, b.Period())
	if len(b.Fixed) > 0 {
		s += fmt.Sprintf(", %d limit_for", len(b.Fixed))
	}
	if len(b.AlertAt) > 0 {
		s += fmt.Sprintf(", alert_at %v%%", b.AlertAt)
	}
	return s
}

// registerBudgets makes the handler's budgets known to the admin API until
// Cleanup.
func (h *LLMBudget) registerBudgets(ctx caddy.Context) error {
	app, err := appFrom(ctx)
	if err != nil {
		return err
	}
	h.engines.budgetDefs.add(h, app)
	h.registered = true
	return nil
}

// unregisterBudgets undoes registerBudgets; it does nothing if Provision did
// not get that far.
func (h *LLMBudget) unregisterBudgets() {
	if h.registered {
		h.engines.budgetDefs.remove(h)
		h.registered = false
	}
}
