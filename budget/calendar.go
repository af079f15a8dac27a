package budget

import (
	"fmt"
	"strings"
	"time"
)

// Calendar windows reset when a day, an ISO week (from Monday) or a month
// begins in a time zone, as people budget ("$500 a month"), instead of
// every Window from the Unix epoch. Every instance numbers them alike from
// the zone's calendar, so the index is part of the store key as a fixed
// window's is.
type Calendar uint8

const (
	// Fixed is a fixed window of Budget.Window from the Unix epoch.
	Fixed Calendar = iota
	// Day resets at midnight.
	Day
	// Week resets at midnight on Monday.
	Week
	// Month resets at midnight on the 1st.
	Month
)

func (c Calendar) String() string {
	return [...]string{"fixed", "day", "week", "month"}[c]
}

// ParseCalendar reads day, week or month.
func ParseCalendar(s string) (Calendar, error) {
	switch strings.ToLower(s) {
	case "day":
		return Day, nil
	case "week":
		return Week, nil
	case "month":
		return Month, nil
	}
	return Fixed, fmt.Errorf("calendar window %q: want day, week or month", s)
}

// longest is the longest a calendar window lasts: a day or a week a DST
// change made an hour longer, a month of 31 days.
func (c Calendar) longest() time.Duration {
	switch c {
	case Day:
		return 25 * time.Hour
	case Week:
		return 7*24*time.Hour + time.Hour
	}
	return 31*24*time.Hour + time.Hour
}

// civilDay is the number of days from 1970-01-01 to y-m-d.
func civilDay(y int, m time.Month, d int) int64 {
	return time.Date(y, m, d, 0, 0, 0, 0, time.UTC).Unix() / 86400
}

// calendarIndex numbers the calendar window containing now.
func (b *Budget) calendarIndex(now time.Time) int64 {
	y, m, d := now.In(b.location()).Date()
	switch b.Calendar {
	case Day:
		return civilDay(y, m, d)
	case Week:
		// 1970-01-01 was a Thursday: its week began on Monday, day -3.
		return floorDiv(civilDay(y, m, d)+3, 7)
	}
	return int64(y-1970)*12 + int64(m-1)
}

// calendarStart is when the calendar window containing now began: local
// midnight, found by the calendar, so a DST change does not move it.
func (b *Budget) calendarStart(now time.Time) time.Time {
	loc := b.location()
	y, m, d := now.In(loc).Date()
	switch b.Calendar {
	case Day:
		return time.Date(y, m, d, 0, 0, 0, 0, loc)
	case Week:
		back := (int(time.Date(y, m, d, 12, 0, 0, 0, loc).Weekday()) + 6) % 7 // days since Monday
		return time.Date(y, m, d-back, 0, 0, 0, 0, loc)
	}
	return time.Date(y, m, 1, 0, 0, 0, 0, loc)
}

// calendarEnd is when the calendar window that began at start ends.
func (b *Budget) calendarEnd(start time.Time) time.Time {
	y, m, d := start.Date()
	switch b.Calendar {
	case Day:
		return time.Date(y, m, d+1, 0, 0, 0, 0, start.Location())
	case Week:
		return time.Date(y, m, d+7, 0, 0, 0, 0, start.Location())
	}
	return time.Date(y, m+1, 1, 0, 0, 0, 0, start.Location())
}

func (b *Budget) location() *time.Location {
	if b.Location == nil {
		return time.UTC
	}
	return b.Location
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && a < 0 {
		q--
	}
	return q
}
