package fleetguard

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// poolStore puts a store of its own, under id and on a memory store
// whatever id's kind, into the pool for the test.
func poolStore(t *testing.T, id storeIdentity) *engines {
	t.Helper()
	v, _, err := enginePool.LoadOrNew(id, func() (caddy.Destructor, error) {
		return newEngines(id, nil, time.Second, zap.NewNop())
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = enginePool.Delete(id) })
	return v.(*engines)
}

// handlerWith is a handler of budgets provisioned on the memory store of
// prefix, then taken out of the budget registry, which the test drives
// itself as its configs' loads and unloads would.
func handlerWith(t *testing.T, prefix string, budgets ...BudgetConfig) *LLMBudget {
	t.Helper()
	// A team and a price, which team and usd budgets need.
	h := provisionedHandler(t, &LLMBudget{Budgets: budgets, Team: "{http.request.header.X-Team}", Prices: map[string]PriceConfig{"m": {Input: 1, Output: 1}}},
		&App{Prefix: prefix})
	h.unregisterBudgets()
	return h
}

func limitOf(t *testing.T, name string) int64 {
	t.Helper()
	_, b, err := lookupBudget(name)
	if err != nil {
		t.Fatal(err)
	}
	return b.Limit
}

// While a reload overlaps the old config and the new, the newest config's
// definition is the one shown; a new config that fails (and is cleaned up)
// leaves the old one's; handlers of one config that disagree are refused.
func TestBudgetRegistryNewestConfigWins(t *testing.T) {
	hour := caddy.Duration(time.Hour)
	memory := poolStore(t, memoryIdentity("registry-test"))
	old, next := &App{}, &App{}
	hOld := handlerWith(t, "registry-test", BudgetConfig{Unit: "tokens", Name: "reg_b", Limit: 100, Window: hour})
	memory.budgetDefs.add(hOld, old)
	if got := limitOf(t, "reg_b"); got != 100 {
		t.Fatalf("one config: limit %d, want 100", got)
	}

	// A reload that changes the limit, on another store.
	another := poolStore(t, memoryIdentity("registry-test-another"))
	hNew := handlerWith(t, "registry-test-another", BudgetConfig{Unit: "tokens", Name: "reg_b", Limit: 200, Window: hour})
	another.budgetDefs.add(hNew, next)
	if e, b, err := lookupBudget("reg_b"); err != nil || b.Limit != 200 || e != another {
		t.Fatalf("during the reload: %+v on %p, %v; want the new config's 200 on its store", b, e, err)
	}
	// The new config fails to start: it is cleaned up, the old one stays.
	another.budgetDefs.remove(hNew)
	if got := limitOf(t, "reg_b"); got != 100 {
		t.Fatalf("after a failed reload: limit %d, want the running 100", got)
	}
	// A reload that succeeds: the old config is cleaned up after.
	another.budgetDefs.add(hNew, next)
	memory.budgetDefs.remove(hOld)
	if got := limitOf(t, "reg_b"); got != 200 {
		t.Fatalf("after the reload: limit %d, want 200", got)
	}

	// A second handler of the running config with another definition.
	hOther := handlerWith(t, "registry-test-another", BudgetConfig{Name: "reg_b", Scope: "team", Unit: "usd", Limit: 2.5, Window: hour})
	another.budgetDefs.add(hOther, next)
	_, _, err := lookupBudget("reg_b")
	if !errors.Is(err, errBudgetConflict) || !strings.Contains(err.Error(), "scope global, limit 200 tokens per 1h0m0s") ||
		!strings.Contains(err.Error(), "scope team, limit 2.5 usd per 1h0m0s") {
		t.Fatalf("two definitions in one config: %v, want a conflict naming both", err)
	}
	// The same definition twice is no conflict.
	another.budgetDefs.remove(hOther)
	hSame := handlerWith(t, "registry-test-another", BudgetConfig{Unit: "tokens", Name: "reg_b", Limit: 200, Window: hour})
	another.budgetDefs.add(hSame, next)
	if got := limitOf(t, "reg_b"); got != 200 {
		t.Fatalf("one definition twice: limit %d", got)
	}
	another.budgetDefs.remove(hNew)
	another.budgetDefs.remove(hSame)
	if _, _, err := lookupBudget("reg_b"); !errors.Is(err, errUnknownBudget) {
		t.Fatalf("no handler left: %v, want errUnknownBudget", err)
	}
}

