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
	// input_tokens_details, and the reasoning_tokens of its
	// completion_tokens_details and output_tokens_details; their set bits
	// are the objects' presence.
	promptDetails
	inputDetails
	completionDetails
	outputDetails
	// The audio_tokens of prompt_tokens_details and
	// completion_tokens_details (set with their objects).
	promptAudio
	completionAudio
	// Anthropic's cache_creation breakdown (its set bit is the object's
	// presence): ephemeral_5m_input_tokens, ephemeral_1h_input_tokens.
	cacheWrite5m
	cacheWrite1h
	// Anthropic's server_tool_use.web_search_requests (its set bit is the
	// object's presence).
	webSearch
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

// usage normalises the fields of format f. OpenAI's cached and audio
// tokens are part of its input count, its reasoning and audio tokens part
// of its output count; Anthropic's cache reads and writes come on top of
// its input count, and its cache writes last an hour as its cache_creation
// breakdown says (all 5 minutes without it).
func (u *usageFields) usage(f Format) (budget.Usage, bool) {
	switch {
	case u.has(promptTokens) || u.has(completionTokens):
		return budget.Usage{
			InputTokens:       u.reported(promptTokens),
			CachedInputTokens: u.count[promptDetails],
			AudioInputTokens:  u.count[promptAudio],
			OutputTokens:      u.reported(completionTokens),
			ReasoningTokens:   u.count[completionDetails],
			AudioOutputTokens: u.count[completionAudio],
		}, true
	case f == Anthropic || u.has(cacheCreation) || u.has(cacheRead):
		if !u.has(inputTokens) && !u.has(outputTokens) && !u.has(cacheRead) && !u.has(cacheCreation) {
			return budget.Usage{}, false
		}
		read, writes := u.reported(cacheRead), u.reported(cacheCreation)
		if !u.has(cacheCreation) {
			writes = budget.AddCounts(u.count[cacheWrite5m], u.count[cacheWrite1h])
		}
		hour := min(max(u.count[cacheWrite1h], 0), max(writes, 0))
		return budget.Usage{
			InputTokens:        budget.AddCounts(u.reported(inputTokens), writes, read),
			CachedInputTokens:  read,
			CacheWriteTokens:   max(writes, 0) - hour,
			CacheWrite1hTokens: hour,
			OutputTokens:       u.reported(outputTokens),
			WebSearchCalls:     u.count[webSearch],
		}, true
	case u.has(inputTokens) || u.has(outputTokens):
		return budget.Usage{
			InputTokens:       u.reported(inputTokens),
			CachedInputTokens: u.count[inputDetails],
			OutputTokens:      u.reported(outputTokens),
			ReasoningTokens:   u.count[outputDetails],
		}, true
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
		if field := countField(key); field >= 0 {
			n, good := s.optInt(d + 1)
			u.put(field, n.v, n.set)
			ok = ok && good
			continue
		}
		ok = s.usageDetails(d, key, u) && ok
	}
}

// countField is the usage field a count named key is, or -1.
func countField(key []byte) int {
	switch string(key) {
	case "prompt_tokens":
		return promptTokens
	case "completion_tokens":
		return completionTokens
	case "input_tokens":
		return inputTokens
	case "output_tokens":
		return outputTokens
	case "cache_creation_input_tokens":
		return cacheCreation
	case "cache_read_input_tokens":
		return cacheRead
	}
	return -1
}

// usageDetails reads the member key of usage at depth d+1 that is not a
// count: an object of counts nested in it, or anything else, skipped.
func (s *scanner) usageDetails(d int, key []byte, u *usageFields) (ok bool) {
	switch string(key) {
	case "prompt_tokens_details", "input_tokens_details", "completion_tokens_details", "output_tokens_details":
		// OpenAI: cached_tokens of the input's, reasoning_tokens of the
		// output's; audio_tokens of Chat Completions' both.
		field, second := inputDetails, -1
		first := "cached_tokens"
		switch string(key) {
		case "prompt_tokens_details":
			field, second = promptDetails, promptAudio
		case "completion_tokens_details":
			field, first, second = completionDetails, "reasoning_tokens", completionAudio
		case "output_tokens_details":
			field, first = outputDetails, "reasoning_tokens"
		}
		secondName := "audio_tokens"
		if second < 0 {
			secondName = ""
		}
		present, a, b, good := s.details(d+1, first, secondName)
		u.put(field, a, present)
		if second >= 0 {
			u.put(second, b, present)
		}
		return good
	case "cache_creation":
		present, m5, h1, good := s.details(d+1, "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
		u.put(cacheWrite5m, m5, present)
		u.put(cacheWrite1h, h1, present)
		return good
	case "server_tool_use":
		present, n, _, good := s.details(d+1, "web_search_requests", "")
		u.put(webSearch, n, present)
		return good
	}
	s.skip(d + 1)
	return true
}

// details reads an object of counts nested in usage (OpenAI's
// *_tokens_details, Anthropic's cache_creation and server_tool_use): whether
// it is an object, and its integer members named first and second (0 when
// absent or null; second "" reads none).
func (s *scanner) details(d int, first, second string) (present bool, a, b int64, ok bool) {
	isObject, ok := s.object(d)
	if !isObject {
		return false, 0, 0, ok
	}
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return true, a, b, ok
		}
		var to *int64
		switch string(key) {
		case first:
			to = &a
		case second:
			if second != "" {
				to = &b
			}
		}
		if to == nil {
			s.skip(d + 1)
			continue
		}
		n, good := s.optInt(d + 1)
		*to = n.v
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
	return t.billed(), t.complete
}
