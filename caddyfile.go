package fleetguard

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/ratelimit"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("fleetguard", parseGlobalOption)
	httpcaddyfile.RegisterHandlerDirective("fleetlimit", parseFleetLimit)
	httpcaddyfile.RegisterDirectiveOrder("fleetlimit", httpcaddyfile.Before, "basic_auth")
	httpcaddyfile.RegisterHandlerDirective("llmbudget", parseLLMBudget)
	httpcaddyfile.RegisterDirectiveOrder("llmbudget", httpcaddyfile.After, "encode")
	// A `fleetguard { … }` block inside a site is a common slip: say where it
	// goes instead of Caddy's "unrecognized directive".
	httpcaddyfile.RegisterDirective("fleetguard", func(h httpcaddyfile.Helper) ([]httpcaddyfile.ConfigValue, error) {
		h.Next() // the directive: the error names its position
		return nil, h.Err("fleetguard is a global option: move the block into the global options block at the top of the Caddyfile ({ fleetguard { … } })")
	})
}

var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*FleetLimit)(nil)
	_ caddyfile.Unmarshaler = (*LLMBudget)(nil)
)

// parseGlobalOption parses the `fleetguard` global option into the app.
func parseGlobalOption(d *caddyfile.Dispenser, _ any) (any, error) {
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "fleetguard", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from Caddyfile tokens:
//
//	fleetguard {
//		redis          <url>
//		redis_cluster  <url>?addr=<host:port>&addr=…
//		redis_sentinel <url>?addr=<host:port>&master_name=<name>
//		prefix         <prefix>
//		sync_interval  <duration>
//		near_limit     on|off
//		max_instances  <n>
//	}
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the option name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		if seen[d.Val()] {
			return d.Errf("fleetguard: %s is set twice", d.Val())
		}
		seen[d.Val()] = true
		switch d.Val() {
		case "redis":
			if err := storeURLArg(d, &a.Redis); err != nil {
				return err
			}
		case "redis_cluster":
			if err := storeURLArg(d, &a.RedisCluster); err != nil {
				return err
			}
		case "redis_sentinel":
			if err := storeURLArg(d, &a.RedisSentinel); err != nil {
				return err
			}
		case "prefix":
			if !d.AllArgs(&a.Prefix) {
				return d.ArgErr()
			}
		case "sync_interval":
			dur, err := parseDurationArg(d)
			if err != nil {
				return fmt.Errorf("fleetguard: %w", err)
			}
			a.SyncInterval = dur
		case "near_limit":
			if !d.AllArgs(&a.NearLimit) {
				return d.ArgErr()
			}
			if a.NearLimit != "on" && a.NearLimit != "off" {
				return d.Errf("fleetguard: near_limit %q: want on or off", a.NearLimit)
			}
		case "max_instances":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > 64 {
				return d.Errf("fleetguard: max_instances %q: want a number from 1 to 64", v)
			}
			a.MaxInstances = n
		default:
			return d.Errf("fleetguard: unknown option %q (want redis, redis_cluster, redis_sentinel, prefix, sync_interval, near_limit or max_instances)", d.Val())
		}
	}
	return nil
}

// storeURLArg reads the one URL of a store option. Its error names the
// option and, unlike d.ArgErr, quotes no token: the URL may hold a password.
func storeURLArg(d *caddyfile.Dispenser, dst *string) error {
	name := d.Val()
	if !d.AllArgs(dst) {
		return d.Errf("fleetguard: %s takes one URL", name)
	}
	// Checked here too, so that a bad URL names its line.
	var err error
	switch name {
	case "redis":
		_, err = parseRedisURL(name, *dst, redis.ParseURL)
	case "redis_cluster":
		_, err = parseRedisURL(name, *dst, redis.ParseClusterURL)
	case "redis_sentinel":
		_, err = parseRedisURL(name, *dst, parseSentinelURL)
	}
	if err != nil {
		return d.Err(err.Error())
	}
	return nil
}

