package fleetguard

import (
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget/bpe"
)

// A `fleetguard` block inside a site says it is a global option, with its
// position once.
func TestFleetguardInsideASiteSaysItIsAGlobalOption(t *testing.T) {
	src := []byte(":8080 {\n\tfleetguard {\n\t\tprefix x\n\t}\n\trespond ok\n}\n")
	_, _, err := adaptCaddyfileFile(src, "site.Caddyfile")
	if err == nil {
		t.Fatal("a fleetguard block inside a site must be refused")
	}
	msg := err.Error()
	if !strings.Contains(msg, "fleetguard is a global option") || strings.Count(msg, "site.Caddyfile:2") != 1 {
		t.Fatalf("error %q: want 'fleetguard is a global option' and the position site.Caddyfile:2 once", msg)
	}
}

// Checking a config at parse time fills in no default: the adapted JSON says
// what the Caddyfile says, and nothing else.
func TestAdaptedLLMBudgetHoldsNoDefaults(t *testing.T) {
	src := []byte(":0 {\n\tllmbudget {\n\t\tbudget b {\n\t\t\tlimit 10\n\t\t\twindow 1h\n\t\tunit tokens\n\t\t}\n\t}\n}\n")
	cfg, _, err := adaptCaddyfileFile(src, "Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, field := range []string{"default_max_tokens", "max_request_body", "store_timeout", "max_retry_after"} {
		if strings.Contains(string(cfg), `"`+field+`"`) {
			t.Errorf("adapted JSON holds %s, which the Caddyfile did not set: %s", field, cfg)
		}
	}
}

// A bad store URL is refused with its line, and without echoing a password.
func TestBadRedisURLNamesItsLine(t *testing.T) {
	for _, tt := range []struct{ option, url string }{
		{"redis", "http://user:s3cret@127.0.0.1:6379"},
		{"redis_cluster", "redis://:s3cret@"},
		{"redis_sentinel", "redis://:s3cret@127.0.0.1:26379/0"}, // no master_name
	} {
		src := []byte("{\n\tfleetguard {\n\t\tprefix p\n\t\t" + tt.option + " " + tt.url + "\n\t}\n}\n:0 {\n\trespond ok\n}\n")
		_, _, err := adaptCaddyfileFile(src, "store.Caddyfile")
		if err == nil {
			t.Fatalf("%s %s: accepted", tt.option, tt.url)
		}
		msg := err.Error()
		if !strings.Contains(msg, tt.option) || strings.Count(msg, "store.Caddyfile:4") != 1 || strings.Contains(msg, "s3cret") {
			t.Errorf("%s: error %q: want the option, the position store.Caddyfile:4 once, and no password", tt.option, msg)
		}
	}
}

