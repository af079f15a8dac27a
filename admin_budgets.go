package fleetguard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// budgetsPath starts the admin API's budget endpoints:
//
//	GET    /fleetguard/budgets                               the running budgets
//	GET    /fleetguard/budgets/<name>?<scope>=<value>        the current window
//	POST   /fleetguard/budgets/<name>/reset?<scope>=<value>  zero it
//	PUT    /fleetguard/budgets/<name>/limit?<scope>=<value>  set the value's limit, {"limit": <n>}
//	DELETE /fleetguard/budgets/<name>/limit?<scope>=<value>  restore the config's
//	GET    /fleetguard/budgets/<name>/top?n=<1..100>         who spent most this window
//
// <scope> is the budget's scope: key, team or model (none for a global
// budget). The value is the raw one, exactly as the handler resolves it (for
// the default principal, the whole Authorization header: "Bearer sk-…"), and
// is hashed as on the request path; or, so the raw value need not be sent,
// <scope>_hash=<32 hex digits> gives its hash (the scope_hash of an answer,
// the principal_hash of the handler's logs). Caddy logs every admin
// request's URI, query included: key_hash keeps an API key out of that log.
const budgetsPath = budgetListPath + "/"

// budgetListPath is the budget list's own route, without the slash: a
// subtree route alone (budgetsPath, which answers the list too) would make
// http.ServeMux redirect it.
const budgetListPath = "/fleetguard/budgets"

// adminStoreTimeout bounds the store call of one admin request.
const adminStoreTimeout = 2 * time.Second

// budgetWindow is the answer of the budget endpoints. Limit, Used and
// Remaining are in the budget's unit: an integer for tokens, a decimal number
// of dollars for usd (the store counts micro-dollars).
type budgetWindow struct {
	Budget string `json:"budget"`
	Scope  string `json:"scope"`
	// ScopeHash is the hash of the scope value, as <scope>_hash= takes it,
	// so that a caller who named the value once can name it again without
	// sending it; absent for a global budget, which has no scope value.
	ScopeHash string `json:"scope_hash,omitempty"`
	Unit      string `json:"unit"`
	// Limit is the limit in force for the scope value.
	Limit json.Number `json:"limit"`
	// LimitSource says where Limit comes from: "admin" (set through PUT
	// .../limit, for the whole fleet), "config" (the budget's limit_for)
	// or "budget" (its limit).
	LimitSource string      `json:"limit_source"`
	Used        json.Number `json:"used"`
	// Remaining is Limit − Used, floored at 0 (a settle above its estimate
	// can take Used past the limit).
	Remaining   json.Number `json:"remaining"`
	WindowStart time.Time   `json:"window_start"`
	WindowEnd   time.Time   `json:"window_end"`
}

// listedBudget is one definition in the budget list. Limit is in the
// budget's unit, as in budgetWindow.
type listedBudget struct {
	Name   string      `json:"name"`
	Scope  string      `json:"scope"`
	Unit   string      `json:"unit"`
	Limit  json.Number `json:"limit"`
	Window string      `json:"window"`
	// Store names the store that keeps the budget's counters, as the status
	// does.
	Store string `json:"store"`
	// Conflict is true when handlers of the running config define the name
	// in more than one way: each definition is listed, and the budget's own
	// endpoints answer 409.
	Conflict bool `json:"conflict"`
}

// handleBudgetList lists the budgets the running configs define, sorted by
// name, each with the definition that the budget's own endpoints use.
func handleBudgetList(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		return apiErrorf(http.StatusMethodNotAllowed, "method %s not allowed on %s; use %s", r.Method, r.URL.Path, http.MethodGet)
	}
	if q := r.URL.Query(); len(q) > 0 {
		// Refused, not ignored: the list has no filter, and an answer that
		// looked filtered would mislead.
		return apiErrorf(http.StatusBadRequest, "the budget list takes no query parameter (got %s); one budget's window is GET %s<budget>?<scope>=<value>",
			strings.Join(slices.Sorted(maps.Keys(q)), ", "), budgetsPath)
	}
	out := struct {
		Budgets []listedBudget `json:"budgets"`
	}{Budgets: []listedBudget{}}
	defs := runningDefs()
	for _, name := range slices.Sorted(maps.Keys(defs)) {
		rb, ok := resolveBudget(defs[name])
		if !ok {
			continue
		}
		for _, b := range rb.definitions {
			out.Budgets = append(out.Budgets, listedBudget{
				Name:     b.Name,
				Scope:    b.Scope.String(),
				Unit:     b.Unit.String(),
				Limit:    amountJSON(b.Unit, b.Limit),
				Window:   b.Period(),
				Store:    rb.engines.identity.String(),
				Conflict: rb.conflict(),
			})
		}
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(out)
}

