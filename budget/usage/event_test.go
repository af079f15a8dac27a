package usage

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
)

// geminiChunk is a streamGenerateContent chunk: text, a finishReason when
// not "", and usageMetadata when not "".
func geminiChunk(text, finish, usage string) string {
	c := `{"candidates":[{"content":{"parts":[{"text":` + fmt.Sprintf("%q", text) + `}],"role":"model"}`
	if finish != "" {
		c += `,"finishReason":"` + finish + `"`
	}
	c += `,"index":0}]`
	if usage != "" {
		c += `,"usageMetadata":` + usage
	}
	return c + `,"modelVersion":"gemini-2.5-flash"}`
}

// thinking is u with reasoning tokens, part of its output.
func thinking(n int64, u budget.Usage) budget.Usage {
	u.ReasoningTokens = n
	return u
}

// TestGeminiUsageIsARunningCountUntilTheResponseFinishes: Gemini's
// usageMetadata before a finishReason is a running count, the largest of
// each count a lower bound; with or after the finishReason it is the final
// report.
func TestGeminiUsageIsARunningCountUntilTheResponseFinishes(t *testing.T) {
	prompt := `{"promptTokenCount":7,"totalTokenCount":7}`
	running := `{"promptTokenCount":7,"candidatesTokenCount":12,"thoughtsTokenCount":20,"totalTokenCount":39}`
	final := `{"promptTokenCount":7,"candidatesTokenCount":30,"thoughtsTokenCount":20,"totalTokenCount":57}`
	tests := []struct {
		name                 string
		chunks               []string
		usage                budget.Usage
		complete, inputKnown bool
	}{
		{"cut while the usage holds the prompt alone",
			[]string{geminiChunk("The Nile", "", prompt), geminiChunk(" is long", "", prompt)},
			usageOf(7, 0, 0), false, true},
		{"cut after a running count, then a chunk without it",
			[]string{geminiChunk("The Nile", "", running), geminiChunk(" is long", "", prompt)},
			thinking(20, usageOf(7, 0, 32)), false, true},
		{"finished, its usage in the last chunk",
			[]string{geminiChunk("The Nile", "", running), geminiChunk(" is long.", "STOP", final)},
			thinking(20, usageOf(7, 0, 50)), true, true},
		{"finished, its usage in a chunk of its own after",
			[]string{geminiChunk("The Nile", "", prompt), geminiChunk(" is long.", "STOP", ""), `{"usageMetadata":` + final + `}`},
			thinking(20, usageOf(7, 0, 50)), true, true},
		{"cut between the finishReason and the usage after it",
			[]string{geminiChunk("The Nile", "", running), geminiChunk(" is long.", "STOP", "")},
			thinking(20, usageOf(7, 0, 32)), false, true},
		{"the final report is the report, lower or not",
			[]string{geminiChunk("The Nile", "", running), geminiChunk(".", "MAX_TOKENS", prompt)},
			usageOf(7, 0, 0), true, true},
		{"a blocked prompt",
			[]string{`{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":7,"totalTokenCount":7}}`},
			usageOf(7, 0, 0), true, true},
		{"a running count without the prompt does not know the input",
			[]string{geminiChunk("The Nile", "", `{"candidatesTokenCount":2}`)},
			usageOf(0, 0, 2), false, false},
		{"an empty finishReason does not finish",
			[]string{geminiChunk("The Nile", "", running), `{"candidates":[{"content":{"parts":[{"text":""}]},"finishReason":""}],"usageMetadata":` + final + `}`},
			thinking(20, usageOf(7, 0, 50)), false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			framing, s := stream(Gemini, tt.chunks...)
			got := meter(Gemini, framing, s)
			if got.Usage != tt.usage || got.Complete != tt.complete || got.InputKnown != tt.inputKnown {
				t.Errorf("read %+v, want usage %+v, complete %v, input known %v", got, tt.usage, tt.complete, tt.inputKnown)
			}
			if want, _ := refMeterRead(Gemini, framing, s); got != want {
				t.Errorf("read %+v, the reference %+v", got, want)
			}
		})
	}
}

