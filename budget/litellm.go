package budget

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"strings"
)

// LiteLLM's model_prices_and_context_window.json prices each model in USD
// per token; the book keeps micro-dollars per one million tokens, so a
// per-token price is read as a decimal and multiplied by 10^12, exactly.
const perTokenToRate = 1_000_000_000_000

// liteLLMModes are the modes of the entries a price book keeps: the APIs
// llmbudget budgets. Entries of any other mode (image generation, audio,
// rerank, realtime...) or of none are skipped.
var liteLLMModes = map[string]bool{"chat": true, "completion": true, "responses": true, "embedding": true}

// liteLLMRates maps LiteLLM's per-token fields to the rate of a price they
// set. The long-context fields, which name their threshold
// ("input_cost_per_token_above_200k_tokens"), are read apart.
var liteLLMRates = map[string]func(p *Price) *int64{
	"input_cost_per_token":                      func(p *Price) *int64 { return &p.Input },
	"output_cost_per_token":                     func(p *Price) *int64 { return &p.Output },
	"cache_read_input_token_cost":               func(p *Price) *int64 { return &p.CacheRead },
	"cache_creation_input_token_cost":           func(p *Price) *int64 { return &p.CacheWrite },
	"cache_creation_input_token_cost_above_1hr": func(p *Price) *int64 { return &p.CacheWrite1h },
	"input_cost_per_audio_token":                func(p *Price) *int64 { return &p.AudioInput },
	"output_cost_per_audio_token":               func(p *Price) *int64 { return &p.AudioOutput },
	"output_cost_per_reasoning_token":           func(p *Price) *int64 { return &p.Reasoning },
	"input_cost_per_token_flex":                 func(p *Price) *int64 { return &p.Flex.Input },
	"output_cost_per_token_flex":                func(p *Price) *int64 { return &p.Flex.Output },
	"cache_read_input_token_cost_flex":          func(p *Price) *int64 { return &p.Flex.CacheRead },
	"input_cost_per_token_priority":             func(p *Price) *int64 { return &p.Priority.Input },
	"output_cost_per_token_priority":            func(p *Price) *int64 { return &p.Priority.Output },
	"cache_read_input_token_cost_priority":      func(p *Price) *int64 { return &p.Priority.CacheRead },
	"input_cost_per_token_batches":              func(p *Price) *int64 { return &p.Batch.Input },
	"output_cost_per_token_batches":             func(p *Price) *int64 { return &p.Batch.Output },
}

// liteLLMLongContext maps the long-context fields, their threshold
// ("_above_200k_tokens") cut off, to the long-context rate they set.
var liteLLMLongContext = map[string]func(r *Rates) *int64{
	"input_cost_per_token":                      func(r *Rates) *int64 { return &r.Input },
	"output_cost_per_token":                     func(r *Rates) *int64 { return &r.Output },
	"cache_read_input_token_cost":               func(r *Rates) *int64 { return &r.CacheRead },
	"cache_creation_input_token_cost":           func(r *Rates) *int64 { return &r.CacheWrite },
	"cache_creation_input_token_cost_above_1hr": func(r *Rates) *int64 { return &r.CacheWrite1h },
}

// ParseLiteLLM reads a price table in LiteLLM's
// model_prices_and_context_window.json format into a price book:
//
//   - an entry is kept when its mode is chat, completion, responses or
//     embedding, and it has input_cost_per_token (and output_cost_per_token,
//     but for embeddings): a price it does not give is unknown, not free;
//     "sample_spec" and values that are no object (a mirror's
//     "last_updated") are skipped;
//   - the fields read are those of liteLLMRates, the long-context ones
//     (<field>_above_<N>k_tokens: the whole request above N thousand prompt
//     tokens; of several thresholds, the lowest), search_context_cost_per_query
//     (its highest size, per web search call) and max_input_tokens; any
//     other field is ignored;
//   - a field read that is not a number >= 0 refuses the whole table, the
//     error naming the entry and the field.
//
// Names resolve as Find says: an entry of the book is a model name, never a
// prefix.
func ParseLiteLLM(data []byte) (*PriceBook, error) {
	var entries map[string]json.RawMessage
	if err := json.Unmarshal(data, &entries); err != nil {
		return nil, fmt.Errorf("not a LiteLLM price table (a JSON object of models): %w", err)
	}
	prices := make(map[string]Price, len(entries))
	for name, raw := range entries {
		if name == "sample_spec" || len(raw) == 0 || raw[0] != '{' {
			continue
		}
		p, keep, err := parseLiteLLMEntry(raw)
		if err != nil {
			return nil, fmt.Errorf("entry %q: %w", name, err)
		}
		if !keep {
			continue
		}
		if name == "" || strings.HasSuffix(name, "*") {
			return nil, fmt.Errorf("entry %q: a model name is required, without a trailing *", name)
		}
		prices[name] = p
	}
	return NewPriceBook(prices)
}