func TestFleetLimitCaddyfileErrors(t *testing.T) {
	const key = "key {http.request.header.X-API-Key}\n"
	tests := []struct{ name, zone, want string }{
		{"unknown subdirective", key + "evnts 5\nwindow 1m", `unknown subdirective "evnts"`},
		{"missing events", key + "window 1m", "events must be > 0"},
		{"negative burst", key + "events 5\nburst -2\nwindow 1m", "burst must be >= 0"},
		{"bad window", key + "events 5\nwindow soon", "window"},
		{"precision over the maximum", key + "events 5\nwindow 1m\nprecision 101", "precision must be between 1 and 100"},
		{"a field set twice", key + "events 5\nevents 6\nwindow 1m", "events is set twice"},
		{"max_keys over the maximum", key + "events 5\nwindow 1m\nmax_keys 99999999", "max_keys must be between"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := ":0 {\n fleetlimit {\n zone z {\n" + tt.zone + "\n}\n }\n}"
			_, _, err := adaptCaddyfile(src)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
	// A zone's error names the line of the field it is about, or the zone's
	// for a field it lacks.
	for zone, at := range map[string]string{
		key + "events 5\nburst -2\nwindow 1m": "Caddyfile:6", // burst
		key + "events 0\nwindow 1m":           "Caddyfile:5", // events
		key + "window 1m":                     "Caddyfile:3", // no events: the zone's line
	} {
		_, _, err := adaptCaddyfile(":0 {\n fleetlimit {\n zone z {\n" + zone + "\n}\n }\n}")
		if err == nil || strings.Count(err.Error(), at) != 1 || strings.Count(err.Error(), "Caddyfile:") != 1 {
			t.Errorf("zone %q: error %v, want the position %s once", zone, err, at)
		}
	}
	for _, global := range []string{"near_limit maybe", "prefix a\n prefix b"} {
		if _, _, err := adaptCaddyfile("{\n fleetguard {\n " + global + "\n }\n}\n:0 {\n respond ok\n}"); err == nil {
			t.Fatalf("global option %q: want an error", global)
		}
	}
	// The URL is checked when the Caddyfile is read, so its error has a line.
	if _, _, err := adaptCaddyfile("{\n fleetguard {\n redis 127.0.0.1:6379\n }\n}\n:0 {\n respond ok\n}"); err == nil ||
		!strings.Contains(err.Error(), "fleetguard: redis") || !strings.Contains(err.Error(), "Caddyfile:3") {
		t.Fatalf("a URL without a scheme: %v, want an error naming the redis option and its line", err)
	}
}

func TestLLMBudgetConfigErrors(t *testing.T) {
	// The block starts on line 3 of the Caddyfile (":0 {", "llmbudget {").
	tests := []struct{ name, block, want, at string }{
		{"no budget", "price m 1 1", "at least one budget", ""},
		{"unknown subdirective", "budget b {\nlimit 1\nwindow 1h\nunit tokens\n}\nbudgets 3", `unknown subdirective "budgets"`, ""},
		{"bad scope", "budget b {\nscope galaxy\nlimit 1\nwindow 1h\nunit tokens\n}", `scope "galaxy"`, "Caddyfile:4"},
		{"bad unit", "budget b {\nunit bananas\nlimit 1\nwindow 1h\n}", `unit "bananas"`, "Caddyfile:4"},
		{"zero limit", "budget b {\nlimit 0\nwindow 1h\nunit tokens\n}", "limit must be > 0", "Caddyfile:4"},
		{"fractional tokens", "budget b {\nlimit 1.5\nwindow 1h\nunit tokens\n}", "whole number", "Caddyfile:4"},
		{"limit past what the store counts", "budget b {\nlimit 1000000000000000\nwindow 1h\nunit tokens\n}", "limit must be at most 9223372036854", ""},
		{"dollars in a token budget", "budget team_usd {\nscope global\nlimit 25.00\nwindow 720h\nunit tokens\n}", "write `unit usd`", "Caddyfile:5"},
		{"no unit", "budget b {\nlimit 5\nwindow 1h\n}", `budget "b": unit is required: tokens or usd`, "Caddyfile:3"},
		{"dollars without a unit", "budget team_usd {\nscope global\nlimit 25.00\nwindow 720h\n}", `budget "team_usd": unit is required`, "Caddyfile:3"},
		{"no window", "budget b {\nlimit 10\nunit tokens\n}", `budget "b": window is required`, "Caddyfile:3"},
		{"no limit", "budget b {\nwindow 1h\nunit tokens\n}", `budget "b": limit is required`, "Caddyfile:3"},
		{"a repeated budget option", "budget b {\nlimit 10\nwindow 1h\nlimit 20\nunit tokens\n}", "limit is set twice", "Caddyfile:6"},
		{"a bad window", "budget b {\nlimit 10\nwindow 10\nunit tokens\n}", "window", "Caddyfile:5"},
		{"negative price", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nprice m -1 2", "not a price", "Caddyfile:8"},
		{"scope team without team", "budget t {\nscope team\nlimit 10\nwindow 1h\nunit tokens\n}", "scope team needs the handler's team option", "Caddyfile:3"},
		{"a missing prices_file", "budget d {\nunit usd\nlimit 25.00\nwindow 720h\n}\nprices_file /nonexistent/prices.json", "prices_file: open /nonexistent/prices.json", "Caddyfile:8"},
		{"a budget defined twice after another", "budget d {\nunit usd\nlimit 25.00\nwindow 720h\n}\nprice m 1 2\nbudget e {\nunit tokens\nlimit 5\nwindow 1h\n}\nbudget d {\nunit tokens\nlimit 5\nwindow 1h\n}", `budget "d": defined twice`, "Caddyfile:14"},
		{"an option checked once the block is read", "budget b {\nunit tokens\nlimit 10\nwindow 1h\n}\nchat_cap_field max_tokens\ndefault_max_tokens 2000000", "default_max_tokens: must be between", "Caddyfile:9"},
		{"usd without a price", "budget d {\nunit usd\nlimit 25.00\nwindow 720h\n}", "a usd budget needs the price", ""},
		{"bad format", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nformat bedrock", `format "bedrock"`, "Caddyfile:8"},
		{"duplicate budget", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nbudget b {\nlimit 10\nwindow 1h\nunit tokens\n}", "defined twice", "Caddyfile:8"},
		{"ratelimit_scopes with an unknown scope", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nratelimit_scopes key galaxy", `ratelimit_scopes: "galaxy"`, "Caddyfile:8"},
		{"ratelimit_scopes with a repeat", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nratelimit_scopes key key", "key is listed twice", "Caddyfile:8"},
		{"ratelimit_scopes none with a scope", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nratelimit_scopes none key", `ratelimit_scopes: "none"`, "Caddyfile:8"},
		{"limit_for on a global budget", "budget b {\nlimit 10\nwindow 1h\nlimit_for team research 20\nunit tokens\n}", "limit_for team: the budget is kept per global", "Caddyfile:6"},
		{"limit_for of another scope", "budget b {\nscope key\nlimit 10\nwindow 1h\nlimit_for team research 20\nunit tokens\n}", "the budget is kept per key", "Caddyfile:7"},
		{"limit_for with an unknown scope", "budget b {\nscope team\nlimit 10\nwindow 1h\nlimit_for galaxy x 20\nunit tokens\n}", `limit_for "galaxy"`, "Caddyfile:7"},
		{"limit_for without its limit", "budget b {\nscope model\nlimit 10\nwindow 1h\nlimit_for model gpt-4o\nunit tokens\n}", "limit_for takes", "Caddyfile:7"},
		{"limit_for with a bad limit", "budget b {\nscope model\nlimit 10\nwindow 1h\nlimit_for model gpt-4o lots\nunit tokens\n}", `limit "lots" is not a number`, "Caddyfile:7"},
		{"limit_for a value twice", "budget b {\nscope model\nlimit 10\nwindow 1h\nlimit_for model gpt-4o 5\nlimit_for model gpt-4o 6\nunit tokens\n}", "given a limit twice", "Caddyfile:8"},
		{"limit_for a bad hash", "budget b {\nscope key\nlimit 10\nwindow 1h\nlimit_for key_hash sk-raw 5\nunit tokens\n}", "32 lowercase hex digits", "Caddyfile:7"},
		{"limit_for in dollars on a token budget", "budget b {\nscope model\nlimit 10\nwindow 1h\nlimit_for model gpt-4o 2.5\nunit tokens\n}", "whole number", "Caddyfile:7"},
		{"alert_at out of order", "budget b {\nlimit 10\nwindow 1h\nalert_at 95% 80%\nunit tokens\n}", `alert_at "80%"`, "Caddyfile:6"},
		{"alert_at over 100", "budget b {\nlimit 10\nwindow 1h\nalert_at 120%\nunit tokens\n}", `alert_at "120%"`, "Caddyfile:6"},
		{"alert_at empty", "budget b {\nlimit 10\nwindow 1h\nalert_at\nunit tokens\n}", "alert_at takes one or more", "Caddyfile:6"},
		{"alert_at twice", "budget b {\nlimit 10\nwindow 1h\nalert_at 80%\nalert_at 90%\nunit tokens\n}", "alert_at is set twice", "Caddyfile:7"},
		{"ratelimit_scopes twice", "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\nratelimit_scopes key\nratelimit_scopes team", "ratelimit_scopes is set twice", "Caddyfile:9"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + tt.block + "\n}\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
			if tt.at != "" && strings.Count(err.Error(), tt.at) != 1 {
				t.Fatalf("error %v, want the position %s once", err, tt.at)
			}
			if n := strings.Count(err.Error(), "Caddyfile:"); n != 1 {
				t.Fatalf("error %v names %d positions, want one", err, n)
			}
		})
	}
}

func TestLLMBudgetCapCaddyfile(t *testing.T) {
	const budgetBlock = "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\n"
	cfg, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + "chat_cap_field max_tokens\nmax_output_tokens 8192 refuse\n}\n}")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"chat_cap_field":"max_tokens"`, `"max_output_tokens":8192`, `"over_max_output_tokens":"refuse"`} {
		if !strings.Contains(string(cfg), want) {
			t.Errorf("adapted JSON lacks %s: %s", want, cfg)
		}
	}
	cfg, _, err = adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + "max_output_tokens 8192\n}\n}")
	if err != nil || strings.Contains(string(cfg), "over_max_output_tokens") || strings.Contains(string(cfg), "chat_cap_field") {
		t.Errorf("defaults are left out of the adapted JSON: %s %v", cfg, err)
	}

	refusals := []struct{ name, lines, want string }{
		{"chat_cap_field twice", "chat_cap_field max_tokens\nchat_cap_field max_tokens", "set twice"},
		{"chat_cap_field unknown", "chat_cap_field max_new_tokens", `"max_new_tokens": want max_completion_tokens or max_tokens`},
		{"chat_cap_field without a value", "chat_cap_field", "chat_cap_field takes"},
		{"max_output_tokens twice", "max_output_tokens 10\nmax_output_tokens 20", "set twice"},
		{"max_output_tokens 0", "max_output_tokens 0", "not a whole number above 0"},
		{"max_output_tokens over the largest cap", "max_output_tokens 1000001", "between 1 and 1000000"},
		{"max_output_tokens unknown mode", "max_output_tokens 10 truncate", `"truncate": want lower or refuse`},
		{"max_output_tokens extra words", "max_output_tokens 10 refuse now", "takes <n> [lower|refuse]"},
		{"max_output_tokens without n", "max_output_tokens", "takes <n> [lower|refuse]"},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + tt.lines + "\n}\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func TestLLMBudgetLeaseCaddyfile(t *testing.T) {
	const budgetBlock = "budget b {\nlimit 10\nwindow 1h\nunit tokens\n}\n"
	cfg, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + "output_leases off\noutput_lease_min 512\nreasoning_models o3* *reasoner*\n}\n}")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"output_leases":false`, `"output_lease_min":512`, `"reasoning_models":["o3*","*reasoner*"]`} {
		if !strings.Contains(string(cfg), want) {
			t.Errorf("adapted JSON lacks %s: %s", want, cfg)
		}
	}
	refusals := []struct{ name, lines, want string }{
		{"output_leases twice", "output_leases on\noutput_leases off", "set twice"},
		{"output_leases unknown", "output_leases maybe", "output_leases takes on or off"},
		{"output_lease_min negative", "output_lease_min -1", "output_lease_min: must be between 1 and 1000000"},
		{"output_lease_min not a number", "output_lease_min lots", `output_lease_min: "lots" is not an integer`},
		{"reasoning_models empty", "reasoning_models", "reasoning_models takes one or more model patterns"},
		{"tokenizer without patterns", "tokenizer o200k_base", "tokenizer takes a vocabulary"},
		{"proxy_tokenizer without patterns", "proxy_tokenizer cl100k_base", "proxy_tokenizer takes a vocabulary"},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + tt.lines + "\n}\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
	for lines, want := range map[string]string{
		"tokenizer o200k_base my-gpt* house-*\ntokenizer cl100k_base legacy-*": `"tokenizers":{"cl100k_base":["legacy-*"],"o200k_base":["my-gpt*","house-*"]}`,
		"tokenizer off": `"tokenizers":{}`,
		"proxy_tokenizer o200k_base claude-*\nproxy_tokenizer cl100k_base llama*": `"proxy_tokenizers":{"cl100k_base":["llama*"],"o200k_base":["claude-*"]}`,
		"proxy_tokenizer off": `"proxy_tokenizers":{}`,
	} {
		cfg, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + budgetBlock + lines + "\n}\n}")
		if err != nil || !strings.Contains(string(cfg), want) {
			t.Errorf("%q: %v, adapted JSON lacks %s: %s", lines, err, want, cfg)
		}
	}
}

// Which vocabulary counts which model: OpenAI's by default, through a
// router's prefix too, o200k as a proxy for others; a tokenizers table
// replaces the default, an empty one turns counting off, an unknown
// vocabulary is refused.
func TestModelsAreCountedByTheirOwnTokenizer(t *testing.T) {
	type counted struct {
		v     bpe.Vocabulary
		proxy bool
	}
	h := &LLMBudget{}
	if err := h.compileTokenizers(); err != nil {
		t.Fatal(err)
	}
	own, proxied := func(v bpe.Vocabulary) counted { return counted{v, false} }, counted{bpe.O200k, true}
	for model, want := range map[string]counted{
		"gpt-4o": own(bpe.O200k), "gpt-4o-mini-2024-07-18": own(bpe.O200k), "openai/gpt-4.1-nano": own(bpe.O200k), "GPT-5": own(bpe.O200k),
		"o3-mini": own(bpe.O200k), "chatgpt-4o-latest": own(bpe.O200k), "ft:gpt-4o-mini:acme::x1": own(bpe.O200k),
		"gpt-4": own(bpe.Cl100k), "gpt-4-turbo": own(bpe.Cl100k), "gpt-3.5-turbo-0125": own(bpe.Cl100k),
		"claude-sonnet-4-5": proxied, "gemini-2.5-pro": proxied, "llama3": proxied,
	} {
		if v, proxy := h.tokenizerOf(model); (counted{v, proxy}) != want {
			t.Errorf("%s: %v (proxy %v), want %v", model, v, proxy, want)
		}
	}
	h.Tokenizers, h.ProxyTokenizers = map[string][]string{"cl100k_base": {"house-*"}}, map[string][]string{}
	if err := h.compileTokenizers(); err != nil {
		t.Fatal(err)
	}
	if v, _ := h.tokenizerOf("house-7b"); v != bpe.Cl100k {
		t.Errorf("a table of its own: house-7b %v", v)
	}
	if v, _ := h.tokenizerOf("gpt-4o"); v != 0 {
		t.Errorf("a table of its own: gpt-4o %v", v)
	}
	h.Tokenizers, h.ProxyTokenizers = map[string][]string{}, map[string][]string{"cl100k_base": {"claude-*"}}
	if err := h.compileTokenizers(); err != nil {
		t.Fatal(err)
	}
	if v, proxy := h.tokenizerOf("gpt-4o"); v != 0 || proxy {
		t.Errorf("an empty table: gpt-4o %v", v)
	}
	if v, proxy := h.tokenizerOf("claude-opus-4"); v != bpe.Cl100k || !proxy {
		t.Errorf("a proxy table of its own: claude-opus-4 %v (proxy %v)", v, proxy)
	}
	h.Tokenizers = map[string][]string{"p50k_base": {"x"}}
	if err := h.compileTokenizers(); err == nil || !strings.Contains(err.Error(), `tokenizers: unknown vocabulary "p50k_base"`) {
		t.Errorf("an unknown vocabulary: %v", err)
	}
	h.Tokenizers, h.ProxyTokenizers = nil, map[string][]string{"p50k_base": {"x"}}
	if err := h.compileTokenizers(); err == nil || !strings.Contains(err.Error(), `proxy_tokenizers: unknown vocabulary "p50k_base"`) {
		t.Errorf("an unknown proxy vocabulary: %v", err)
	}
}

// The options of the ceiling, dollar denials and calendar windows, in the
// Caddyfile and as they adapt; each refusal names the field.
func TestLLMBudgetCeilingAndCalendarCaddyfile(t *testing.T) {
	const monthly = "budget m {\nunit usd\nlimit 500.00\nwindow month\ntimezone America/New_York\n}\nprice gpt-4o* 2.50 10.00\n"
	cfg, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + monthly + "hidden_input refuse\ncontext_window 200000\nsettle_wait 500ms\nusd_denial_status 402\n}\n}")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"calendar":"month"`, `"timezone":"America/New_York"`, `"hidden_input":"refuse"`, `"context_window":200000`, `"settle_wait":500000000`, `"usd_denial_status":402`} {
		if !strings.Contains(string(cfg), want) {
			t.Errorf("adapted JSON lacks %s: %s", want, cfg)
		}
	}
	refusals := []struct{ name, lines, want string }{
		{"a month written as a duration", "budget x {\nlimit 10\nwindow 1mo\nunit tokens\n}", `window "1mo": want a duration (24h) or day, week or month`},
		{"a timezone without a calendar", "budget x {\nlimit 10\nwindow 24h\ntimezone UTC\nunit tokens\n}", "timezone applies to a calendar window"},
		{"an unknown timezone", "budget x {\nlimit 10\nwindow day\ntimezone Mars/Olympus\nunit tokens\n}", `timezone "Mars/Olympus"`},
		{"hidden_input unknown", monthly + "hidden_input maybe", "hidden_input takes hold or refuse"},
		{"context_window not a number", monthly + "context_window big", `context_window: "big" is not an integer`},
		{"usd_denial_status other", monthly + "usd_denial_status 403", "usd_denial_status takes 429 or 402"},
		{"settle_wait twice", monthly + "settle_wait 1s\nsettle_wait 2s", "set twice"},
	}
	for _, tt := range refusals {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := adaptCaddyfile(":0 {\nllmbudget {\n" + tt.lines + "\n}\n}")
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}