func parseFleetLimit(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	fl := new(FleetLimit)
	if err := fl.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return fl, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	fleetlimit {
//		zone <name> {
//			key      <placeholders>
//			events   <n>
//			window   <duration>
//			burst     <n>
//			precision <n>
//			max_keys  <n>
//		}
//		dry_run
//		error_body on|off
//		ratelimit_headers always|denied|off
//	}
func (h *FleetLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "zone":
			var name string
			if !d.Args(&name) {
				return d.Errf("fleetlimit: zone needs a name")
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			if _, dup := h.Zones[name]; dup {
				return d.Errf("fleetlimit: zone %q is defined twice", name)
			}
			z, err := parseZone(d, name)
			if err != nil {
				return err
			}
			if h.Zones == nil {
				h.Zones = make(map[string]*ZoneConfig)
			}
			h.Zones[name] = z
		case "dry_run":
			if d.NextArg() {
				return d.ArgErr()
			}
			if h.DryRun {
				return d.Errf("fleetlimit: dry_run is set twice")
			}
			h.DryRun = true
		case "error_body":
			if h.ErrorBody != nil {
				return d.Errf("fleetlimit: error_body is set twice")
			}
			var v string
			if !d.AllArgs(&v) || v != "on" && v != "off" {
				return d.Errf("fleetlimit: error_body takes on or off")
			}
			on := v == "on"
			h.ErrorBody = &on
		case "ratelimit_headers":
			if h.RateLimitHeaders != "" {
				return d.Errf("fleetlimit: ratelimit_headers is set twice")
			}
			if !d.AllArgs(&h.RateLimitHeaders) || (h.RateLimitHeaders != "always" && h.RateLimitHeaders != "denied" && h.RateLimitHeaders != "off") {
				return d.Errf("fleetlimit: ratelimit_headers takes always, denied or off")
			}
		default:
			return d.Errf("fleetlimit: unknown subdirective %q (want zone, dry_run, error_body or ratelimit_headers)", d.Val())
		}
	}
	if len(h.Zones) == 0 {
		return d.Err("fleetlimit: at least one zone is required")
	}
	return nil
}

func parseZone(d *caddyfile.Dispenser, name string) (*ZoneConfig, error) {
	z := new(ZoneConfig)
	seen := make(map[string]bool)
	lines := map[string]string{"": position(d)} // by field; "": the zone's
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		field := d.Val()
		if seen[field] {
			return nil, d.Errf("fleetlimit: zone %q: %s is set twice", name, field)
		}
		seen[field] = true
		lines[field] = position(d)
		switch field {
		case "key":
			if !d.AllArgs(&z.Key) {
				return nil, d.Errf("fleetlimit: zone %q: key takes one value", name)
			}
		case "events", "burst", "max_keys", "precision":
			n, err := parseIntArg(d)
			if err != nil {
				return nil, fmt.Errorf("fleetlimit: zone %q: %w", name, err)
			}
			switch field {
			case "events":
				z.Events = n
			case "burst":
				z.Burst = n
			case "precision":
				if n > ratelimit.MaxPrecision {
					return nil, d.Errf("fleetlimit: zone %q: precision must be between 1 and %d", name, ratelimit.MaxPrecision)
				}
				z.Precision = int(n)
			default:
				z.MaxKeys = n
			}
		case "window":
			dur, err := parseDurationArg(d)
			if err != nil {
				return nil, fmt.Errorf("fleetlimit: zone %q: %w", name, err)
			}
			z.Window = dur
		default:
			return nil, d.Errf("fleetlimit: zone %q: unknown subdirective %q (want key, events, window, burst, precision or max_keys)", name, field)
		}
	}
	if err := z.validate(name); err != nil {
		// The line of the field the error names, else the zone's.
		msg := strings.TrimPrefix(err.Error(), fmt.Sprintf("fleetlimit: zone %q: ", name))
		field, _, _ := strings.Cut(msg, " ")
		at, ok := lines[field]
		if !ok {
			at = lines[""]
		}
		return nil, fmt.Errorf("%w, at %s", err, at)
	}
	return z, nil
}

