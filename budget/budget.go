package budget

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Unit is what a budget counts.
type Unit uint8

const (
	// Tokens counts input plus output tokens.
	Tokens Unit = iota
	// USD counts cost in integer micro-dollars, priced by the PriceBook.
	USD
)

func (u Unit) String() string {
	if u == USD {
		return "usd"
	}
	return "tokens"
}

// ParseUnit reads "tokens" or "usd".
func ParseUnit(s string) (Unit, error) {
	switch strings.ToLower(s) {
	case "tokens":
		return Tokens, nil
	case "usd":
		return USD, nil
	}
	return 0, fmt.Errorf("unit %q: want tokens or usd", s)
}

// Scope is what a budget is kept per.
type Scope uint8

const (
	// Global is one budget for all traffic.
	Global Scope = iota
	// PerKey is one budget per principal (API key, user).
	PerKey
	// PerModel is one budget per requested model.
	PerModel
	// PerTeam is one budget per team.
	PerTeam
)

func (s Scope) String() string {
	switch s {
	case PerKey:
		return "key"
	case PerModel:
		return "model"
	case PerTeam:
		return "team"
	}
	return "global"
}

// ParseScope reads global, key, model or team.
func ParseScope(s string) (Scope, error) {
	switch strings.ToLower(s) {
	case "global":
		return Global, nil
	case "key":
		return PerKey, nil
	case "model":
		return PerModel, nil
	case "team":
		return PerTeam, nil
	}
	return 0, fmt.Errorf("scope %q: want global, key, model or team", s)
}

// Budget is a ceiling on tokens or dollars per fixed window.
type Budget struct {
	Name   string
	Scope  Scope
	Unit   Unit
	Limit  int64 // tokens, or micro-dollars
	Window time.Duration
	// Calendar, when not Fixed, makes the window a calendar day, week or
	// month in Location (UTC when nil) instead of Window.
	Calendar Calendar
	Location *time.Location
	// Live, when set and above 0, is the limit in force, which a newer
	// definition of the budget (a reload) may have changed since Limit
	// was read: reservations made before it extend under it.
	Live *atomic.Int64
	// Fixed are limits of single scope values known ahead (the config's
	// limit_for), by ScopeID: they win over Limit, and a limit set at run
	// time (Engine.SetLimit) wins over them. Default: none.
	Fixed map[string]int64
	// Names are the raw values of scope values the config names (a team's,
	// a model's; never a key's), by ScopeID, for the admin API to show
	// beside their hashes. Default: none.
	Names map[string]string
	// AlertAt are percentages of the limit (1 to 100, ascending) at which
	// each scope value is reported once per window, fleet-wide (see
	// Reservation.Crossings). Default: none.
	AlertAt []int
}

// configuredLimit is the limit the config gives the scope value scopeID:
// its Fixed limit, else the limit in force; fixed reports a Fixed one.
func (b *Budget) configuredLimit(scopeID string) (limit int64, fixed bool) {
	if n, ok := b.Fixed[scopeID]; ok {
		return n, true
	}
	return b.LimitNow(), false
}

// LimitNow is the limit in force: Live's, else Limit.
func (b *Budget) LimitNow() int64 {
	if b.Live != nil {
		if n := b.Live.Load(); n > 0 {
			return n
		}
	}
	return b.Limit
}

// MicrosPerUSD converts dollars to the integer unit USD budgets count in.
const MicrosPerUSD = 1_000_000

// USDToMicros converts a dollar amount to micro-dollars, rounding to nearest.
func USDToMicros(usd float64) int64 { return int64(math.Round(usd * MicrosPerUSD)) }

// Validate checks a budget; the error names the budget and the field.
func (b *Budget) Validate() error {
	switch {
	case b.Name == "" || strings.ContainsAny(b.Name, "{}: \t\""):
		return fmt.Errorf("budget %q: name must be non-empty without braces, colons, quotes or spaces", b.Name)
	case b.Limit <= 0:
		return fmt.Errorf("budget %q: limit must be > 0", b.Name)
	case !slices.IsSorted(b.AlertAt) || len(slices.Compact(slices.Clone(b.AlertAt))) != len(b.AlertAt):
		return fmt.Errorf("budget %q: alert_at: each percentage once, in ascending order", b.Name)
	case len(b.AlertAt) > 0 && (b.AlertAt[0] < 1 || b.AlertAt[len(b.AlertAt)-1] > 100):
		return fmt.Errorf("budget %q: alert_at: percentages of the limit, 1%% to 100%%", b.Name)
	case b.Calendar != Fixed:
	case b.Window < time.Second:
		return fmt.Errorf("budget %q: window must be at least 1s", b.Name)
	case b.Window%time.Second != 0:
		return fmt.Errorf("budget %q: window must be whole seconds", b.Name)
	}
	return nil
}

// WindowIndex is the index of the window containing now: fixed windows are
// numbered from the Unix epoch, calendar ones by the calendar, so every
// instance agrees on them.
func (b *Budget) WindowIndex(now time.Time) int64 {
	if b.Calendar != Fixed {
		return b.calendarIndex(now)
	}
	return now.Unix() / int64(b.Window/time.Second)
}

// WindowStart is when the window containing now began.
func (b *Budget) WindowStart(now time.Time) time.Time {
	if b.Calendar != Fixed {
		return b.calendarStart(now)
	}
	return time.Unix(b.WindowIndex(now)*int64(b.Window/time.Second), 0)
}

// WindowEnd is when the window containing now ends.
func (b *Budget) WindowEnd(now time.Time) time.Time {
	if b.Calendar != Fixed {
		return b.calendarEnd(b.calendarStart(now))
	}
	return b.WindowStart(now).Add(b.Window)
}

// KeyTTL is how long a counter of the budget is kept: two of its longest
// windows, so a counter outlives its window whatever instance wrote it last.
func (b *Budget) KeyTTL() time.Duration {
	if b.Calendar != Fixed {
		return 2 * b.Calendar.longest()
	}
	return 2 * b.Window
}

// Period says the window as people read it: "1h0m0s", "month
// (America/New_York)".
func (b *Budget) Period() string {
	if b.Calendar != Fixed {
		return fmt.Sprintf("%s (%s)", b.Calendar, b.location())
	}
	return b.Window.String()
}

// NominalWindow is the window's usual length, for a RateLimit-Policy's w:
// a calendar month counts 30 days.
func (b *Budget) NominalWindow() time.Duration {
	switch b.Calendar {
	case Day:
		return 24 * time.Hour
	case Week:
		return 7 * 24 * time.Hour
	case Month:
		return 30 * 24 * time.Hour
	}
	return b.Window
}

// Amount is what spend costs in this budget's unit.
func (b *Budget) Amount(s Spend) int64 {
	if b.Unit == USD {
		return s.CostMicros
	}
	return s.Tokens
}

// Spend is an amount in both units, so each budget charges the one it counts.
type Spend struct {
	Tokens     int64
	CostMicros int64
}
