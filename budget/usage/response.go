package usage

import (
	"github.com/fleetguard/fleetguard/budget"
)

// Fields is the union of the usage fields of every supported format, as they
// appear in a JSON response or in the usage object of a stream event.
type Fields struct {
	// OpenAI Chat Completions.
	PromptTokens        *int64 `json:"prompt_tokens"`
	CompletionTokens    *int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
	// OpenAI Responses and Anthropic Messages.
	InputTokens        *int64 `json:"input_tokens"`
	OutputTokens       *int64 `json:"output_tokens"`
	InputTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	// Anthropic prompt caching: these add to input_tokens.
	CacheCreationInputTokens *int64 `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     *int64 `json:"cache_read_input_tokens"`
}

// Usage normalises the fields of format f. OpenAI's cached tokens are part of
// its input count; Anthropic's cache reads and writes come on top of it.
func (u *Fields) Usage(f Format) (budget.Usage, bool) {
	v := func(p *int64) int64 {
		if p == nil || *p < 0 {
			return 0
		}
		return *p
	}
	switch {
	case u.PromptTokens != nil || u.CompletionTokens != nil:
		out := budget.Usage{InputTokens: v(u.PromptTokens), OutputTokens: v(u.CompletionTokens)}
		if u.PromptTokensDetails != nil {
			out.CachedInputTokens = max(u.PromptTokensDetails.CachedTokens, 0)
		}
		return out, true
	case f == Anthropic || u.CacheCreationInputTokens != nil || u.CacheReadInputTokens != nil:
		if u.InputTokens == nil && u.OutputTokens == nil && u.CacheReadInputTokens == nil && u.CacheCreationInputTokens == nil {
			return budget.Usage{}, false
		}
		read := v(u.CacheReadInputTokens)
		return budget.Usage{
			InputTokens:       v(u.InputTokens) + v(u.CacheCreationInputTokens) + read,
			CachedInputTokens: read,
			OutputTokens:      v(u.OutputTokens),
		}, true
	case u.InputTokens != nil || u.OutputTokens != nil:
		out := budget.Usage{InputTokens: v(u.InputTokens), OutputTokens: v(u.OutputTokens)}
		if u.InputTokensDetails != nil {
			out.CachedInputTokens = max(u.InputTokensDetails.CachedTokens, 0)
		}
		return out, true
	}
	return budget.Usage{}, false
}

// FromJSON reads the usage of a non-streaming JSON response of format f
// (Gemini's usageMetadata and Ollama's final counts are recognised by their
// fields). The second result is false when the body reports no usage.
func FromJSON(f Format, body []byte) (budget.Usage, bool) {
	ev, ok := parseEvent(body)
	if !ok {
		return budget.Usage{}, false
	}
	var t tally
	t.add(f, ev)
	return t.usage, t.complete
}