func parseLLMBudget(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	lb := new(LLMBudget)
	if err := lb.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return lb, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	llmbudget {
//		principal <placeholders>
//		team      <placeholders>
//		budget <name> {
//			scope  global|key|model|team
//			unit   tokens|usd
//			limit  <number>
//			limit_for <scope>|<scope>_hash <value> <number>
//			alert_at <percent>...
//			window <duration>|day|week|month
//			timezone <IANA zone>
//			missing_scope refuse|shared
//		}
//		price <model>[*] <input> <output> [<cached_input>] [cache_write <usd>] [cache_write_1h <usd>]
//			[audio <input> <output>] [long_context <above_tokens> <input> <output>]
//			[flex|priority|batch <input> <output>] [web_search <usd_per_call>]
//		prices_file <path>
//		deployment <name> <model>
//		provider           <litellm provider>
//		default_max_tokens <n>
//		max_request_body   <size>
//		format             openai_chat|openai_responses|anthropic|gemini|ollama
//		inject_stream_usage on|off
//		chat_cap_field     max_completion_tokens|max_tokens
//		max_output_tokens  <n> [lower|refuse]
//		output_leases      on|off
//		output_lease_min   <n>
//		reasoning_models   <pattern>...
//		tokenizer          <vocabulary> <pattern>... | off
//		proxy_tokenizer    <vocabulary> <pattern>... | off
//		hidden_input       hold|refuse
//		unknown_fields     hold|refuse
//		neutral_fields     <field>...
//		pass_upgrades      <path pattern>...
//		context_window     <n>
//		settle_wait        <duration>
//		ratelimit_scopes   key|team|model|global... | none
//		usd_denial_status  429|402
//		fail_open
//		shadow
//		store_timeout <duration>
//		max_retry_after <duration>
//		unknown_paths pass|deny
//	}
func (h *LLMBudget) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	lines := make(map[string]string) // what compile's errors name -> its line
	for d.NextBlock(0) {
		field := d.Val()
		noteLine(d, lines)
		parse, ok := llmBudgetOptions[field]
		if !ok {
			return d.Errf("llmbudget: unknown subdirective %q (want principal, team, budget, price, prices_file, deployment, provider, default_max_tokens, max_request_body, format, inject_stream_usage, chat_cap_field, max_output_tokens, output_leases, output_lease_min, reasoning_models, tokenizer, proxy_tokenizer, hidden_input, unknown_fields, neutral_fields, pass_upgrades, context_window, settle_wait, ratelimit_scopes, usd_denial_status, fail_open, shadow, store_timeout, max_retry_after or unknown_paths)", field)
		}
		if field != "budget" && field != "price" && field != "tokenizer" && field != "proxy_tokenizer" && field != "deployment" {
			if seen[field] {
				return d.Errf("llmbudget: %s is set twice", field)
			}
			seen[field] = true
		}
		if err := parse(h, d, field); err != nil {
			return err
		}
	}
	// Check now, for an error with a Caddyfile line: the line of the option
	// or budget it names, else the block's. compile fills in only
	// unexported state, so the adapted JSON stays as written.
	if err := h.compile(); err != nil {
		if at := lineOfError(err, lines); at != "" {
			return fmt.Errorf("%w, at %s", err, at)
		}
		return d.Err(err.Error())
	}
	return nil
}

// noteLine keeps the line of the subdirective at the cursor under the name
// compile's errors give it: `budget "<name>"`, `price "<model>"`,
// `deployment "<name>"`, or the option (its JSON name where that differs).
func noteLine(d *caddyfile.Dispenser, lines map[string]string) {
	key := d.Val()
	switch key {
	case "budget", "price", "deployment":
		if d.NextArg() {
			key += " " + strconv.Quote(d.Val())
			d.Prev() // back to the subdirective, for its parser
		}
	case "tokenizer", "proxy_tokenizer":
		key += "s"
	}
	lines[key] = position(d) // the last: a budget defined twice is wrong at its second
	if key == "max_output_tokens" {
		lines["over_max_output_tokens"] = position(d)
	}
}

// lineOfError is the line of what a compile error names after its
// "llmbudget: " ("" when it names nothing the block holds).
func lineOfError(err error, lines map[string]string) string {
	msg := strings.TrimPrefix(err.Error(), "llmbudget: ")
	best := ""
	for key := range lines {
		rest, ok := strings.CutPrefix(msg, key)
		if ok && (rest == "" || rest[0] == ':' || rest[0] == ' ') && len(key) > len(best) {
			best = key
		}
	}
	if best == "" {
		return ""
	}
	return lines[best]
}

// llmBudgetOptions parse each subdirective of llmbudget into h; field is
// the subdirective's name (several share a parser).
var llmBudgetOptions = map[string]func(h *LLMBudget, d *caddyfile.Dispenser, field string) error{
	"principal": stringOption(func(h *LLMBudget) *string { return &h.Principal }, "one value"),
	"team":      stringOption(func(h *LLMBudget) *string { return &h.Team }, "one value"),
	"format":    stringOption(func(h *LLMBudget) *string { return &h.Format }, "one value"),
	"budget": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		bc, err := parseBudget(d)
		if err != nil {
			return err
		}
		h.Budgets = append(h.Budgets, bc)
		return nil
	},
	"price": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		model, pc, err := parsePrice(d)
		if err != nil {
			return err
		}
		if _, dup := h.Prices[model]; dup {
			return d.Errf("llmbudget: price %q is defined twice", model)
		}
		if h.Prices == nil {
			h.Prices = make(map[string]PriceConfig)
		}
		h.Prices[model] = pc
		return nil
	},
	"prices_file": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if !d.AllArgs(&h.PricesFile) {
			return d.Errf("llmbudget: prices_file takes one path")
		}
		// Read here too (Provision reads it again), so that a file that is
		// missing or does not parse names this line.
		if _, err := loadPricesFile(h.PricesFile); err != nil {
			return d.Errf("llmbudget: prices_file: %v", err)
		}
		return nil
	},
	"deployment": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		var name, model string
		if !d.AllArgs(&name, &model) {
			return d.Errf("llmbudget: deployment takes <name> <model>")
		}
		key := strings.ToLower(name)
		for n := range h.Deployments {
			if strings.ToLower(n) == key {
				return d.Errf("llmbudget: deployment %q is defined twice", name)
			}
		}
		if h.Deployments == nil {
			h.Deployments = make(map[string]string)
		}
		h.Deployments[name] = model
		return nil
	},
	"default_max_tokens": intOption(func(h *LLMBudget) *int64 { return &h.DefaultMaxTokens }),
	"max_request_body": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		var s string
		if !d.AllArgs(&s) {
			return d.ArgErr()
		}
		size, err := humanize.ParseBytes(s)
		if err != nil || size == 0 || size > 1<<40 {
			return d.Errf("llmbudget: max_request_body: %q is not a size such as 16MiB", s)
		}
		h.MaxRequestBody = int64(size)
		return nil
	},
	"fail_open": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if d.NextArg() {
			return d.ArgErr()
		}
		h.FailOpen = true
		return nil
	},
	"shadow": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if d.NextArg() {
			return d.ArgErr()
		}
		h.Shadow = true
		return nil
	},
	"unknown_paths": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if !d.AllArgs(&h.UnknownPaths) || (h.UnknownPaths != "pass" && h.UnknownPaths != "deny") {
			return d.Errf("llmbudget: unknown_paths takes pass or deny")
		}
		return nil
	},
	"store_timeout":       parseLLMBudgetDuration,
	"max_retry_after":     parseLLMBudgetDuration,
	"inject_stream_usage": parseLLMBudgetSwitch,
	"output_leases":       parseLLMBudgetSwitch,
	"output_lease_min":    intOption(func(h *LLMBudget) *int64 { return &h.OutputLeaseMin }),
	"reasoning_models": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		h.ReasoningModels = d.RemainingArgs()
		if len(h.ReasoningModels) == 0 {
			return d.Errf("llmbudget: reasoning_models takes one or more model patterns (* matches any characters)")
		}
		return nil
	},
	"tokenizer":       parseLLMBudgetTokenizer,
	"proxy_tokenizer": parseLLMBudgetTokenizer,
	"hidden_input": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if !d.AllArgs(&h.HiddenInput) || h.HiddenInput != hiddenInputHold && h.HiddenInput != hiddenInputRefuse {
			return d.Errf("llmbudget: hidden_input takes hold or refuse")
		}
		return nil
	},
	"provider": stringOption(func(h *LLMBudget) *string { return &h.Provider }, "a provider as LiteLLM's price table names it (groq, mistral, openrouter, ...)"),
	"unknown_fields": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if !d.AllArgs(&h.UnknownFields) || h.UnknownFields != unknownFieldsHold && h.UnknownFields != unknownFieldsRefuse {
			return d.Errf("llmbudget: unknown_fields takes hold or refuse")
		}
		return nil
	},
	"neutral_fields": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if h.NeutralFields = d.RemainingArgs(); len(h.NeutralFields) == 0 {
			return d.Errf("llmbudget: neutral_fields takes one or more field names")
		}
		return nil
	},
	"pass_upgrades": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if h.PassUpgrades = d.RemainingArgs(); len(h.PassUpgrades) == 0 {
			return d.Errf("llmbudget: pass_upgrades takes one or more path patterns")
		}
		return nil
	},
	"usd_denial_status": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		n, err := parseIntArg(d)
		if err != nil {
			return fmt.Errorf("llmbudget: %w", err)
		}
		if n != http.StatusTooManyRequests && n != http.StatusPaymentRequired {
			return d.Errf("llmbudget: usd_denial_status takes 429 or 402")
		}
		h.USDDenialStatus = int(n)
		return nil
	},
	"settle_wait": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		wait, err := parseDurationArg(d)
		if err != nil {
			return fmt.Errorf("llmbudget: %w", err)
		}
		h.SettleWait = &wait
		return nil
	},
	"ratelimit_scopes": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if err := parseRateLimitScopes(d, h); err != nil {
			return err
		}
		return nil
	},
	"context_window": intOption(func(h *LLMBudget) *int64 { return &h.ContextWindow }),
	"chat_cap_field": stringOption(func(h *LLMBudget) *string { return &h.ChatCapField }, "max_completion_tokens or max_tokens"),
	"max_output_tokens": func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		args := d.RemainingArgs()
		if len(args) < 1 || len(args) > 2 {
			return d.Errf("llmbudget: max_output_tokens takes <n> [lower|refuse]")
		}
		n, err := strconv.ParseInt(args[0], 10, 64)
		if err != nil || n < 1 {
			return d.Errf("llmbudget: max_output_tokens: %q is not a whole number above 0", args[0])
		}
		h.MaxOutputTokens = n
		if len(args) == 2 {
			if args[1] != overMaxOutputLower && args[1] != overMaxOutputRefuse {
				return d.Errf("llmbudget: max_output_tokens %s %q: want lower or refuse", args[0], args[1])
			}
			h.OverMaxOutputTokens = args[1]
		}
		return nil
	},
}

