package fleetguard

import (
	"encoding/json"
	"errors"
	"net/http"
	"sort"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI is `admin.api.fleetguard`, on Caddy's admin endpoint:
//
//   - GET /fleetguard/status shows every store this process uses, whether
//     the fleet view is current, the errors met since the store started,
//     how many keys each zone tracks and which budgets are defined. It shows
//     no user keys, and no user, password or hash of one.
//   - GET /fleetguard/budgets lists the budgets of the running configs:
//     name, scope, unit, limit, window and store.
//   - GET /fleetguard/budgets/<name>?<scope>=<value> shows a budget's
//     current window for one scope value, and POST
//     /fleetguard/budgets/<name>/reset?<scope>=<value> zeroes it (see
//     admin_budgets.go).
type AdminAPI struct {
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.fleetguard",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

var (
	_ caddy.AdminRouter = (*AdminAPI)(nil)
	_ caddy.Provisioner = (*AdminAPI)(nil)
)

// Provision takes the config's logger, for the log of resets.
func (a *AdminAPI) Provision(ctx caddy.Context) error {
	a.logger = ctx.Logger(a)
	return nil
}

// Routes implements caddy.AdminRouter.
func (a *AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/fleetguard/status", Handler: caddy.AdminHandlerFunc(handleStatus)},
		{Pattern: budgetListPath, Handler: caddy.AdminHandlerFunc(handleBudgetList)},
		{Pattern: budgetsPath, Handler: caddy.AdminHandlerFunc(a.handleBudget)},
	}
}

type storeStatus struct {
	// Store names the store as the store label of the metrics does, without
	// its credentials (storeName.String).
	Store string `json:"store"`
	// Healthy is false while the reconciler cannot reach the store: fleet
	// limits are then per instance.
	Healthy      bool   `json:"healthy"`
	SyncInterval string `json:"sync_interval"`
	// FleetMembers is how many Caddy instances the last heartbeat found
	// live in the fleet, this one included; 0 before the first, and with
	// the embedded memory store.
	FleetMembers int64 `json:"fleet_members"`
	// LastSyncAgeMS is how long ago a reconcile pass last reached the store,
	// in milliseconds; null before the first. The reconciler contacts the
	// store only while some key is active, so it grows on an idle instance.
	LastSyncAgeMS *int64 `json:"last_sync_age_ms"`
	// ReconcileErrors counts the reconcile passes that failed to reach the
	// store since the store started.
	ReconcileErrors uint64 `json:"reconcile_errors"`
	// BudgetStoreErrors counts the budget store calls that failed since the
	// store started (reserves, settle and release attempts, admin reads and
	// resets).
	BudgetStoreErrors uint64 `json:"budget_store_errors"`
	// BudgetStoreDown is true while budgeted requests are answered without
	// asking the store (503, or admitted with fail_open).
	BudgetStoreDown bool         `json:"budget_store_down"`
	Zones           []zoneStatus `json:"zones"`
	// Budgets names the budgets the running llmbudget handlers define here.
	Budgets []string `json:"budgets"`
}

type zoneStatus struct {
	Name string `json:"name"`
	// Keys is how many keys the zone tracks fleet-wide on this instance.
	Keys int64 `json:"keys"`
}

func handleStatus(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errors.New("method not allowed; use GET")}
	}
	out := struct {
		Stores []storeStatus `json:"stores"`
	}{Stores: []storeStatus{}}
	now := time.Now()
	enginePool.Range(func(_, value any) bool {
		e := value.(*engines)
		st := storeStatus{
			Store:             e.identity.String(),
			Healthy:           e.limiter.Healthy(),
			SyncInterval:      e.limiter.SyncInterval().String(),
			FleetMembers:      e.limiter.Members(),
			ReconcileErrors:   e.limiter.SyncErrors(),
			BudgetStoreErrors: e.budgets.StoreErrors(),
			BudgetStoreDown:   e.budgets.Down(),
			Zones:             []zoneStatus{},
			Budgets:           e.budgetDefs.names(),
		}
		if last := e.limiter.LastSync(); !last.IsZero() {
			age := now.Sub(last).Milliseconds()
			st.LastSyncAgeMS = &age
		}
		for _, z := range e.limiter.Zones() {
			st.Zones = append(st.Zones, zoneStatus{Name: z.Name(), Keys: z.Keys()})
		}
		out.Stores = append(out.Stores, st)
		return true
	})
	sort.Slice(out.Stores, func(i, j int) bool { return out.Stores[i].Store < out.Stores[j].Store })
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(out)
}