// Through a real Caddy: a reload shows the new definition over the same
// counters, a failed reload leaves the running one, a budget dropped by a
// reload is gone, and one name defined two ways in a config is a 409.
func TestAdminBudgetsFollowReloads(t *testing.T) {
	up := newFakeLLM(t)
	port := freePort(t)
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	withLimit := func(limit, extraSite string) string {
		return llmCaddyfile(port, up.URL, "", "budget g {\n limit "+limit+"\n window 1h\n unit tokens\n }") + extraSite
	}
	tc := startCaddy(t, withLimit("1000", ""))
	budgetURL := "http://" + tc.admin + budgetsPath + "g"
	listURL := "http://" + tc.admin + budgetListPath
	// g as the list shows it, with the limit limit.
	listedG := func(limit string) listedBudget {
		return listedBudget{Name: "g", Scope: "global", Unit: "tokens", Limit: json.Number(limit), Window: "1h0m0s", Store: "memory|fleetguard"}
	}
	wantList := func(when string, want ...listedBudget) {
		t.Helper()
		if got := budgetListAt(t, listURL); !slices.Equal(got, want) {
			t.Fatalf("the list %s:\n got %+v\nwant %+v", when, got, want)
		}
	}
	wantList("of the first config", listedG("1000"))
	if resp, body := chat(t, url, chatBody); resp.StatusCode != http.StatusOK {
		t.Fatalf("request: %d %s", resp.StatusCode, body)
	}
	waitSettles()
	if w := budgetWindowAt(t, http.MethodGet, budgetURL); w.Limit != "1000" || w.Used != "100" {
		t.Fatalf("first config: %+v", w)
	}
	reload := func(cfg string) (int, string) { return tc.load("application/json", string(tc.adapt(cfg))) }
	if code, body := reload(withLimit("2000", "")); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	if w := budgetWindowAt(t, http.MethodGet, budgetURL); w.Limit != "2000" || w.Used != "100" {
		t.Fatalf("after the reload: %+v, want the new limit over the same counter", w)
	}
	wantList("after the reload", listedG("2000"))

	// A config that fails to start (its second site's port is taken).
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	blocked := fmt.Sprintf("\n127.0.0.1:%d {\n respond ok\n }", taken.Addr().(*net.TCPAddr).Port)
	if code, _ := reload(withLimit("3000", blocked)); code == http.StatusOK {
		t.Fatal("a config on a taken port must fail to load")
	}
	if w := budgetWindowAt(t, http.MethodGet, budgetURL); w.Limit != "2000" {
		t.Fatalf("after a failed reload: %+v, want the running limit 2000", w)
	}
	wantList("after a failed reload", listedG("2000"))

	// Two sites that define g two ways.
	other := fmt.Sprintf("\n:%d {\n llmbudget {\n team {http.request.header.X-Team}\n budget g {\n scope team\n limit 500\n window 1h\n unit tokens\n }\n }\n respond ok\n }", freePort(t))
	if code, body := reload(withLimit("2000", other)); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	resp, body := get(t, budgetURL)
	if resp.StatusCode != http.StatusConflict || !strings.Contains(body, "scope global, limit 2000 tokens") || !strings.Contains(body, "scope team, limit 500 tokens") {
		t.Fatalf("one budget defined two ways: %d %s, want 409 naming both", resp.StatusCode, body)
	}
	// The list shows both definitions, flagged, in the order of the 409.
	inConflict, perTeam := listedG("2000"), listedG("500")
	inConflict.Conflict, perTeam.Conflict, perTeam.Scope = true, true, "team"
	wantList("with g defined two ways", inConflict, perTeam)

	// A reload without g: it is gone.
	noG := llmCaddyfile(port, up.URL, "", "budget h {\n limit 10\n window 1h\n unit tokens\n }")
	if code, body := reload(noG); code != http.StatusOK {
		t.Fatalf("reload: %d %s", code, body)
	}
	if resp, body := get(t, budgetURL); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("a budget the running config dropped: %d %s, want 404", resp.StatusCode, body)
	}
	h := listedG("10")
	h.Name = "h"
	wantList("after a reload that drops g and adds h", h)
}
