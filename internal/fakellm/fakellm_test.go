package fakellm

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fleetguard/fleetguard/internal/wait"
)

// wordsStream posts a streamed chat request asking for usage with max_tokens
// limit and reads it: the text, its chunks, the finish reason and the usage.
func wordsStream(t *testing.T, url string, limit int) (text string, chunks int, finish string, prompt, completion int) {
	t.Helper()
	body := `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":` + strconv.Itoa(limit) + `}`
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c ChatChunk
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != nil {
				text += *ch.Delta.Content
				chunks++
			}
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			prompt, completion = c.Usage.Prompt, c.Usage.Completion
		}
	}
	return text, chunks, finish, prompt, completion
}

func TestWordsStream(t *testing.T) {
	s := &Server{Input: 20, Output: 40, Interval: time.Millisecond, Words: true}
	ts := httptest.NewServer(s)
	defer ts.Close()
	text, chunks, finish, prompt, completion := wordsStream(t, ts.URL, 4096)
	if chunks != 40 || finish != "stop" || prompt != 20 || completion != 40 {
		t.Fatalf("uncapped: %d chunks, finish %q, usage %d+%d; want 40, stop, 20+40", chunks, finish, prompt, completion)
	}
	if per := float64(len(text)) / 40; per < 4 || per > 5 {
		t.Fatalf("%.2f bytes a token, want about 4.5", per)
	}
	_, chunks, finish, _, completion = wordsStream(t, ts.URL, 25)
	if chunks != 25 || finish != "length" || completion != 25 {
		t.Fatalf("capped at 25: %d chunks, finish %q, completion %d; want 25, length, 25", chunks, finish, completion)
	}
	if got := s.Generated(); got != 65 {
		t.Fatalf("Generated %d, want 65", got)
	}
}

// A client that goes away stops the stream: Generated counts what was
// generated until then, not Output.
func TestWordsStreamStopsWhenClientLeaves(t *testing.T) {
	s := &Server{Input: 20, Output: 1000, Interval: 5 * time.Millisecond, Words: true}
	ts := httptest.NewServer(s)
	defer ts.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	_, _ = resp.Body.Read(buf)
	time.Sleep(50 * time.Millisecond) // the client reads for 50 ms: about 10 tokens
	cancel()
	resp.Body.Close()
	wait.Until(t, 2*time.Second, "the stream stopping", func() bool { return s.Stopped() > 0 })
	if s.Stopped() != 1 {
		t.Fatalf("Stopped %d, want 1", s.Stopped())
	}
	if g := s.Generated(); g < 5 || g > 100 {
		t.Fatalf("Generated %d after ~50 ms at 5 ms a token, want about 10", g)
	}
}

// Jitter keeps each answer within ±Jitter of Output.
func TestJitter(t *testing.T) {
	s := &Server{Input: 1, Output: 50, Interval: 0, Words: true, Jitter: 0.2}
	ts := httptest.NewServer(s)
	defer ts.Close()
	seen := map[int]bool{}
	for range 20 {
		_, chunks, _, _, completion := wordsStream(t, ts.URL, 4096)
		if chunks != completion || chunks < 40 || chunks > 60 {
			t.Fatalf("%d chunks, completion %d; want equal, in 40..60", chunks, completion)
		}
		seen[chunks] = true
	}
	if len(seen) < 2 {
		t.Fatalf("20 answers of one length: no jitter")
	}
}

// TestResponsesStream: a streamed Responses answer is OpenAI's event
// sequence, a delta a word, ending response.completed with the usage, or
// response.incomplete when max_output_tokens cut it.
func TestResponsesStream(t *testing.T) {
	s := New()
	s.Output, s.Interval = 12, 0
	ts := httptest.NewServer(s)
	defer ts.Close()
	for _, tc := range []struct {
		limit, want int
		final       string
	}{{100, 12, "response.completed"}, {5, 5, "response.incomplete"}} {
		resp, err := http.Post(ts.URL+"/v1/responses", "application/json",
			strings.NewReader(`{"model":"m","stream":true,"input":"hi","max_output_tokens":`+strconv.Itoa(tc.limit)+`}`))
		if err != nil {
			t.Fatal(err)
		}
		var types []string
		var deltas strings.Builder
		var last struct {
			Type     string
			Delta    string
			Response struct {
				Status string
				Output []struct{ Content []struct{ Text string } }
				Usage  struct {
					OutputTokens int `json:"output_tokens"`
				}
			}
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			last.Delta = ""
			if err := json.Unmarshal([]byte(data), &last); err != nil {
				t.Fatalf("event %q: %v", data, err)
			}
			types = append(types, last.Type)
			deltas.WriteString(last.Delta)
		}
		resp.Body.Close()
		if n := len(types); n != tc.want+6 || types[0] != "response.created" || types[n-1] != tc.final {
			t.Fatalf("events %v, want created … %d deltas … %s", types, tc.want, tc.final)
		}
		if r := last.Response; r.Usage.OutputTokens != tc.want || len(r.Output) != 1 || r.Output[0].Content[0].Text != deltas.String() {
			t.Fatalf("final response %+v, want %d output tokens and the deltas' text %q", r, tc.want, deltas.String())
		}
	}
}

// An answer stops at the request's cap, as a model does; OverwriteCap
// reports Output whatever the cap, an upstream that writes past it.
func TestAnswersStopAtTheCapUnlessOverwriteCap(t *testing.T) {
	for _, tc := range []struct {
		overwrite  bool
		body       string
		completion int
	}{
		{false, `{"model":"m","max_tokens":5}`, 5},
		{false, `{"model":"m","max_completion_tokens":500}`, 70},
		{false, `{"model":"m"}`, 70},
		{true, `{"model":"m","max_tokens":5}`, 70},
	} {
		s := New()
		s.OverwriteCap = tc.overwrite
		ts := httptest.NewServer(s)
		resp, err := http.Post(ts.URL+"/v1/chat/completions", "application/json", strings.NewReader(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		var answer struct {
			Usage struct {
				Completion int `json:"completion_tokens"`
			} `json:"usage"`
		}
		err = json.NewDecoder(resp.Body).Decode(&answer)
		resp.Body.Close()
		ts.Close()
		if err != nil || answer.Usage.Completion != tc.completion {
			t.Errorf("OverwriteCap %v, %s: %d output tokens (%v), want %d", tc.overwrite, tc.body, answer.Usage.Completion, err, tc.completion)
		}
	}
}
