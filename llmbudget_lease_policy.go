package fleetguard

import (
	"cmp"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/fleetguard/fleetguard/budget/usage"
)

// DefaultOutputLeaseMin is the smallest output lease, and the first one of a
// model with no history.
const DefaultOutputLeaseMin = 256

// DefaultReasoningModels are the model patterns that reason by default and
// bill reasoning tokens they do not stream: OpenAI's o-series and GPT-5,
// Gemini 2.5 and 3 (thinking on by default), xAI's Grok 3 mini and Grok 4, and
// any "thinking" model. A * matches any run of characters; a pattern matches
// the model as named or after its last "/" (openai/o3 via a router).
var DefaultReasoningModels = []string{"o1*", "o3*", "o4*", "gpt-5*", "codex-*", "gemini-2.5-*", "gemini-3*", "grok-3-mini*", "grok-4*", "*thinking*"}

// compileLeases checks the lease options.
func (h *LLMBudget) compileLeases() error {
	h.outputLeases = h.OutputLeases == nil || *h.OutputLeases
	if h.OutputLeaseMin < 0 || h.OutputLeaseMin > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: output_lease_min: must be between 1 and %d", usage.MaxOutputCap)
	}
	h.outputLeaseMin = cmp.Or(h.OutputLeaseMin, DefaultOutputLeaseMin)
	h.reasoningModels = DefaultReasoningModels
	if h.ReasoningModels != nil {
		h.reasoningModels = make([]string, len(h.ReasoningModels))
		for i, p := range h.ReasoningModels {
			if strings.TrimSpace(p) == "" {
				return errors.New("llmbudget: reasoning_models: a pattern is empty")
			}
			h.reasoningModels[i] = strings.ToLower(p)
		}
	}
	return nil
}

// leasable reports whether the output of c can be leased: a single streamed
// answer whose every token the meter sees.
func (h *LLMBudget) leasable(r *http.Request, format usage.Format, c *call) bool {
	if !h.outputLeases || !c.req.Stream || c.req.N != 1 || c.req.NoOutput || c.req.Reasoning || c.outputCap <= h.outputLeaseMin {
		return false
	}
	switch format {
	case usage.Gemini:
		// Streamed as SSE only with alt=sse; else a JSON array the meter
		// does not read as it passes.
		return strings.EqualFold(r.URL.Query().Get("alt"), "sse") && !h.isReasoningModel(c.req.Model)
	case usage.OpenAIChat, usage.OpenAICompletions, usage.OpenAIResponses, usage.Anthropic, usage.Ollama:
		return !h.isReasoningModel(c.req.Model)
	}
	return false
}

func (h *LLMBudget) isReasoningModel(model string) bool {
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	for _, p := range h.reasoningModels {
		if globMatch(p, model) || globMatch(p, base) {
			return true
		}
	}
	return false
}

// globMatch matches s against pattern, where * matches any run of
// characters (including none) and everything else matches itself.
func globMatch(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == s
	}
	if !strings.HasPrefix(s, parts[0]) {
		return false
	}
	s = s[len(parts[0]):]
	for _, part := range parts[1 : len(parts)-1] {
		i := strings.Index(s, part)
		if i < 0 {
			return false
		}
		s = s[i+len(part):]
	}
	return strings.HasSuffix(s, parts[len(parts)-1])
}
