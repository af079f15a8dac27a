package fleetguard

import (
	"context"
	"net/http"
	"sync"

	"github.com/fleetguard/fleetguard/budget"
)

// turns are the holds of a speech session (the Realtime API, Gemini Live):
// each response is held at its worst case before it can start, whether the
// client asks for it or the server starts it from the audio it hears (turn
// detection), and settles to the usage the server reports for it.
//
// A response the client asks for is held before its event goes up
// (pending, in order). A response the server may start on its own is held
// before the audio that could start it goes up: while turn detection is on
// (auto), audio is forwarded only with a standing hold for the next such
// response. A response the server starts takes the first pending hold,
// else the standing one, else (it started from audio that went up before
// the standing hold it would have used was taken: the one residual) one
// charged past the limit.
type turns struct {
	h        *LLMBudget
	r        *http.Request
	identity call // the principal, team and model of the session
	// output is what a response is held for its output: its cap, and any
	// output the cap does not bound (thinking).
	output int64
	// audioRates: the input and output may be audio, priced at the dearer
	// of the audio and text rates.
	audioRates bool

	mu       sync.Mutex
	auto     bool // the server may start responses from audio
	pending  []*socketResponse
	standing *socketResponse
	// committed: the server took an input turn after its last response
	// began, so a response may be on its way.
	committed bool
}

// hold reserves one response at its worst case: the model's context
// window of input (the session truncates its conversation to the model's
// window, which the price table gives; context_window when it is larger or
// unknown) and t.output. Its reservation is nil when a refusal was not
// enforced (shadow, fail_open): it goes up unbudgeted.
func (t *turns) hold() (*socketResponse, *refusal) {
	h := t.h
	resp := &socketResponse{c: t.identity}
	c := &resp.c
	c.req.N, c.outputCap, c.wholeCap = 1, t.output, "speech session"
	c.req.PromptTokens = h.contextWindow
	if _, price, ok := h.prices.Find(h.priceName(c)); ok && price.MaxInputTokens > 0 {
		c.req.PromptTokens = min(c.req.PromptTokens, price.MaxInputTokens)
	}
	if ref := h.priceEstimate(c); ref != nil {
		return resp, ref
	}
	if h.hasUSD && t.audioRates {
		spoken := budget.Usage{InputTokens: c.req.PromptTokens, AudioInputTokens: c.req.PromptTokens, OutputTokens: t.output, AudioOutputTokens: t.output}
		c.spend.CostMicros = max(c.spend.CostMicros, c.price.CostMicros(spoken))
	}
	res, ref := h.reserve(t.r, c)
	if ref == nil {
		h.countAll(decisionAdmitted)
	}
	resp.res = res
	return resp, ref
}

// ask holds a response the client asks for, in order; the refusal is one
// to answer (an unenforced one forwards it unbudgeted).
func (t *turns) ask() (*socketResponse, *refusal) {
	resp, ref := t.hold()
	if ref != nil && t.h.enforced(ref) {
		return nil, ref
	}
	t.mu.Lock()
	t.pending = append(t.pending, resp)
	t.mu.Unlock()
	return resp, nil
}

// holdForAudio makes sure, before audio goes up while the server may
// start a response from it, that the next such response is held.
func (t *turns) holdForAudio() *refusal {
	t.mu.Lock()
	need := t.auto && t.standing == nil
	t.mu.Unlock()
	if !need {
		return nil
	}
	resp, ref := t.hold()
	if ref != nil && t.h.enforced(ref) {
		return ref
	}
	t.mu.Lock()
	if t.standing == nil {
		t.standing, resp = resp, nil
	}
	t.mu.Unlock()
	if resp != nil { // another audio message's hold came first
		settleSocketResponse(t.h, resp, outcome{source: sourceReleased})
	}
	return nil
}

// setAuto records whether the server may start responses from audio.
func (t *turns) setAuto(auto bool) {
	t.mu.Lock()
	t.auto = auto
	t.mu.Unlock()
}

// inputTaken records that the server took an input turn.
func (t *turns) inputTaken() {
	t.mu.Lock()
	t.committed = true
	t.mu.Unlock()
}

// begin is the hold of a response the server began.
func (t *turns) begin() *socketResponse {
	t.mu.Lock()
	var resp *socketResponse
	switch {
	case len(t.pending) > 0:
		resp, t.pending = t.pending[0], t.pending[1:]
	case t.standing != nil:
		resp, t.standing = t.standing, nil
	}
	t.committed = false
	t.mu.Unlock()
	if resp == nil {
		resp = t.overLimit()
	}
	return resp
}

// drop takes back a pending hold the server refused (nothing began): it
// is released.
func (t *turns) drop(match func(*socketResponse) bool) bool {
	t.mu.Lock()
	for i, resp := range t.pending {
		if match(resp) {
			t.pending = append(t.pending[:i], t.pending[i+1:]...)
			t.mu.Unlock()
			settleSocketResponse(t.h, resp, outcome{source: sourceReleased})
			return true
		}
	}
	t.mu.Unlock()
	return false
}

// overLimit holds a response nothing held, past the limit: the upstream
// bills it whatever the budget says.
func (t *turns) overLimit() *socketResponse {
	h := t.h
	resp := &socketResponse{c: t.identity}
	c := &resp.c
	c.req.N, c.outputCap, c.req.PromptTokens = 1, t.output, h.contextWindow
	if h.priceEstimate(c) != nil {
		return resp
	}
	ctx, cancel := context.WithTimeout(context.Background(), h.storeTimeout)
	defer cancel()
	resp.res, _ = h.engines.budgets.ReserveOverLimit(ctx, h.budgets, c.dims, c.spend)
	return resp
}

// end keeps what every response asked for holds (the upstream may have
// begun it), and the standing hold if the server took an input turn it has
// not answered yet; it releases the standing hold otherwise.
func (t *turns) end() {
	t.mu.Lock()
	left, standing, committed := t.pending, t.standing, t.committed
	t.pending, t.standing = nil, nil
	t.mu.Unlock()
	for _, resp := range left {
		settleSocketResponse(t.h, resp, outcome{source: sourceAbandoned})
	}
	if standing != nil {
		out := outcome{source: sourceReleased}
		if committed {
			out.source = sourceAbandoned
		}
		settleSocketResponse(t.h, standing, out)
	}
}