// budgetAction is what a request to one budget's endpoints asks for.
type budgetAction struct {
	method string // the one method the endpoint takes (PUT/DELETE: both)
	name   string // the budget
	kind   string // "" (its window), "reset" or "limit"
}

// parseBudgetPath reads /fleetguard/budgets/<name>[/reset|/limit].
func parseBudgetPath(path string) (budgetAction, bool) {
	rest := strings.TrimPrefix(path, budgetsPath)
	act := budgetAction{method: http.MethodGet, name: rest}
	if name, sub, ok := strings.Cut(rest, "/"); ok {
		act.name, act.kind = name, sub
	}
	switch act.kind {
	case "":
	case "reset":
		act.method = http.MethodPost
	case "limit":
		act.method = http.MethodPut + ", " + http.MethodDelete
	case "top":
	default:
		return act, false
	}
	return act, act.name != ""
}

func (a *AdminAPI) handleBudget(w http.ResponseWriter, r *http.Request) error {
	if r.URL.Path == budgetsPath {
		return handleBudgetList(w, r)
	}
	act, ok := parseBudgetPath(r.URL.Path)
	if !ok {
		return apiErrorf(http.StatusNotFound, "no such endpoint %s: use GET %s<budget>, GET %s<budget>/top, POST %s<budget>/reset or PUT and DELETE %s<budget>/limit", r.URL.Path, budgetsPath, budgetsPath, budgetsPath, budgetsPath)
	}
	if !slices.Contains(strings.Split(act.method, ", "), r.Method) {
		w.Header().Set("Allow", act.method)
		return apiErrorf(http.StatusMethodNotAllowed, "method %s not allowed on %s; use %s", r.Method, r.URL.Path, act.method)
	}
	e, b, err := lookupBudget(act.name)
	switch {
	case errors.Is(err, errUnknownBudget):
		return apiErrorf(http.StatusNotFound, "%v", err)
	case err != nil:
		return apiErrorf(http.StatusConflict, "%v", err)
	}
	if act.kind == "top" {
		return writeTop(w, r, e, &b)
	}
	scope, err := scopeFromQuery(&b, r.URL.Query())
	if err != nil {
		return apiErrorf(http.StatusBadRequest, "%v", err)
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminStoreTimeout)
	defer cancel()
	switch {
	case act.kind == "limit":
		err = a.setLimit(ctx, r, e, &b, scope)
	case act.kind == "reset":
		err = a.resetWindow(ctx, r, e, &b, scope)
	}
	if err != nil {
		return err
	}
	return writeBudgetWindow(ctx, w, e, &b, scope)
}

// resetWindow zeroes the budget's counter for scope in the current window.
func (a *AdminAPI) resetWindow(ctx context.Context, r *http.Request, e *engines, b *budget.Budget, scope budgetScope) error {
	st, err := e.budgets.Reset(ctx, b, scope.id)
	if err != nil {
		return apiErrorf(http.StatusServiceUnavailable, "the budget store is unavailable: %v", err)
	}
	a.logger.Info("budget window reset",
		zap.String("budget", b.Name),
		zap.String("scope", b.Scope.String()),
		zap.String("scope_hash", scope.hash),
		zap.Time("window_start", st.Start),
		zap.Time("window_end", st.End),
		zap.String("remote_addr", r.RemoteAddr))
	return nil
}

// maxLimitBody bounds the body of a PUT of a limit ({"limit": <n>}).
const maxLimitBody = 1 << 10