// stringOption parses a subdirective of one value into the field of h that
// at names; usage says what it takes.
func stringOption(at func(h *LLMBudget) *string, usage string) func(*LLMBudget, *caddyfile.Dispenser, string) error {
	return func(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
		if !d.AllArgs(at(h)) {
			return d.Errf("llmbudget: %s takes %s", field, usage)
		}
		return nil
	}
}

// intOption parses a subdirective of one whole number into the field of h
// that at names.
func intOption(at func(h *LLMBudget) *int64) func(*LLMBudget, *caddyfile.Dispenser, string) error {
	return func(h *LLMBudget, d *caddyfile.Dispenser, _ string) error {
		n, err := parseIntArg(d)
		if err != nil {
			return fmt.Errorf("llmbudget: %w", err)
		}
		*at(h) = n
		return nil
	}
}

// parseLLMBudgetDuration reads store_timeout or max_retry_after.
func parseLLMBudgetDuration(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
	dur, err := parseDurationArg(d)
	if err != nil {
		return fmt.Errorf("llmbudget: %w", err)
	}
	if field == "store_timeout" {
		h.StoreTimeout = dur
	} else {
		h.MaxRetryAfter = dur
	}
	return nil
}

// parseLLMBudgetSwitch reads inject_stream_usage or output_leases: on or off.
func parseLLMBudgetSwitch(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
	var v string
	if !d.AllArgs(&v) || (v != "on" && v != "off") {
		return d.Errf("llmbudget: %s takes on or off", field)
	}
	on := v == "on"
	if field == "output_leases" {
		h.OutputLeases = &on
	} else {
		h.InjectStreamUsage = &on
	}
	return nil
}

