package usage

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the .golden files from the current output")

// goldenCases lists testdata/<dir>/<name>.<format>.json files.
func goldenCases(t *testing.T, dir string) []struct {
	path   string
	format Format
} {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", dir, "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden inputs in testdata/%s: %v", dir, err)
	}
	var out []struct {
		path   string
		format Format
	}
	for _, f := range files {
		parts := strings.Split(filepath.Base(f), ".")
		if len(parts) != 3 {
			t.Fatalf("%s: want <name>.<format>.json", f)
		}
		format, err := ParseFormat(parts[1])
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		out = append(out, struct {
			path   string
			format Format
		}{f, format})
	}
	return out
}

func checkGolden(t *testing.T, path string, got any) {
	t.Helper()
	b, err := json.MarshalIndent(got, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	b = append(b, '\n')
	golden := strings.TrimSuffix(path, ".json") + ".golden"
	if *update {
		if err := os.WriteFile(golden, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run go test ./budget/usage -update to create it)", err)
	}
	if string(want) != string(b) {
		t.Fatalf("%s:\n got %s\nwant %s", golden, b, want)
	}
}

func TestParseRequestGolden(t *testing.T) {
	for _, c := range goldenCases(t, "requests") {
		t.Run(filepath.Base(c.path), func(t *testing.T) {
			body, err := os.ReadFile(c.path)
			if err != nil {
				t.Fatal(err)
			}
			req, err := ParseRequest(c.format, "/v1beta/models/gemini-2.5-flash:streamGenerateContent", body)
			result := map[string]any{"request": req}
			if err != nil {
				result = map[string]any{"error": err.Error()}
			}
			checkGolden(t, c.path, result)
		})
	}
}

func TestFromJSONGolden(t *testing.T) {
	for _, c := range goldenCases(t, "responses") {
		t.Run(filepath.Base(c.path), func(t *testing.T) {
			body, err := os.ReadFile(c.path)
			if err != nil {
				t.Fatal(err)
			}
			u, ok := FromJSON(c.format, body)
			checkGolden(t, c.path, map[string]any{"found": ok, "usage": u})
		})
	}
}

func TestFormatFromPath(t *testing.T) {
	tests := map[string]Format{
		"/v1/chat/completions":         OpenAIChat,
		"/openai/v1/chat/completions/": OpenAIChat,
		"/v1/responses":                OpenAIResponses,
		"/v1/messages":                 Anthropic,
		"/v1/models":                   Unknown,
		"/":                            Unknown,
	}
	for path, want := range tests {
		if got := FormatFromPath(path); got != want {
			t.Errorf("FormatFromPath(%q) = %v, want %v", path, got, want)
		}
	}
	if _, err := ParseFormat("bedrock"); err == nil {
		t.Error("unknown format names are refused")
	}
}

func TestMediaIsNotReadAsText(t *testing.T) {
	big := strings.Repeat("A", 4<<20) // a 4 MiB base64 image
	body := `{"model":"m","max_tokens":10,"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,` + big + `"}}]}]}`
	req, err := ParseRequest(OpenAIChat, "/v1/chat/completions", []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	// The image, the message, and its one key as text.
	if want := int64(MediaPartTokens + MessageOverheadTokens + len("content")); req.PromptTokens != want {
		t.Fatalf("a 4 MiB image estimates %d tokens, want %d", req.PromptTokens, want)
	}
}
