package usage

import (
	"github.com/fleetguard/fleetguard/budget"
)

// usageFields is the union of the usage fields of every supported format, as
// they appear in a JSON response or in the usage object of a stream event.
type usageFields struct {
	// present: the usage object was given (not absent, not null).
	present bool
	// OpenAI Chat Completions.
	promptTokens, completionTokens optInt
	promptDetails                  cachedDetails // prompt_tokens_details
	// OpenAI Responses and Anthropic Messages.
	inputTokens, outputTokens optInt
	inputDetails              cachedDetails // input_tokens_details
	// Anthropic prompt caching: these add to input_tokens.
	cacheCreation, cacheRead optInt // cache_creation_input_tokens, cache_read_input_tokens
}

// cachedDetails is OpenAI's {prompt,input}_tokens_details.
type cachedDetails struct {
	present bool
	cached  int64 // cached_tokens
}

// usage normalises the fields of format f. OpenAI's cached tokens are part
// of its input count; Anthropic's cache reads and writes come on top of it.
func (u *usageFields) usage(f Format) (budget.Usage, bool) {
	switch {
	case u.promptTokens.set || u.completionTokens.set:
		out := budget.Usage{InputTokens: u.promptTokens.nonNegative(), OutputTokens: u.completionTokens.nonNegative()}
		if u.promptDetails.present {
			out.CachedInputTokens = max(u.promptDetails.cached, 0)
		}
		return out, true
	case f == Anthropic || u.cacheCreation.set || u.cacheRead.set:
		if !u.inputTokens.set && !u.outputTokens.set && !u.cacheRead.set && !u.cacheCreation.set {
			return budget.Usage{}, false
		}
		read := u.cacheRead.nonNegative()
		return budget.Usage{
			InputTokens:       u.inputTokens.nonNegative() + u.cacheCreation.nonNegative() + read,
			CachedInputTokens: read,
			OutputTokens:      u.outputTokens.nonNegative(),
		}, true
	case u.inputTokens.set || u.outputTokens.set:
		out := budget.Usage{InputTokens: u.inputTokens.nonNegative(), OutputTokens: u.outputTokens.nonNegative()}
		if u.inputDetails.present {
			out.CachedInputTokens = max(u.inputDetails.cached, 0)
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
		var field *optInt
		switch string(key) {
		case "prompt_tokens":
			field = &u.promptTokens
		case "completion_tokens":
			field = &u.completionTokens
		case "input_tokens":
			field = &u.inputTokens
		case "output_tokens":
			field = &u.outputTokens
		case "cache_creation_input_tokens":
			field = &u.cacheCreation
		case "cache_read_input_tokens":
			field = &u.cacheRead
		case "prompt_tokens_details", "input_tokens_details":
			details, good := s.cachedDetails(d + 1)
			if key[0] == 'p' {
				u.promptDetails = details
			} else {
				u.inputDetails = details
			}
			ok = ok && good
			continue
		default:
			s.skip(d + 1)
			continue
		}
		var good bool
		*field, good = s.optInt(d + 1)
		ok = ok && good
	}
}

func (s *scanner) cachedDetails(d int) (c cachedDetails, ok bool) {
	isObject, ok := s.object(d)
	if !isObject {
		return c, ok
	}
	c.present = true
	for k := 0; ; k++ {
		key, more := s.member(k)
		if !more {
			return c, ok
		}
		if string(key) != "cached_tokens" {
			s.skip(d + 1)
			continue
		}
		n, good := s.optInt(d + 1)
		c.cached = n.v
		ok = ok && good
	}
}

// FromJSON reads the usage of a non-streaming JSON response of format f
// (Gemini's usageMetadata and Ollama's final counts are recognised by their
// fields). The second result is false when the body reports no usage.
func FromJSON(f Format, body []byte) (budget.Usage, bool) {
	var ev event
	if !readEvent(body, &ev, nil, nil) {
		return budget.Usage{}, false
	}
	var t tally
	t.add(f, &ev)
	return t.usage, t.complete
}
