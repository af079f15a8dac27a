package budget

import (
	"context"
	"testing"
	"time"
)

func mustZone(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

// Calendar windows start at local midnight (on Monday, on the 1st) and end
// at the next, across DST changes, leap days and year ends.
func TestCalendarWindowsFollowTheLocalCalendar(t *testing.T) {
	ny := mustZone(t, "America/New_York")
	at := func(y int, m time.Month, d, h, min, s int) time.Time { return time.Date(y, m, d, h, min, s, 0, ny) }
	for _, tt := range []struct {
		name       string
		cal        Calendar
		now        time.Time
		start, end time.Time
	}{
		{"a month across the spring DST change", Month, at(2026, 3, 31, 23, 30, 0), at(2026, 3, 1, 0, 0, 0), at(2026, 4, 1, 0, 0, 0)},
		{"a month across the autumn DST change", Month, at(2026, 11, 1, 0, 0, 0), at(2026, 11, 1, 0, 0, 0), at(2026, 12, 1, 0, 0, 0)},
		{"February of a leap year", Month, at(2028, 2, 29, 12, 0, 0), at(2028, 2, 1, 0, 0, 0), at(2028, 3, 1, 0, 0, 0)},
		{"a leap day", Day, at(2028, 2, 29, 23, 59, 59), at(2028, 2, 29, 0, 0, 0), at(2028, 3, 1, 0, 0, 0)},
		{"the 23-hour day of the spring change", Day, at(2026, 3, 8, 12, 0, 0), at(2026, 3, 8, 0, 0, 0), at(2026, 3, 9, 0, 0, 0)},
		{"the 25-hour day of the autumn change", Day, at(2026, 11, 1, 1, 30, 0), at(2026, 11, 1, 0, 0, 0), at(2026, 11, 2, 0, 0, 0)},
		{"a week from Monday", Week, at(2026, 12, 2, 9, 0, 0), at(2026, 11, 30, 0, 0, 0), at(2026, 12, 7, 0, 0, 0)},
		{"a week across a year end", Week, at(2027, 1, 1, 9, 0, 0), at(2026, 12, 28, 0, 0, 0), at(2027, 1, 4, 0, 0, 0)},
		{"Monday at midnight starts a week", Week, at(2026, 11, 30, 0, 0, 0), at(2026, 11, 30, 0, 0, 0), at(2026, 12, 7, 0, 0, 0)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := Budget{Name: "b", Calendar: tt.cal, Location: ny, Limit: 1}
			if err := b.Validate(); err != nil {
				t.Fatal(err)
			}
			if got := b.WindowStart(tt.now); !got.Equal(tt.start) {
				t.Fatalf("start %v, want %v", got, tt.start)
			}
			if got := b.WindowEnd(tt.now); !got.Equal(tt.end) {
				t.Fatalf("end %v, want %v", got, tt.end)
			}
			i := b.WindowIndex(tt.now)
			if b.WindowIndex(tt.start) != i || b.WindowIndex(tt.end.Add(-time.Nanosecond)) != i || b.WindowIndex(tt.end) != i+1 {
				t.Fatalf("index %d: not the same from start to end, or not the next one after", i)
			}
			if b.KeyTTL() < 2*tt.end.Sub(tt.start) {
				t.Fatalf("counters kept %v, less than two windows of %v", b.KeyTTL(), tt.end.Sub(tt.start))
			}
		})
	}
	// A day budget's denial at 23:59:30 local waits 30 s.
	day := Budget{Name: "d", Calendar: Day, Location: ny, Limit: 1}
	if wait := day.WindowEnd(at(2026, 7, 4, 23, 59, 30)).Sub(at(2026, 7, 4, 23, 59, 30)); wait != 30*time.Second {
		t.Fatalf("at 23:59:30 the day ends in %v, want 30s", wait)
	}
	// Consecutive windows are numbered consecutively: 800 days, 120 weeks,
	// 40 months from 2026, DST changes and a leap year among them.
	for _, c := range []struct {
		cal Calendar
		n   int
	}{{Day, 800}, {Week, 120}, {Month, 40}} {
		b := Budget{Name: "c", Calendar: c.cal, Location: ny, Limit: 1}
		now := at(2026, 1, 1, 0, 0, 0)
		first := b.WindowIndex(now)
		for k := 1; k <= c.n; k++ {
			now = b.WindowEnd(now)
			if got := b.WindowIndex(now); got != first+int64(k) {
				t.Fatalf("%s: window %d after %d is numbered %d, at %v", c.cal, k, first, got, now)
			}
		}
	}
}

// A monthly budget resets when the month begins in its time zone, not in
// UTC: its counter at 23:59 on the last day is not the counter at 00:00 on
// the 1st (05:00 UTC in New York).
func TestAMonthlyBudgetResetsAtLocalMidnight(t *testing.T) {
	ny := mustZone(t, "America/New_York")
	e := NewEngine(NewMemoryStore(), "cal")
	budgets := []Budget{{Name: "monthly", Calendar: Month, Location: ny, Limit: 100, Unit: Tokens}}
	clock := time.Date(2026, 11, 30, 23, 59, 0, 0, ny)
	e.now = func() time.Time { return clock }
	ctx := context.Background()
	if _, d, err := e.Reserve(ctx, budgets, Dims{}, Spend{Tokens: 100}); d != nil || err != nil {
		t.Fatalf("the first reserve: %v %v", d, err)
	}
	if _, d, _ := e.Reserve(ctx, budgets, Dims{}, Spend{Tokens: 1}); d == nil {
		t.Fatal("a spent month admitted more")
	}
	clock = time.Date(2026, 12, 1, 0, 0, 0, 0, ny)
	if _, d, err := e.Reserve(ctx, budgets, Dims{}, Spend{Tokens: 100}); d != nil || err != nil {
		t.Fatalf("the new month (05:00 UTC) refused: %v %v", d, err)
	}
}
