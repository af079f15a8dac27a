package fleetguard

import (
	"strconv"
	"strings"
	"time"
)

// The IETF draft RateLimit headers, shared by fleetlimit (one item per zone)
// and llmbudget (one item per budget):
//
//	RateLimit-Policy: "<name>";q=<quota>;w=<window s>, …
//	RateLimit: "<name>";r=<remaining>;t=<reset s>, …

// policyItem is one item of RateLimit-Policy.
func policyItem(name string, quota int64, window time.Duration) string {
	return strconv.Quote(name) + ";q=" + strconv.FormatInt(quota, 10) + ";w=" + strconv.FormatInt(ceilSeconds(window), 10)
}

// addItems appends list items to header name, after any items another
// handler of the route put there (fleetlimit and llmbudget on one route give
// one list with both).
func addItems(hdr map[string][]string, name, items string) {
	if prev := hdr[name]; len(prev) > 0 && prev[0] != "" {
		items = prev[0] + ", " + items
	}
	hdr[name] = []string{items}
}

// joinItems joins header list items.
func joinItems(items []string) string { return strings.Join(items, ", ") }

// appendRateLimitItem appends one item of RateLimit to buf, separated from a
// previous one.
func appendRateLimitItem(buf []byte, name string, remaining int64, reset time.Duration) []byte {
	if len(buf) > 0 {
		buf = append(buf, ", "...)
	}
	buf = strconv.AppendQuote(buf, name)
	buf = append(buf, ";r="...)
	buf = strconv.AppendInt(buf, max(remaining, 0), 10)
	buf = append(buf, ";t="...)
	return strconv.AppendInt(buf, ceilSeconds(reset), 10)
}

// ceilSeconds rounds a duration up to whole seconds, as Retry-After wants.
func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}