// TestGeminiCutStreamCountsItsText: a stream whose interim chunks report
// the prompt alone, cut after 59 of its 100 chunks, reads the text of the
// 59 (metering.go estimates the output from it), not a final report of the
// prompt alone.
func TestGeminiCutStreamCountsItsText(t *testing.T) {
	var chunks []string
	for i := range 100 {
		finish, usage := "", `{"promptTokenCount":7,"totalTokenCount":7}`
		if i == 99 {
			finish, usage = "STOP", `{"promptTokenCount":7,"candidatesTokenCount":400,"totalTokenCount":407}`
		}
		chunks = append(chunks, geminiChunk(strings.Repeat("word ", 4), finish, usage))
	}
	_, whole := stream(Gemini, chunks...)
	_, cut := stream(Gemini, chunks[:59]...)
	if r := meter(Gemini, SSE, whole); !r.Complete || r.Usage != usageOf(7, 0, 400) {
		t.Fatalf("the whole stream: %+v, want its final report", r)
	}
	r := meter(Gemini, SSE, cut)
	if r.Complete || !r.InputKnown || r.Usage.InputTokens != 7 || r.OutputTextBytes != 59*20 {
		t.Fatalf("cut after 59 chunks: %+v, want incomplete, input 7, %d bytes of text", r, 59*20)
	}
}

// TestFromJSONGeminiIsFinished: a whole generateContent response reports
// its usage whether or not a candidate says why it finished.
func TestFromJSONGeminiIsFinished(t *testing.T) {
	for _, body := range []string{
		`{"candidates":[{"content":{"parts":[{"text":"Nile"}]}}],"usageMetadata":{"promptTokenCount":7,"candidatesTokenCount":2}}`,
		`{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":7}}`,
	} {
		u, ok := FromJSON(Gemini, []byte(body))
		if want, wantOK := refFromJSON(Gemini, []byte(body)); !ok || u != want || !wantOK {
			t.Errorf("FromJSON(%s) = %+v %v, the reference %+v %v", body, u, ok, want, wantOK)
		}
		if u.InputTokens != 7 {
			t.Errorf("FromJSON(%s) = %+v, want the 7 input tokens reported", body, u)
		}
	}
}

// Counts are read as the upstream reported them: a negative count or a sum
// that overflows stays out of range, for budget.SpendOf to refuse, never
// floored to a free request.
func TestReportedCountsOutOfRangeStayOutOfRange(t *testing.T) {
	u, ok := FromJSON(OpenAIChat, []byte(`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":-5000}}`))
	if !ok || u.OutputTokens != -5000 {
		t.Errorf("chat JSON with a negative output: %+v %v, want -5000 as reported", u, ok)
	}
	u, ok = FromJSON(Anthropic, []byte(`{"usage":{"input_tokens":9223372036854775807,"cache_creation_input_tokens":1,"output_tokens":3}}`))
	if !ok || u.InputTokens != -1 {
		t.Errorf("Anthropic input that overflows when summed: %+v %v, want -1 (out of range)", u, ok)
	}
	r := meter(Anthropic, SSE, []byte("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n"+
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":-40}}\n\n"))
	if !r.Complete || r.Usage.OutputTokens != -40 {
		t.Errorf("Anthropic stream with a negative output: %+v, want -40 as reported", r)
	}
	for _, u := range []budget.Usage{{OutputTokens: -5000}, {InputTokens: -1}, r.Usage} {
		if _, err := (budget.Price{}).SpendOf(u); !errors.Is(err, budget.ErrUsageOutOfRange) {
			t.Errorf("SpendOf(%+v) = %v, want ErrUsageOutOfRange", u, err)
		}
	}
}