// setLimit sets (PUT, {"limit": <n>} in the budget's unit) or clears
// (DELETE) the limit of the budget's scope value in the store, where every
// instance's next reserve reads it.
func (a *AdminAPI) setLimit(ctx context.Context, r *http.Request, e *engines, b *budget.Budget, scope budgetScope) error {
	var limit int64
	if r.Method == http.MethodPut {
		var body struct {
			Limit json.Number `json:"limit"`
		}
		dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxLimitBody))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil {
			return apiErrorf(http.StatusBadRequest, `the body is {"limit": <number>} in the budget's unit (%s): %v`, b.Unit, err)
		}
		v, err := body.Limit.Float64()
		if err == nil {
			limit, err = limitIn(b.Unit, v)
		}
		if err != nil {
			return apiErrorf(http.StatusBadRequest, "limit %q: %v", body.Limit, err)
		}
	}
	if err := e.budgets.SetLimit(ctx, b, scope.id, limit); err != nil {
		if b.Scope == budget.Global {
			return apiErrorf(http.StatusBadRequest, "budget %q: %v", b.Name, err)
		}
		return apiErrorf(http.StatusServiceUnavailable, "the budget store is unavailable: %v", err)
	}
	a.logger.Info("budget limit set",
		zap.String("budget", b.Name),
		zap.String("scope", b.Scope.String()),
		zap.String("scope_hash", scope.hash),
		zapAmount("limit", b.Unit, limit), // 0: cleared, the config's holds
		zap.String("remote_addr", r.RemoteAddr))
	return nil
}