// parseLLMBudgetTokenizer reads a tokenizer or proxy_tokenizer line.
func parseLLMBudgetTokenizer(h *LLMBudget, d *caddyfile.Dispenser, field string) error {
	// The first line replaces the default table; "off" empties it.
	table := &h.Tokenizers
	if field == "proxy_tokenizer" {
		table = &h.ProxyTokenizers
	}
	if err := parseTokenizerLine(d, field, table); err != nil {
		return err
	}
	return nil
}

// parseRateLimitScopes reads the scopes whose budgets RateLimit names, or
// none. Each is checked here, so the error points at the line.
func parseRateLimitScopes(d *caddyfile.Dispenser, h *LLMBudget) error {
	args := d.RemainingArgs()
	if len(args) == 1 && args[0] == "none" {
		h.RateLimitScopes = []string{}
		return nil
	}
	if len(args) == 0 {
		return d.Errf("llmbudget: ratelimit_scopes takes one or more of key, team, model and global, or none")
	}
	for i, a := range args {
		if _, err := budget.ParseScope(a); err != nil || a == "none" {
			return d.Errf("llmbudget: ratelimit_scopes: %q: want key, team, model or global (or none alone)", a)
		}
		if slices.Contains(args[:i], a) {
			return d.Errf("llmbudget: ratelimit_scopes: %s is listed twice", a)
		}
	}
	h.RateLimitScopes = args
	return nil
}

