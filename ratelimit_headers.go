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
//
// q and r are integers: requests for a zone, tokens for a token budget, and
// micro-dollars for a usd budget (q=5000000 is $5; LLMBudget.RateLimitScopes).

// policyItem is one item of RateLimit-Policy.
func policyItem(name string, quota int64, window time.Duration) string {
	return strconv.Quote(name) + ";q=" + strconv.FormatInt(quota, 10) + ";w=" + strconv.FormatInt(ceilSeconds(window), 10)
}

// appendRateLimitHeaders appends items to RateLimit-Policy and RateLimit, after
// any items another handler of the route put there (fleetlimit and llmbudget
// on one route give one list with both), with one allocation for their two
// values.
func appendRateLimitHeaders(hdr map[string][]string, policy, rateLimit string) {
	appendRateLimitValues(hdr, new([2]string), policy, rateLimit)
}

// appendRateLimitValues is appendRateLimitHeaders with the values stored in vals.
// The policy is the same on every response, yet it is not shared between
// responses: Caddy's header handler rewrites values in place
// (hdr[field][i] = …), which would race on a shared slice. Each slice has
// capacity 1, so a handler appending to one copies it instead of writing over
// the other.
func appendRateLimitValues(hdr map[string][]string, vals *[2]string, policy, rateLimit string) {
	vals[0] = afterItems(hdr["Ratelimit-Policy"], policy)
	vals[1] = afterItems(hdr["Ratelimit"], rateLimit)
	hdr["Ratelimit-Policy"] = vals[0:1:1]
	hdr["Ratelimit"] = vals[1:2:2]
}

// rateLimitValues is one response's two header values with room for the
// bytes of RateLimit's, so that fleetlimit's headers cost one allocation.
type rateLimitValues struct {
	vals [2]string
	buf  [80]byte // one or two zones' items (112 B in all, a size class)
}

// afterItems is items after the list another handler left in prev.
func afterItems(prev []string, items string) string {
	if len(prev) > 0 && prev[0] != "" {
		return prev[0] + ", " + items
	}
	return items
}

// joinItems joins header list items.
func joinItems(items []string) string { return strings.Join(items, ", ") }

// appendRateLimitItem appends one item of RateLimit to buf, separated from a
// previous one.
func appendRateLimitItem(buf []byte, name string, remaining int64, reset time.Duration) []byte {
	if len(buf) > 0 {
		buf = append(buf, ", "...)
	}
	return appendRateLimitCounts(strconv.AppendQuote(buf, name), remaining, reset)
}

// appendQuotedRateLimitItem is appendRateLimitItem with the name already
// quoted (quoting is most of an item's cost: a handler quotes its names once).
func appendQuotedRateLimitItem(buf []byte, quotedName string, remaining int64, reset time.Duration) []byte {
	if len(buf) > 0 {
		buf = append(buf, ", "...)
	}
	return appendRateLimitCounts(append(buf, quotedName...), remaining, reset)
}

// appendRateLimitCounts appends an item's parameters, ;r=<remaining>;t=<reset s>.
func appendRateLimitCounts(buf []byte, remaining int64, reset time.Duration) []byte {
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