// writeBudgetWindow answers the budget's current window for scope, with the
// limit in force and where it comes from.
func writeBudgetWindow(ctx context.Context, w http.ResponseWriter, e *engines, b *budget.Budget, scope budgetScope) error {
	st, err := e.budgets.Standing(ctx, b, scope.id)
	var limit int64
	var from string
	if err == nil {
		limit, from, err = e.budgets.Limit(ctx, b, scope.id)
	}
	if err != nil {
		return apiErrorf(http.StatusServiceUnavailable, "the budget store is unavailable: %v", err)
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(budgetWindow{
		Budget:      b.Name,
		Scope:       b.Scope.String(),
		ScopeHash:   scope.hash,
		Unit:        b.Unit.String(),
		Limit:       amountJSON(b.Unit, limit),
		LimitSource: from,
		Used:        amountJSON(b.Unit, st.Used),
		Remaining:   amountJSON(b.Unit, max(limit-st.Used, 0)),
		WindowStart: st.Start.UTC(),
		WindowEnd:   st.End.UTC(),
	})
}

// budgetScope names one scope value of a budget.
type budgetScope struct {
	// id names the value in the budget's store key (budget.ScopeID).
	id string
	// hash is keyhash.Of(value) as 32 hex digits, the form <scope>_hash=
	// takes; empty for a global budget.
	hash string
}

// scopeFromQuery reads the budget's scope value from the query: the
// parameter named as the scope (raw, hashed here as on the request path) or
// <scope>_hash (the hash). Any other parameter is refused, so that team= on
// a key budget is not silently ignored. Errors never echo a value.
func scopeFromQuery(b *budget.Budget, q url.Values) (budgetScope, error) {
	param := b.Scope.String()
	for name := range q {
		if b.Scope == budget.Global {
			return budgetScope{}, fmt.Errorf("budget %q is global: it takes no query parameter (got %s)", b.Name, name)
		}
		if name != param && name != param+"_hash" {
			return budgetScope{}, fmt.Errorf("budget %q is kept per %s: it takes %s= or %s_hash=, not %s", b.Name, param, param, param, name)
		}
	}
	if b.Scope == budget.Global {
		return budgetScope{id: budget.ScopeID(b, budget.Dims{})}, nil
	}
	raw, hasRaw := q[param]
	hashed, hasHash := q[param+"_hash"]
	var hash string
	switch {
	case hasRaw && hasHash:
		return budgetScope{}, fmt.Errorf("give %s= or %s_hash=, not both", param, param)
	case len(raw) > 1 || len(hashed) > 1:
		return budgetScope{}, fmt.Errorf("give %s once", param)
	case hasHash:
		hash = hashed[0]
	case hasRaw:
		// The hash the request path's budget.ScopeID takes of the value.
		hash = keyhash.Of(raw[0]).String()
	default:
		return budgetScope{}, fmt.Errorf("budget %q is kept per %s: the %s query parameter is required (the value as the handler resolves it, or its hash as %s_hash)", b.Name, param, param, param)
	}
	id, err := budget.HashedScopeID(b.Scope, hash)
	if err != nil {
		return budgetScope{}, fmt.Errorf("%s_hash: %w", param, err)
	}
	return budgetScope{id: id, hash: hash}, nil
}

// amountJSON writes an amount in the budget's unit: tokens as an integer,
// micro-dollars as an exact decimal number of dollars.
func amountJSON(u budget.Unit, v int64) json.Number {
	if u != budget.USD {
		return json.Number(strconv.FormatInt(v, 10))
	}
	sign := ""
	if v < 0 {
		sign, v = "-", -v
	}
	s := fmt.Sprintf("%s%d.%06d", sign, v/budget.MicrosPerUSD, v%budget.MicrosPerUSD)
	return json.Number(strings.TrimSuffix(strings.TrimRight(s, "0"), "."))
}

func apiErrorf(status int, format string, args ...any) error {
	return caddy.APIError{HTTPStatus: status, Err: fmt.Errorf(format, args...)}
}

// budgetTop is the answer of GET .../top: the scope values that spent most
// in the current window, largest first.
type budgetTop struct {
	Budget      string     `json:"budget"`
	Scope       string     `json:"scope"`
	Unit        string     `json:"unit"`
	WindowStart time.Time  `json:"window_start"`
	WindowEnd   time.Time  `json:"window_end"`
	Top         []topEntry `json:"top"`
}

// topEntry is one scope value of a top list.
type topEntry struct {
	// ScopeHash names the value, as <scope>_hash= takes it.
	ScopeHash string `json:"scope_hash"`
	// Value is the raw value where the config names it (limit_for of a team
	// or a model); absent otherwise, and always for a key.
	Value string `json:"value,omitempty"`
	// Used is the value's counter as its last settle left it, in the
	// budget's unit.
	Used json.Number `json:"used"`
}

// defaultTopN is how many spenders GET .../top lists without n.
const defaultTopN = 20

// writeTop answers GET /fleetguard/budgets/<name>/top?n=<n>.
func writeTop(w http.ResponseWriter, r *http.Request, e *engines, b *budget.Budget) error {
	n := defaultTopN
	for name, vals := range r.URL.Query() {
		v, err := strconv.Atoi(vals[0])
		if name != "n" || len(vals) != 1 || err != nil {
			return apiErrorf(http.StatusBadRequest, "the top list takes one parameter, n=<1..%d> (default %d)", budget.MaxTop, defaultTopN)
		}
		n = v
	}
	switch {
	case n < 1 || n > budget.MaxTop:
		return apiErrorf(http.StatusBadRequest, "n=%d: the top list is 1 to %d long", n, budget.MaxTop)
	case b.Scope == budget.Global:
		return apiErrorf(http.StatusBadRequest, "budget %q is global: it has one scope value, whose window is GET %s%s", b.Name, budgetsPath, b.Name)
	}
	ctx, cancel := context.WithTimeout(r.Context(), adminStoreTimeout)
	defer cancel()
	top, st, err := e.budgets.Top(ctx, b, n)
	if err != nil {
		return apiErrorf(http.StatusServiceUnavailable, "the budget store is unavailable: %v", err)
	}
	out := budgetTop{Budget: b.Name, Scope: b.Scope.String(), Unit: b.Unit.String(),
		WindowStart: st.Start.UTC(), WindowEnd: st.End.UTC(), Top: make([]topEntry, len(top))}
	for i, t := range top {
		_, hash, _ := strings.Cut(t.Member, "-")
		out.Top[i] = topEntry{ScopeHash: hash, Value: b.Names[t.Member], Used: amountJSON(b.Unit, t.Used)}
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(out)
}
