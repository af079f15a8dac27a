package fleetguard

import (
	"fmt"
	"net/http"

	"github.com/fleetguard/fleetguard/budget/usage"
)

// What is held bounds what the upstream may write: a request is forwarded
// with the output cap it reserved, in its API's own field, whether it named
// one or not (README, "The cap is forwarded").

// Values of OverMaxOutputTokens.
const (
	overMaxOutputLower  = "lower"
	overMaxOutputRefuse = "refuse"
)

// errOutputCapTooLarge is a request whose own output cap is over
// MaxOutputTokens, with OverMaxOutputTokens "refuse".
type errOutputCapTooLarge struct {
	field      string
	cap, limit int64
}

func (e errOutputCapTooLarge) Error() string {
	return fmt.Sprintf("%s is %d, more than the largest output cap this gateway forwards (%d): lower it", e.field, e.cap, e.limit)
}

// compileOutputCap checks the cap options.
func (h *LLMBudget) compileOutputCap() error {
	h.chatCapField = usage.MaxCompletionTokens
	if h.ChatCapField != "" {
		c, err := usage.ParseChatCapField(h.ChatCapField)
		if err != nil {
			return fmt.Errorf("llmbudget: chat_cap_field: %w", err)
		}
		h.chatCapField = c
	}
	if h.MaxOutputTokens < 0 || h.MaxOutputTokens > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: max_output_tokens: must be between 1 and %d", usage.MaxOutputCap)
	}
	switch h.OverMaxOutputTokens {
	case "", overMaxOutputLower, overMaxOutputRefuse:
	default:
		return fmt.Errorf("llmbudget: over_max_output_tokens %q: want lower or refuse", h.OverMaxOutputTokens)
	}
	if h.OverMaxOutputTokens != "" && h.MaxOutputTokens == 0 {
		return fmt.Errorf("llmbudget: over_max_output_tokens needs max_output_tokens")
	}
	return nil
}

// boundOutput decides the cap per output c is held to and the body it is
// forwarded with (its output bounded, its stream asked for usage).
func (h *LLMBudget) boundOutput(format usage.Format, c *call) *refusal {
	var err error
	if c.outputCap, err = h.outputCap(c.req); err != nil {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "output_cap_too_large", message: err.Error(), body: c.body}
	}
	if c.forward, c.askedUsage, err = h.forwardBody(format, c.req, c.body, c.outputCap); err != nil {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "invalid_request", message: err.Error(), body: c.body}
	}
	return nil
}

// outputCap is the cap per output a request is held to and forwarded with:
// its own, or DefaultMaxTokens when it names none, and at most
// MaxOutputTokens. A larger cap of its own is an errOutputCapTooLarge when
// OverMaxOutputTokens is "refuse".
func (h *LLMBudget) outputCap(req usage.Request) (int64, error) {
	if req.NoOutput {
		return 0, nil
	}
	limit := int64(usage.MaxOutputCap)
	if h.MaxOutputTokens > 0 {
		limit = h.MaxOutputTokens
	}
	if req.MaxOutputTokens == 0 {
		return min(h.defaultMaxTokens, limit), nil
	}
	if req.MaxOutputTokens > limit && h.OverMaxOutputTokens == overMaxOutputRefuse {
		return 0, errOutputCapTooLarge{req.MaxOutputTokensField, req.MaxOutputTokens, limit}
	}
	return min(req.MaxOutputTokens, limit), nil
}

// forwardBody is body as it is forwarded: an OpenAI stream that does not ask
// for its usage is made to (askedUsage: the client does not see the usage
// chunk it did not ask for), and the output is bounded to outputCap in the
// API's own field. Shadow mode enforces nothing, so it leaves the cap as the
// client wrote it.
func (h *LLMBudget) forwardBody(format usage.Format, req usage.Request, body []byte, outputCap int64) (forward []byte, askedUsage bool, err error) {
	rw := usage.Rewrites{
		IncludeUsage: (format == usage.OpenAIChat || format == usage.OpenAICompletions) && req.Stream && !req.IncludeUsage && h.injectStreamUsage(),
		ChatCapField: h.chatCapField,
	}
	if !h.Shadow {
		rw.OutputCap = outputCap
	}
	forward, err = usage.Rewrite(format, body, rw)
	return forward, rw.IncludeUsage, err
}