func parseBudget(d *caddyfile.Dispenser) (BudgetConfig, error) {
	var bc BudgetConfig
	if !d.Args(&bc.Name) {
		return bc, d.Errf("llmbudget: budget needs a name")
	}
	if d.NextArg() {
		return bc, d.ArgErr()
	}
	at := position(d) // the budget's line, for what it lacks
	var decimalLimit string
	seen := make(map[string]bool)
	var limitFor []limitForLine
	var err error
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		field := d.Val()
		if seen[field] && field != "limit_for" {
			return bc, d.Errf("llmbudget: budget %q: %s is set twice", bc.Name, field)
		}
		seen[field] = true
		switch field {
		case "alert_at":
			if bc.AlertAt, err = parseAlertAt(d, bc.Name); err != nil {
				return bc, err
			}
		case "limit_for":
			lf, err := parseLimitFor(d, bc.Name)
			if err != nil {
				return bc, err
			}
			limitFor = append(limitFor, lf)
		case "scope", "unit":
			if err := parseBudgetWord(d, &bc); err != nil {
				return bc, err
			}
		case "limit":
			if decimalLimit, err = parseBudgetLimit(d, &bc); err != nil {
				return bc, err
			}
		case "window":
			if err := parseBudgetWindow(d, &bc); err != nil {
				return bc, err
			}
		case "missing_scope":
			if !d.AllArgs(&bc.MissingScope) || bc.MissingScope != missingScopeRefuse && bc.MissingScope != missingScopeShared {
				return bc, d.Errf("llmbudget: budget %q: missing_scope takes refuse or shared", bc.Name)
			}
		case "timezone":
			if !d.AllArgs(&bc.Timezone) {
				return bc, d.Errf("llmbudget: budget %q: timezone takes an IANA zone name (America/New_York)", bc.Name)
			}
		default:
			return bc, d.Errf("llmbudget: budget %q: unknown subdirective %q (want scope, unit, limit, limit_for, alert_at, window, timezone or missing_scope)", bc.Name, field)
		}
	}
	return bc, finishBudget(&bc, seen, limitFor, at, decimalLimit)
}

// finishBudget checks what a budget's block says as a whole, once it is
// read: limit_for against the scope, what is required, a decimal limit
// (at is the budget's line, decimalLimit the limit's, "" if whole).
func finishBudget(bc *BudgetConfig, seen map[string]bool, limitFor []limitForLine, at, decimalLimit string) error {
	for _, lf := range limitFor {
		if scope := cmp.Or(bc.Scope, "global"); !strings.EqualFold(lf.scope, scope) {
			return fmt.Errorf("llmbudget: budget %q: limit_for %s: the budget is kept per %s, at %s", bc.Name, lf.scope, scope, lf.at)
		}
		bc.LimitFor = append(bc.LimitFor, lf.LimitForConfig)
	}
	// "limit 25.00" reads as 25 once adapted to JSON: a token budget of 25
	// that denies everything. Written with a decimal point, it was meant in
	// dollars.
	if decimalLimit != "" && !strings.EqualFold(bc.Unit, "usd") && seen["unit"] {
		return fmt.Errorf("llmbudget: budget %q: limit is written as a decimal, but the budget counts tokens: write `unit usd` for a dollar budget, or a whole number of tokens, at %s", bc.Name, decimalLimit)
	}
	for _, required := range []string{"unit", "limit", "window"} {
		if seen[required] {
			continue
		}
		if required == "unit" {
			return fmt.Errorf("llmbudget: budget %q: %s, at %s", bc.Name, errUnitRequired, at)
		}
		return fmt.Errorf("llmbudget: budget %q: %s is required, at %s", bc.Name, required, at)
	}
	// The rest is checked as the JSON config is: an error of a limit_for
	// line names that line, any other the budget's.
	if _, err := bc.compile(); err != nil {
		if lfe := (*limitForError)(nil); errors.As(err, &lfe) {
			return fmt.Errorf("llmbudget: budget %q: limit_for: %w, at %s", bc.Name, lfe.err, limitFor[lfe.i].at)
		}
		return fmt.Errorf("%w, at %s", err, at)
	}
	return nil
}

// parseBudgetWord reads a budget's scope or unit, checked here so that a
// bad one names its own line.
func parseBudgetWord(d *caddyfile.Dispenser, bc *BudgetConfig) error {
	field, dst, check := d.Val(), &bc.Scope, func(s string) error { _, err := budget.ParseScope(s); return err }
	if field == "unit" {
		dst, check = &bc.Unit, func(s string) error { _, err := budget.ParseUnit(s); return err }
	}
	if !d.AllArgs(dst) {
		return d.Errf("llmbudget: budget %q: %s takes one value", bc.Name, field)
	}
	if err := check(*dst); err != nil {
		return d.Errf("llmbudget: budget %q: %v", bc.Name, err)
	}
	return nil
}

