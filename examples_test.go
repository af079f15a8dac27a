package fleetguard

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestExamplesLoad provisions every config in examples/ the way `caddy
// validate` does: adapted, decoded strictly and provisioned, not started.
func TestExamplesLoad(t *testing.T) {
	files, err := filepath.Glob("examples/*")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	for _, f := range files {
		if strings.HasPrefix(filepath.Base(f), "grafana-") {
			continue // a dashboard, not a Caddy config: TestGrafanaDashboardQueriesExistingMetrics
		}
		t.Run(filepath.Base(f), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			cfgJSON := raw
			if !strings.HasSuffix(f, ".json") {
				var warnings []caddyconfigWarning
				cfgJSON, warnings, err = adaptCaddyfileFile(raw, f)
				if err != nil {
					t.Fatalf("adapting: %v", err)
				}
				for _, w := range warnings {
					t.Errorf("warning: %s", w)
				}
			}
			var cfg caddy.Config
			if err := caddy.StrictUnmarshalJSON(cfgJSON, &cfg); err != nil {
				t.Fatalf("decoding: %v", err)
			}
			if err := caddy.Validate(&cfg); err != nil {
				t.Fatalf("validating: %v", err)
			}
		})
	}
}

// xcaddy.md shows what `caddy list-modules` prints of fleetguard: every
// module this package registers.
func TestXcaddyDocListsEveryModule(t *testing.T) {
	doc, err := os.ReadFile("xcaddy.md")
	if err != nil {
		t.Fatal(err)
	}
	pkg := reflect.TypeOf(App{}).PkgPath()
	found := 0
	for _, id := range caddy.Modules() {
		info, err := caddy.GetModule(id)
		if err != nil {
			t.Fatal(err)
		}
		typ := reflect.TypeOf(info.New())
		if typ.Kind() == reflect.Pointer {
			typ = typ.Elem()
		}
		if typ.PkgPath() != pkg {
			continue
		}
		found++
		if !strings.Contains(string(doc), "# "+id+"\n") {
			t.Errorf("xcaddy.md's list-modules output lacks %s", id)
		}
	}
	if found < 4 {
		t.Fatalf("found %d fleetguard modules, want at least 4", found)
	}
}

// Ollama's OpenAI-compatible API reads only max_tokens: an example in front
// of it that forwarded max_completion_tokens would leave its requests
// unbounded.
func TestExamplesForOllamaForwardMaxTokens(t *testing.T) {
	files, err := filepath.Glob("examples/*.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		cfgJSON, _, err := adaptCaddyfileFile(raw, f)
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		cfg := string(cfgJSON)
		if strings.Contains(cfg, `"handler":"llmbudget"`) && strings.Contains(cfg, `:11434"`) && !strings.Contains(cfg, `"chat_cap_field":"max_tokens"`) {
			t.Errorf("%s proxies to Ollama (:11434) without chat_cap_field max_tokens", f)
		}
	}
}
