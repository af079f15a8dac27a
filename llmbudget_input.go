package fleetguard

import (
	"fmt"
	"net/http"
)

// Input the body does not show (a Responses request continuing a stored
// conversation, a file by reference, a server tool that fetches pages) is
// billed by the upstream all the same, up to the model's context window. A
// budget that is a ceiling holds that much for such a request, or refuses
// it, by HiddenInput.
const (
	// DefaultContextWindow is ContextWindow's default: the largest input
	// the common models take (GPT-4.1, Gemini 2.x, Claude with its 1M
	// window).
	DefaultContextWindow = 1_000_000

	hiddenInputHold   = "hold"
	hiddenInputRefuse = "refuse"
)

// compileInput checks the input options.
func (h *LLMBudget) compileInput() error {
	switch h.HiddenInput {
	case "", hiddenInputHold, hiddenInputRefuse:
	default:
		return fmt.Errorf("llmbudget: hidden_input %q: want hold or refuse", h.HiddenInput)
	}
	if h.ContextWindow < 0 || h.ContextWindow > 1<<40 {
		return fmt.Errorf("llmbudget: context_window: must be between 1 and %d", int64(1)<<40)
	}
	h.contextWindow = h.ContextWindow
	if h.contextWindow == 0 {
		h.contextWindow = DefaultContextWindow
	}
	return nil
}

// boundInput makes the prompt estimate of a request with hidden input the
// context window, or refuses the request (hidden_input refuse).
func (h *LLMBudget) boundInput(c *call) *refusal {
	why := c.req.HiddenInput
	if why == "" {
		return nil
	}
	if h.HiddenInput == hiddenInputRefuse {
		return &refusal{kind: refusedRequest, status: http.StatusBadRequest, code: "hidden_input", body: c.body, noRetry: true,
			message: fmt.Sprintf("this request makes the upstream bill input it does not show (%s), which a budget cannot bound; send the input itself", why)}
	}
	c.req.PromptTokens = max(c.req.PromptTokens, h.contextWindow)
	c.holdNote = fmt.Sprintf("(the request names input it does not show, %s, so its prompt is held at context_window, %d tokens)", why, h.contextWindow)
	return nil
}