// parseBudgetLimit reads a budget's limit, and returns its position when it
// is written with a decimal point or an exponent ("" otherwise).
func parseBudgetLimit(d *caddyfile.Dispenser, bc *BudgetConfig) (string, error) {
	var s string
	if !d.AllArgs(&s) {
		return "", d.ArgErr()
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return "", d.Errf("llmbudget: budget %q: limit %q is not a number", bc.Name, s)
	}
	if !(v > 0) {
		return "", d.Errf("llmbudget: budget %q: limit must be > 0", bc.Name)
	}
	bc.Limit = v
	if strings.ContainsAny(s, ".eE") {
		return position(d), nil
	}
	return "", nil
}

// parseBudgetWindow reads a budget's window: a duration, or a calendar day,
// week or month.
func parseBudgetWindow(d *caddyfile.Dispenser, bc *BudgetConfig) error {
	var s string
	if !d.AllArgs(&s) {
		return d.Errf("llmbudget: budget %q: window takes a duration, or day, week or month", bc.Name)
	}
	if _, err := budget.ParseCalendar(s); err == nil {
		bc.Calendar = strings.ToLower(s)
		return nil
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("llmbudget: budget %q: window %q: want a duration (24h) or day, week or month", bc.Name, s)
	}
	bc.Window = caddy.Duration(dur)
	return nil
}

// parseAlertAt reads `alert_at <percent>...`, each as 80% or 80, ascending.
func parseAlertAt(d *caddyfile.Dispenser, name string) ([]int, error) {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return nil, d.Errf("llmbudget: budget %q: alert_at takes one or more percentages of the limit (alert_at 80%% 95%%)", name)
	}
	out := make([]int, len(args))
	for i, a := range args {
		n, err := strconv.Atoi(strings.TrimSuffix(a, "%"))
		if err != nil || n < 1 || n > 100 || (i > 0 && n <= out[i-1]) {
			return nil, d.Errf("llmbudget: budget %q: alert_at %q: want whole percentages from 1%% to 100%%, ascending, each once", name, a)
		}
		out[i] = n
	}
	return out, nil
}

// limitForLine is a budget's limit_for line, checked against the budget's
// scope once the whole block is read.
type limitForLine struct {
	LimitForConfig
	scope, at string
}

// parseLimitFor reads `limit_for <scope>|<scope>_hash <value> <limit>`.
func parseLimitFor(d *caddyfile.Dispenser, name string) (limitForLine, error) {
	var word, value, limit string
	if !d.AllArgs(&word, &value, &limit) {
		return limitForLine{}, d.Errf("llmbudget: budget %q: limit_for takes <scope> <value> <limit>, or <scope>_hash <hash> <limit> (limit_for team research 2000)", name)
	}
	lf := limitForLine{at: position(d)}
	lf.scope = strings.TrimSuffix(word, "_hash")
	if _, err := budget.ParseScope(lf.scope); err != nil || lf.scope == "global" {
		return lf, d.Errf("llmbudget: budget %q: limit_for %q: want key, team or model (or key_hash, team_hash, model_hash)", name, word)
	}
	if lf.scope != word {
		lf.ValueHash = value
	} else {
		lf.Value = value
	}
	v, err := strconv.ParseFloat(limit, 64)
	if err != nil || !(v > 0) {
		return lf, d.Errf("llmbudget: budget %q: limit_for %s: limit %q is not a number > 0", name, word, limit)
	}
	lf.Limit = v
	return lf, nil
}

// position is where the dispenser's current token is, as Caddy's errors
// print it.
func position(d *caddyfile.Dispenser) string {
	return d.File() + ":" + strconv.Itoa(d.Line())
}

// priceSyntax is the price line's syntax, for its errors.
const priceSyntax = "price <model>[*] <input> <output> [<cached_input>] [cache_write <usd>] [cache_write_1h <usd>] [audio <input> <output>] [long_context <above_tokens> <input> <output>] [flex|priority|batch <input> <output>] [web_search <usd_per_call>] (USD per 1M tokens)"

// priceWordValues is how many values each keyword of a price line takes.
var priceWordValues = map[string]int{"cache_write": 1, "cache_write_1h": 1, "web_search": 1, "audio": 2, "flex": 2, "priority": 2, "batch": 2, "long_context": 3}

// parsePrice reads a price line: the model, input and output (and cached
// input) prices in USD per 1M tokens, then, each at most once, a keyword
// and its prices.
func parsePrice(d *caddyfile.Dispenser) (string, PriceConfig, error) {
	args := d.RemainingArgs()
	if len(args) < 3 {
		return "", PriceConfig{}, d.Errf("llmbudget: price takes %s", priceSyntax)
	}
	model := args[0]
	var pc PriceConfig
	var err error
	if pc.Input, err = priceNumber(d, model, "input", args[1]); err != nil {
		return "", pc, err
	}
	if pc.Output, err = priceNumber(d, model, "output", args[2]); err != nil {
		return "", pc, err
	}
	rest := args[3:]
	if len(rest) > 0 {
		if _, isNum := strconv.ParseFloat(rest[0], 64); isNum == nil {
			if pc.CachedInput, err = priceNumber(d, model, "cached_input", rest[0]); err != nil {
				return "", pc, err
			}
			rest = rest[1:]
		}
	}
	if err := parsePriceWords(d, model, rest, &pc); err != nil {
		return "", pc, err
	}
	return model, pc, nil
}

