package fleetguard

import (
	"encoding/json"
	"errors"
	"net/http"
	"sort"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI is `admin.api.fleetguard`: GET /fleetguard/status on Caddy's admin
// endpoint shows every store this process uses, whether the fleet view is
// current, and how many keys each zone tracks. It shows no user keys.
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.fleetguard",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

var _ caddy.AdminRouter = AdminAPI{}

// Routes implements caddy.AdminRouter.
func (AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/fleetguard/status", Handler: caddy.AdminHandlerFunc(handleStatus)}}
}

type storeStatus struct {
	// Store is memory, or the Redis address(es), database and prefix.
	Store string `json:"store"`
	// Healthy is false while the reconciler cannot reach the store: fleet
	// limits are then per instance.
	Healthy      bool         `json:"healthy"`
	SyncInterval string       `json:"sync_interval"`
	Zones        []zoneStatus `json:"zones"`
}

type zoneStatus struct {
	Name string `json:"name"`
	// Keys is how many keys the zone tracks fleet-wide on this instance.
	Keys int64 `json:"keys"`
}

func handleStatus(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errors.New("method not allowed; use GET")}
	}
	out := struct {
		Stores []storeStatus `json:"stores"`
	}{Stores: []storeStatus{}}
	engines.Range(func(key, value any) bool {
		e := value.(*engine)
		st := storeStatus{
			Store:        key.(string),
			Healthy:      e.limiter.Healthy(),
			SyncInterval: e.limiter.SyncInterval().String(),
			Zones:        []zoneStatus{},
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
