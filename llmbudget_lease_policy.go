package fleetguard

import (
	"cmp"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/fleetguard/fleetguard/budget/bpe"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// DefaultOutputLeaseMin is the smallest output lease, and the first one of a
// model with no history.
const DefaultOutputLeaseMin = 256

// DefaultReasoningModels are the model patterns that reason by default and
// bill reasoning tokens they do not stream: OpenAI's o-series and GPT-5,
// Gemini 2.5 and 3 (thinking on by default), xAI's Grok 3 mini and Grok 4, and
// any "thinking" model. A * matches any run of characters; a pattern matches
// the model as named or after its last "/" (openai/o3 via a router).
var DefaultReasoningModels = []string{"o1*", "o3*", "o4*", "gpt-5*", "codex-*", "gemini-2.5-*", "gemini-3*", "grok-3-mini*", "grok-4*", "*thinking*"}

// DefaultTokenizers are the models counted by their own public tokenizer
// by default, by vocabulary: OpenAI's, whose tokenizers are published
// (tiktoken). Anthropic's and Google's are not: their models count a token
// a byte.
var DefaultTokenizers = map[string][]string{
	"o200k_base": {"gpt-4o*", "chatgpt-4o*", "gpt-4.1*", "gpt-4.5*", "gpt-5*", "o1*", "o3*", "o4*",
		"ft:gpt-4o*", "ft:gpt-4.1*"},
	"cl100k_base": {"gpt-4", "gpt-4-*", "gpt-3.5-turbo*", "gpt-35-turbo*", "text-embedding-3*",
		"ft:gpt-4-*", "ft:gpt-3.5-turbo*"},
}

// DefaultProxyTokenizers are the models counted by another model's
// tokenizer, scaled to what they bill, by default: every model not counted
// by its own.
var DefaultProxyTokenizers = map[string][]string{"o200k_base": {"*"}}

// proxyCounter counts text for a model by another's tokenizer: its tokens,
// and half a token more for each byte outside ASCII. Tokenizers differ most
// on scripts other than Latin (cl100k bills CJK at twice o200k's count);
// the extra weight makes such text denser than any English answer, so a
// proxy taught by English answers does not count it at their scale (the
// density check of outputHistory.trusts), and one taught by such answers
// holds them with room to spare.
type proxyCounter struct{ c *bpe.Counter }

func (p proxyCounter) Count(text []byte) int64 {
	var wide int64
	for _, b := range text {
		if b >= 0x80 {
			wide++
		}
	}
	return p.c.Count(text) + wide/2
}

// tokenizerPatterns are the model patterns of one vocabulary.
type tokenizerPatterns struct {
	vocab    bpe.Vocabulary
	patterns []string
}

// compileTokenizers checks the tokenizers and proxy_tokenizers options.
func (h *LLMBudget) compileTokenizers() (err error) {
	if h.tokenizers, err = compileTokenizerTable("tokenizers", h.Tokenizers, DefaultTokenizers); err != nil {
		return err
	}
	h.proxyTokenizers, err = compileTokenizerTable("proxy_tokenizers", h.ProxyTokenizers, DefaultProxyTokenizers)
	return err
}

// compileTokenizerTable checks a table of vocabularies' model patterns
// (def when m is nil).
func compileTokenizerTable(field string, m, def map[string][]string) ([]tokenizerPatterns, error) {
	if m == nil {
		m = def
	}
	var table []tokenizerPatterns
	for name, patterns := range m {
		v, ok := bpe.ParseVocabulary(name)
		if !ok {
			return nil, fmt.Errorf("llmbudget: %s: unknown vocabulary %q (want o200k_base or cl100k_base)", field, name)
		}
		tp := tokenizerPatterns{vocab: v}
		for _, p := range patterns {
			if strings.TrimSpace(p) == "" {
				return nil, fmt.Errorf("llmbudget: %s: %s: a pattern is empty", field, name)
			}
			tp.patterns = append(tp.patterns, strings.ToLower(p))
		}
		table = append(table, tp)
	}
	// o200k_base first, whatever the map's order.
	slices.SortFunc(table, func(a, b tokenizerPatterns) int { return cmp.Compare(a.vocab, b.vocab) })
	return table, nil
}

// tokenizerOf is the vocabulary model is counted by (0: none), and whether
// it is a proxy's.
func (h *LLMBudget) tokenizerOf(model string) (v bpe.Vocabulary, proxy bool) {
	if len(h.tokenizers) == 0 && len(h.proxyTokenizers) == 0 {
		return 0, false
	}
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	if v := matchTokenizer(h.tokenizers, model, base); v != 0 {
		return v, false
	}
	v = matchTokenizer(h.proxyTokenizers, model, base)
	return v, v != 0
}

// matchTokenizer is the vocabulary of table whose pattern matches the model
// (lowercased) or its base name, or 0.
func matchTokenizer(table []tokenizerPatterns, model, base string) bpe.Vocabulary {
	for _, tp := range table {
		for _, p := range tp.patterns {
			if globMatch(p, model) || globMatch(p, base) {
				return tp.vocab
			}
		}
	}
	return 0
}

// compileLeases checks the lease options.
func (h *LLMBudget) compileLeases() error {
	h.outputLeases = h.OutputLeases == nil || *h.OutputLeases
	if h.OutputLeaseMin < 0 || h.OutputLeaseMin > usage.MaxOutputCap {
		return fmt.Errorf("llmbudget: output_lease_min: must be between 1 and %d", usage.MaxOutputCap)
	}
	h.outputLeaseMin = cmp.Or(h.OutputLeaseMin, DefaultOutputLeaseMin)
	h.reasoningModels = DefaultReasoningModels
	if h.ReasoningModels != nil {
		h.reasoningModels = make([]string, len(h.ReasoningModels))
		for i, p := range h.ReasoningModels {
			if strings.TrimSpace(p) == "" {
				return errors.New("llmbudget: reasoning_models: a pattern is empty")
			}
			h.reasoningModels[i] = strings.ToLower(p)
		}
	}
	return h.compileTokenizers()
}

// leasable reports whether the output of c can be leased: a single streamed
// answer whose every token the meter sees.
func (h *LLMBudget) leasable(r *http.Request, format usage.Format, c *call) bool {
	if !h.outputLeases || !c.req.Stream || c.req.N != 1 || c.req.NoOutput || c.req.Reasoning || c.outputCap <= h.outputLeaseMin {
		return false
	}
	switch format {
	case usage.Gemini:
		// Streamed as SSE only with alt=sse; else a JSON array the meter
		// does not read as it passes.
		return strings.EqualFold(r.URL.Query().Get("alt"), "sse") && !h.isReasoningModel(c.req.Model)
	case usage.OpenAIChat, usage.OpenAICompletions, usage.OpenAIResponses, usage.Anthropic, usage.Ollama:
		return !h.isReasoningModel(c.req.Model)
	}
	return false
}

func (h *LLMBudget) isReasoningModel(model string) bool {
	model = strings.ToLower(model)
	base := model[strings.LastIndexByte(model, '/')+1:]
	for _, p := range h.reasoningModels {
		if globMatch(p, model) || globMatch(p, base) {
			return true
		}
	}
	return false
}

// globMatch matches s against pattern, where * matches any run of
// characters (including none) and everything else matches itself.
func globMatch(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == s
	}
	if !strings.HasPrefix(s, parts[0]) {
		return false
	}
	s = s[len(parts[0]):]
	for _, part := range parts[1 : len(parts)-1] {
		i := strings.Index(s, part)
		if i < 0 {
			return false
		}
		s = s[i+len(part):]
	}
	return strings.HasSuffix(s, parts[len(parts)-1])
}