// priceNumber reads the price a of what (a field of model's price line).
func priceNumber(d *caddyfile.Dispenser, model, what, a string) (float64, error) {
	v, err := strconv.ParseFloat(a, 64)
	if err != nil || v < 0 || math.IsInf(v, 0) {
		return 0, d.Errf("llmbudget: price %q: %s: %q is not a price >= 0", model, what, a)
	}
	return v, nil
}

// parsePriceWords reads the keywords of a price line, and their values,
// into pc: each keyword at most once.
func parsePriceWords(d *caddyfile.Dispenser, model string, rest []string, pc *PriceConfig) error {
	seen := make(map[string]bool)
	for len(rest) > 0 {
		word := rest[0]
		n := priceWordValues[word]
		switch {
		case n == 0:
			return d.Errf("llmbudget: price %q: unknown word %q (want %s)", model, word, priceSyntax)
		case seen[word]:
			return d.Errf("llmbudget: price %q: %s is set twice", model, word)
		case len(rest) < n+1:
			return d.Errf("llmbudget: price %q: %s takes %d values (%s)", model, word, n, priceSyntax)
		}
		seen[word] = true
		vals := make([]float64, n)
		for i, a := range rest[1 : n+1] {
			if word == "long_context" && i == 0 {
				above, err := strconv.ParseInt(a, 10, 64)
				if err != nil || above < 1 {
					return d.Errf("llmbudget: price %q: long_context: %q is not a token count above 0", model, a)
				}
				pc.LongContextAbove = above
				continue
			}
			var err error
			if vals[i], err = priceNumber(d, model, word, a); err != nil {
				return err
			}
		}
		setPriceWord(pc, word, vals)
		rest = rest[n+1:]
	}
	return nil
}

// setPriceWord sets the prices of a price line's keyword.
func setPriceWord(pc *PriceConfig, word string, vals []float64) {
	switch word {
	case "cache_write":
		pc.CacheWrite = vals[0]
	case "cache_write_1h":
		pc.CacheWrite1h = vals[0]
	case "web_search":
		pc.WebSearch = vals[0]
	case "audio":
		pc.AudioInput, pc.AudioOutput = vals[0], vals[1]
	case "flex":
		pc.Flex = &TierPriceConfig{Input: vals[0], Output: vals[1]}
	case "priority":
		pc.Priority = &TierPriceConfig{Input: vals[0], Output: vals[1]}
	case "batch":
		pc.Batch = &TierPriceConfig{Input: vals[0], Output: vals[1]}
	case "long_context":
		pc.LongContext = &TierPriceConfig{Input: vals[1], Output: vals[2]}
	}
}

// parseIntArg reads the one integer argument of the option at the cursor.
// Its errors name the option and its position; callers add only their own
// context, never a second position.
func parseIntArg(d *caddyfile.Dispenser) (int64, error) {
	option := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return 0, d.Errf("%s takes one integer", option)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, d.Errf("%s: %q is not an integer", option, s)
	}
	return n, nil
}

// parseDurationArg reads the one duration argument of the option at the
// cursor, with errors like parseIntArg's.
func parseDurationArg(d *caddyfile.Dispenser) (caddy.Duration, error) {
	option := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return 0, d.Errf("%s takes one duration", option)
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, d.Errf("%s: %q is not a duration (e.g. 10s, 1h): %v", option, s, err)
	}
	return caddy.Duration(dur), nil
}

// parseTokenizerLine reads one tokenizer or proxy_tokenizer line into its
// table: a vocabulary and its model patterns, or off.
func parseTokenizerLine(d *caddyfile.Dispenser, field string, table *map[string][]string) error {
	args := d.RemainingArgs()
	if *table == nil {
		*table = map[string][]string{}
	}
	switch {
	case len(args) == 1 && args[0] == "off":
		clear(*table)
	case len(args) < 2:
		return d.Errf("llmbudget: %s takes a vocabulary (o200k_base or cl100k_base) and one or more model patterns, or off", field)
	default:
		(*table)[args[0]] = append((*table)[args[0]], args[1:]...)
	}
	return nil
}
