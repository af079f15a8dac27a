package usage

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
)

// sseEvent is one SSE event named name carrying data.
func sseEvent(name, data string) string { return "event: " + name + "\ndata: " + data + "\n\n" }

// TestResponsesCutEndsWithTheOutputSoFar: a Responses stream cut at its
// lease ends with response.incomplete whose response holds the output
// streamed so far (the SDKs take it as the answer): items as added, their
// text from the deltas, an item already done as it was given.
func TestResponsesCutEndsWithTheOutputSoFar(t *testing.T) {
	events := []string{
		sseEvent("response.created", `{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"gpt-4o","output":[]}}`),
		sseEvent("response.output_item.added", `{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[]}}`),
		sseEvent("response.output_item.done", `{"type":"response.output_item.done","sequence_number":2,"output_index":0,"item":{"id":"rs_1","type":"reasoning","summary":[],"status":"completed"}}`),
		sseEvent("response.output_item.added", `{"type":"response.output_item.added","sequence_number":3,"output_index":1,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}`),
		sseEvent("response.content_part.added", `{"type":"response.content_part.added","sequence_number":4,"item_id":"msg_1","output_index":1,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}}`),
		sseEvent("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":5,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"Hel"}`),
		sseEvent("response.output_text.delta", `{"type":"response.output_text.delta","sequence_number":6,"item_id":"msg_1","output_index":1,"content_index":0,"delta":"lo \"w\u00f6rld\"\n"}`),
		sseEvent("response.output_item.added", `{"type":"response.output_item.added","sequence_number":7,"output_index":2,"item":{"id":"fc_1","type":"function_call","call_id":"call_1","name":"f","arguments":""}}`),
		sseEvent("response.function_call_arguments.delta", `{"type":"response.function_call_arguments.delta","sequence_number":8,"item_id":"fc_1","output_index":2,"delta":"{\"a\":"}`),
	}
	withheld := sseEvent("response.function_call_arguments.delta", `{"type":"response.function_call_arguments.delta","sequence_number":9,"item_id":"fc_1","output_index":2,"delta":"1}"}`)
	var o ResponsesOutput
	for _, ev := range events {
		o.Observe([]byte(ev))
	}
	end := string(Truncation(OpenAIResponses, []byte(withheld), &o, budget.Usage{InputTokens: 5, OutputTokens: 40}, false))
	data, ok := strings.CutPrefix(end, "event: response.incomplete\ndata: ")
	if !ok || !strings.HasSuffix(data, "\n\n") {
		t.Fatalf("the end %q is not one response.incomplete event", end)
	}
	var got struct {
		Type           string `json:"type"`
		SequenceNumber int    `json:"sequence_number"`
		Response       struct {
			ID                string `json:"id"`
			Status            string `json:"status"`
			IncompleteDetails struct {
				Reason string `json:"reason"`
			} `json:"incomplete_details"`
			Output []struct {
				ID, Type, Status, Arguments string
				Content                     []struct{ Type, Text string }
			} `json:"output"`
			Usage struct {
				OutputTokens int64 `json:"output_tokens"`
			} `json:"usage"`
		} `json:"response"`
	}
	if err := json.Unmarshal([]byte(data), &got); err != nil {
		t.Fatal(err)
	}
	r := got.Response
	if got.SequenceNumber != 9 || r.ID != "resp_1" || r.Status != "incomplete" || r.IncompleteDetails.Reason != "max_output_tokens" || r.Usage.OutputTokens != 40 {
		t.Fatalf("the response: %+v (sequence %d)", r, got.SequenceNumber)
	}
	if len(r.Output) != 3 {
		t.Fatalf("%d output items, want 3: %+v", len(r.Output), r.Output)
	}
	if o := r.Output[0]; o.ID != "rs_1" || o.Status != "completed" {
		t.Errorf("a done item is kept as given: %+v", o)
	}
	if o := r.Output[1]; o.ID != "msg_1" || o.Status != "incomplete" || len(o.Content) != 1 || o.Content[0].Text != "Hello \"wörld\"\n" {
		t.Errorf("the message: %+v, want its text so far", o)
	}
	if o := r.Output[2]; o.Type != "function_call" || o.Arguments != `{"a":` || o.Status != "incomplete" {
		t.Errorf("the function call: %+v, want its arguments so far", o)
	}

	// A stream that sends deltas only (no item events) still ends with
	// its text, in a message named by the deltas' item_id.
	var bare ResponsesOutput
	bare.Observe([]byte(events[0]))
	bare.Observe([]byte(events[5]))
	end = string(Truncation(OpenAIResponses, []byte(events[6]), &bare, budget.Usage{}, false))
	if !strings.Contains(end, `"output":[{"content":[{"annotations":[],"text":"Hel","type":"output_text"}],"id":"msg_1","role":"assistant","status":"incomplete","type":"message"}]`) {
		t.Fatalf("a bare stream ends %s", end)
	}
}
