package usage

import (
	"github.com/fleetguard/fleetguard/budget"
)

// usageFields is the union of the usage fields of every supported format, as
// they appear in a JSON response or in the usage object of a stream event.
// The counts are packed (a value each and a bit each in set, not an optInt
// each): every event holds three, zeroed per event.
type usageFields struct {
	count [usageCounts]int64
	// set has a bit per count given as an integer (not absent, not null),
	// and per details object given (see promptDetails).
	set uint16
	// present: the usage object was given (not absent, not null).
	present bool
}

// The counts of a usageFields.
const (
	// OpenAI Chat Completions.
	promptTokens = iota
	completionTokens
	// OpenAI Responses and Anthropic Messages.
	inputTokens
	outputTokens
	// Anthropic prompt caching (cache_creation_input_tokens,
	// cache_read_input_tokens): these add to input_tokens.
	cacheCreation
	cacheRead
	// The cached_tokens of OpenAI's prompt_tokens_details and
	// input_tokens_details; their set bits are the objects' presence.
	promptDetails
	inputDetails
	usageCounts
)

// has reports whether count i was given.
func (u *usageFields) has(i int) bool { return u.set&(1<<i) != 0 }

// reported is count i as the upstream gave it (negative too: budget.SpendOf
// refuses it), or 0 when it was not given.
func (u *usageFields) reported(i int) int64 {
	if u.has(i) {
		return u.count[i]
	}
	return 0
}

// put records count i: v, given when set.
func (u *usageFields) put(i int, v int64, set bool) {
	u.count[i] = v
	u.set = u.set&^(1<<i) | uint16(btoi(set))<<i
}

// usage normalises the fields of format f. OpenAI's cached tokens are part
// of its input count; Anthropic's cache reads and writes come on top of it.
func (u *usageFields) usage(f Format) (budget.Usage, bool) {
	switch {
	case u.has(promptTokens) || u.has(completionTokens):
		out := budget.Usage{InputTokens: u.reported(promptTokens), OutputTokens: u.reported(completionTokens)}
		if u.has(promptDetails) {
			out.CachedInputTokens = u.count[promptDetails]
		}
		return out, true
	case f == Anthropic || u.has(cacheCreation) || u.has(cacheRead):
		if !u.has(inputTokens) && !u.has(outputTokens) && !u.has(cacheRead) && !u.has(cacheCreation) {
			return budget.Usage{}, false
		}
		read := u.reported(cacheRead)
		return budget.Usage{
			InputTokens:       budget.AddCounts(u.reported(inputTokens), u.reported(cacheCreation), read),
			CachedInputTokens: read,
			OutputTokens:      u.reported(outputTokens),
		}, true
	case u.has(inputTokens) || u.has(outputTokens):
		out := budget.Usage{InputTokens: u.reported(inputTokens), OutputTokens: u.reported(outputTokens)}
		if u.has(inputDetails) {
			out.CachedInputTokens = u.count[inputDetails]
		}
		return out, true
	}
	return budget.Usage{}, false
}

// usageFields reads a usage object (or null) nested in d arrays and objects
// into u.
func (s *scanner) usageFields(d int, u *usageFields) (ok bool) {
	*u = usageFields{}
	isObject, ok := s.object(d)
	if !isObject {
		return ok
	}
	u.present = true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return ok
		}
		var field int
		switch string(key) {
		case "prompt_tokens":
			field = promptTokens
		case "completion_tokens":
			field = completionTokens
		case "input_tokens":
			field = inputTokens
		case "output_tokens":
			field = outputTokens
		case "cache_creation_input_tokens":
			field = cacheCreation
		case "cache_read_input_tokens":
			field = cacheRead
		case "prompt_tokens_details", "input_tokens_details":
			present, cached, good := s.cachedDetails(d + 1)
			field = inputDetails
			if key[0] == 'p' {
				field = promptDetails
			}
			u.put(field, cached, present)
			ok = ok && good
			continue
		default:
			s.skip(d + 1)
			continue
		}
		n, good := s.optInt(d + 1)
		u.put(field, n.v, n.set)
		ok = ok && good
	}
}

// cachedDetails reads OpenAI's {prompt,input}_tokens_details: whether it
// is an object, and its cached_tokens.
func (s *scanner) cachedDetails(d int) (present bool, cached int64, ok bool) {
	isObject, ok := s.object(d)
	if !isObject {
		return false, 0, ok
	}
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return true, cached, ok
		}
		if string(key) != "cached_tokens" {
			s.skip(d + 1)
			continue
		}
		n, good := s.optInt(d + 1)
		cached = n.v
		ok = ok && good
	}
}

// FromJSON reads the usage of a non-streaming JSON response of format f
// (Gemini's usageMetadata and Ollama's final counts are recognised by their
// fields). The second result is false when the body reports no usage.
func FromJSON(f Format, body []byte) (budget.Usage, bool) {
	var ev event
	if !readEvent(body, &ev, f, nil, nil) {
		return budget.Usage{}, false
	}
	t := tally{finished: true} // a whole response: its usage is final
	t.add(f, &ev)
	return t.usage, t.complete
}
