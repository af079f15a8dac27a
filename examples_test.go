package fleetguard

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// example is a Caddy config in examples/, as JSON.
type example struct {
	name string // its file name
	json []byte
}

// adaptedExamples returns every Caddy config in examples/, by file name, each
// Caddyfile adapted with the environment variables it reads unset, so that
// their defaults apply. An adapter warning fails the test.
func adaptedExamples(t *testing.T) []example {
	t.Helper()
	files, err := filepath.Glob("examples/*")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	raws := map[string][]byte{}
	for _, f := range files {
		if strings.HasPrefix(filepath.Base(f), "grafana-") || strings.HasPrefix(filepath.Base(f), "prometheus-") {
			continue // a dashboard or rules, not a Caddy config: TestGrafanaDashboardQueriesExistingMetrics, TestPrometheusAlertsQueryExistingMetrics
		}
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		raws[f] = raw
		for _, m := range caddyfileEnvVar.FindAllSubmatch(raw, -1) {
			t.Setenv(string(m[1]), "") // restored after the test
			os.Unsetenv(string(m[1]))
		}
	}
	var examples []example
	for _, f := range files {
		raw, ok := raws[f]
		if !ok {
			continue
		}
		cfgJSON := raw
		if !strings.HasSuffix(f, ".json") {
			var warnings []caddyconfigWarning
			cfgJSON, warnings, err = adaptCaddyfileFile(raw, f)
			if err != nil {
				t.Fatalf("%s: adapting: %v", f, err)
			}
			for _, w := range warnings {
				t.Errorf("%s: warning: %s", f, w)
			}
		}
		examples = append(examples, example{filepath.Base(f), cfgJSON})
	}
	return examples
}

// caddyfileEnvVar matches a Caddyfile's {$NAME} and {$NAME:default}.
var caddyfileEnvVar = regexp.MustCompile(`\{\$([^}:]+)`)

// TestExamplesLoad provisions every config in examples/ the way `caddy
// validate` does: adapted, decoded strictly and provisioned, not started.
func TestExamplesLoad(t *testing.T) {
	for _, ex := range adaptedExamples(t) {
		t.Run(ex.name, func(t *testing.T) {
			var cfg caddy.Config
			if err := caddy.StrictUnmarshalJSON(ex.json, &cfg); err != nil {
				t.Fatalf("decoding: %v", err)
			}
			if err := caddy.Validate(&cfg); err != nil {
				t.Fatalf("validating: %v", err)
			}
		})
	}
}

// Every example runs beside every other. Caddy binds its admin endpoint and
// its sites' ports with SO_REUSEPORT, so a second Caddy on a port in use
// starts without an error and the two split what arrives there: the admin
// API's calls, a site's requests and with them its rate limits.
func TestExamplesListenApart(t *testing.T) {
	type use struct{ example, addr string }
	users := map[string]use{} // "port N" or "socket PATH" → its first user
	for _, ex := range adaptedExamples(t) {
		var cfg struct {
			Admin *struct {
				Disabled bool   `json:"disabled"`
				Listen   string `json:"listen"`
			} `json:"admin"`
			Apps struct {
				HTTP struct {
					Servers map[string]struct {
						Listen []string `json:"listen"`
					} `json:"servers"`
				} `json:"http"`
			} `json:"apps"`
		}
		if err := json.Unmarshal(ex.json, &cfg); err != nil {
			t.Fatalf("%s: %v", ex.name, err)
		}
		// A config without an admin address gets Caddy's default, also when
		// it is loaded through /load into a Caddy listening elsewhere.
		addrs := []string{"localhost:2019"}
		switch {
		case cfg.Admin != nil && cfg.Admin.Disabled:
			addrs = nil
		case cfg.Admin != nil && cfg.Admin.Listen != "":
			addrs = []string{cfg.Admin.Listen}
		}
		if len(cfg.Apps.HTTP.Servers) == 0 {
			t.Errorf("%s: no HTTP server", ex.name)
		}
		repl := caddy.NewReplacer()
		for name, srv := range cfg.Apps.HTTP.Servers {
			if len(srv.Listen) == 0 {
				t.Errorf("%s: server %s names no listen address (Caddy's defaults are :80 and :443)", ex.name, name)
			}
			for _, a := range srv.Listen {
				// Placeholders ({env.*}) replaced, as the http app does.
				a, err := repl.ReplaceOrErr(a, true, true)
				if err != nil {
					t.Fatalf("%s: %v", ex.name, err)
				}
				addrs = append(addrs, a)
			}
		}
		for _, a := range addrs {
			na, err := caddy.ParseNetworkAddress(a)
			if err != nil {
				t.Fatalf("%s: %v", ex.name, err)
			}
			var keys []string
			if na.IsUnixNetwork() {
				keys = append(keys, "socket "+na.Host)
			}
			for p := na.StartPort; !na.IsUnixNetwork() && p <= na.EndPort; p++ {
				keys = append(keys, fmt.Sprintf("port %d", p))
			}
			for _, k := range keys {
				first, taken := users[k]
				if !taken {
					users[k] = use{ex.name, a}
				} else if first.example != ex.name {
					t.Errorf("%s: %s (%s) and %s (%s)", k, first.example, first.addr, ex.name, a)
				}
			}
		}
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
	for _, ex := range adaptedExamples(t) {
		cfg := string(ex.json)
		if strings.Contains(cfg, `"handler":"llmbudget"`) && strings.Contains(cfg, `:11434"`) && !strings.Contains(cfg, `"chat_cap_field":"max_tokens"`) {
			t.Errorf("%s proxies to Ollama (:11434) without chat_cap_field max_tokens", ex.name)
		}
	}
}