// parseLiteLLMEntry reads one model's entry: keep is false for an entry
// ParseLiteLLM skips.
func parseLiteLLMEntry(raw json.RawMessage) (p Price, keep bool, err error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		return p, false, fmt.Errorf("not an object: %w", err)
	}
	var mode string
	if m, ok := fields["mode"]; ok && string(m) != "null" {
		if err := json.Unmarshal(m, &mode); err != nil {
			return p, false, fmt.Errorf("field \"mode\": want a string: %w", err)
		}
	}
	if !liteLLMModes[mode] {
		return p, false, nil
	}
	_, hasInput := fields["input_cost_per_token"]
	_, hasOutput := fields["output_cost_per_token"]
	if !hasInput || !hasOutput && mode != "embedding" {
		return p, false, nil
	}
	var threshold int64
	for key, v := range fields {
		if string(v) == "null" {
			continue
		}
		if rate, ok := liteLLMRates[key]; ok {
			if *rate(&p), err = liteLLMNumber(key, v, perTokenToRate); err != nil {
				return p, false, err
			}
			continue
		}
		if base, n, ok := longContextField(key); ok && (threshold == 0 || n <= threshold) {
			if n < threshold {
				p.LongContext = Rates{} // a lower threshold's fields replace a higher one's
			}
			threshold = n
			if *liteLLMLongContext[base](&p.LongContext), err = liteLLMNumber(key, v, perTokenToRate); err != nil {
				return p, false, err
			}
			continue
		}
		if err := liteLLMExtra(&p, key, v); err != nil {
			return p, false, err
		}
	}
	if p.LongContext != (Rates{}) {
		p.LongContextAbove = threshold
	}
	if err := p.validate(); err != nil {
		return p, false, err
	}
	return p, true, nil
}

// liteLLMExtra reads an entry's field that is not a rate into p: the web
// search fee (the largest of its sizes') and the largest input.
func liteLLMExtra(p *Price, key string, v json.RawMessage) error {
	switch key {
	case "search_context_cost_per_query":
		var sizes map[string]json.RawMessage
		if err := json.Unmarshal(v, &sizes); err != nil {
			return fmt.Errorf("field %q: want an object of USD per query by context size: %w", key, err)
		}
		for size, fee := range sizes {
			f, err := liteLLMNumber(key+"."+size, fee, MicrosPerUSD)
			if err != nil {
				return err
			}
			p.WebSearchCall = max(p.WebSearchCall, f)
		}
	case "max_input_tokens":
		n, ok := new(big.Rat).SetString(string(v))
		if !ok || !n.IsInt() || n.Sign() < 0 || !n.Num().IsInt64() {
			return fmt.Errorf("field %q: %s is not a token count", key, v)
		}
		p.MaxInputTokens = n.Num().Int64()
	}
	return nil
}

// longContextField splits "<base>_above_<N>k_tokens" into base and N*1000,
// for a base of liteLLMLongContext.
func longContextField(key string) (base string, threshold int64, ok bool) {
	rest, ok := strings.CutSuffix(key, "k_tokens")
	if !ok {
		return "", 0, false
	}
	i := strings.LastIndex(rest, "_above_")
	if i < 0 {
		return "", 0, false
	}
	n, err := strconv.ParseInt(rest[i+len("_above_"):], 10, 32)
	if err != nil || n <= 0 {
		return "", 0, false
	}
	base = rest[:i]
	if _, ok := liteLLMLongContext[base]; !ok {
		return "", 0, false
	}
	return base, n * 1000, true
}

// liteLLMNumber reads a JSON number >= 0 times mul, rounded up, exactly.
func liteLLMNumber(field string, v json.RawMessage, mul int64) (int64, error) {
	s := string(v)
	if s == "" || !(s[0] == '-' || '0' <= s[0] && s[0] <= '9') {
		return 0, fmt.Errorf("field %q: %s is not a number", field, v)
	}
	n, err := decimalTimes(s, mul)
	if err != nil {
		return 0, fmt.Errorf("field %q: %w", field, err)
	}
	return n, nil
}
