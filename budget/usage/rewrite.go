package usage

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
)

// ChatCapField is the field an OpenAI chat request is given its output cap
// in when it names none.
type ChatCapField uint8

const (
	// MaxCompletionTokens is OpenAI's current field (its reasoning models
	// refuse max_tokens); OpenAI and vLLM read both.
	MaxCompletionTokens ChatCapField = iota
	// MaxTokens is the older field, the only one some OpenAI-compatible
	// servers read (Ollama's OpenAI-compatible API, llama.cpp's server
	// before February 2026, llamafile, llama-cpp-python). Against those a
	// request with only max_completion_tokens is unbounded, so it is given
	// max_tokens too.
	MaxTokens
)

func (c ChatCapField) String() string {
	if c == MaxTokens {
		return "max_tokens"
	}
	return "max_completion_tokens"
}

// ParseChatCapField reads a field name as String writes it.
func ParseChatCapField(s string) (ChatCapField, error) {
	for _, c := range []ChatCapField{MaxCompletionTokens, MaxTokens} {
		if s == c.String() {
			return c, nil
		}
	}
	return 0, fmt.Errorf("chat cap field %q: want max_completion_tokens or max_tokens", s)
}

// Rewrites says what Rewrite changes in a request body.
type Rewrites struct {
	// IncludeUsage sets stream_options.include_usage to true (an OpenAI
	// stream reports no usage without it), keeping the other stream options.
	IncludeUsage bool
	// OutputCap, when above 0, bounds what the upstream may write per
	// output: a request that names no cap in a field its API reads gets this
	// one, in the API's own field, and every cap field of the API that is
	// larger is lowered to it. Embeddings have no output: nothing changes.
	OutputCap int64
	// ChatCapField is the field an OpenAI chat request gets OutputCap in.
	ChatCapField ChatCapField
}

// Rewrite applies rw to body, a request of format f that ParseRequest
// accepted (so no field it writes is given twice or in another case). It
// splices the values it writes into the body and keeps every other byte as
// the client wrote it: key order, spacing, escapes, numbers. It returns body
// itself when nothing changes.
func Rewrite(f Format, body []byte, rw Rewrites) ([]byte, error) {
	top, err := parseObject(body)
	if err != nil {
		return nil, fmt.Errorf("rewriting the request: %w", err)
	}
	if rw.IncludeUsage {
		err = top.setNested(field{"stream_options"}, field{"include_usage"}, func(o *objectEdits, key string) error {
			if m, ok := o.find(field{"include_usage"}); ok {
				o.replace(m, []byte("true"))
			} else {
				o.add(key, []byte("true"))
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("rewriting the request: stream_options: %w", err)
		}
	}
	if rw.OutputCap > 0 {
		if c, ok := capFieldsOf(f, rw.ChatCapField); ok {
			if err := c.bound(top, rw.OutputCap); err != nil {
				return nil, fmt.Errorf("rewriting the request: %w", err)
			}
		}
	}
	return top.bytes(), nil
}

// capFields says where a format's output cap lives.
type capFields struct {
	// parent is the object that holds the cap fields; nil for the body.
	parent field
	// read are the fields the upstream reads a cap from: one of them given
	// bounds the output.
	read []field
	// lower are the fields lowered to the cap where larger: read, and for
	// chat the other cap field, which some upstreams read too.
	lower []field
	// write is the field a request without a cap is given.
	write field
	// positive is true where a value of 0 or less is no cap (Ollama's -1 is
	// unbounded, -2 fills the context).
	positive bool
}

var (
	maxTokensField           = field{"max_tokens"}
	maxCompletionTokensField = field{"max_completion_tokens"}
	responsesMaxOutputTokens = field{"max_output_tokens"}
	chatCapFields            = []field{maxCompletionTokensField, maxTokensField}
)

func capFieldsOf(f Format, chat ChatCapField) (capFields, bool) {
	switch f {
	case OpenAIChat:
		if chat == MaxTokens {
			return capFields{read: []field{maxTokensField}, lower: chatCapFields, write: maxTokensField}, true
		}
		return capFields{read: chatCapFields, lower: chatCapFields, write: maxCompletionTokensField}, true
	case OpenAICompletions, Anthropic:
		return capFields{read: []field{maxTokensField}, lower: []field{maxTokensField}, write: maxTokensField}, true
	case OpenAIResponses:
		fs := []field{responsesMaxOutputTokens}
		return capFields{read: fs, lower: fs, write: responsesMaxOutputTokens}, true
	case Gemini:
		fs := []field{geminiMaxOutputTokens}
		return capFields{parent: geminiConfig, read: fs, lower: fs, write: geminiMaxOutputTokens}, true
	case Ollama:
		fs := []field{ollamaNumPredict}
		return capFields{parent: ollamaOptions, read: fs, lower: fs, write: ollamaNumPredict, positive: true}, true
	}
	return capFields{}, false
}

func isField(name string) func(field) bool {
	return func(f field) bool { return f.name() == name }
}

// bound makes the body's cap at most limit, and gives it one if it has none.
func (c capFields) bound(top *objectEdits, limit int64) error {
	if c.parent == nil {
		return c.boundIn(top, limit, c.write.name())
	}
	return top.setNested(c.parent, c.write, func(o *objectEdits, key string) error { return c.boundIn(o, limit, key) })
}

// boundIn bounds the cap fields of o; writeKey is the spelling a missing cap
// is written in.
func (c capFields) boundIn(o *objectEdits, limit int64, writeKey string) error {
	value := strconv.AppendInt(nil, limit, 10)
	capped := false
	for _, f := range c.lower {
		m, ok := o.find(f)
		if !ok || o.isNull(m) {
			continue
		}
		var v int64
		if err := json.Unmarshal(o.value(m), &v); err != nil {
			return fmt.Errorf("%s: %w", m.key, err)
		}
		if c.positive && v <= 0 {
			continue
		}
		if slices.ContainsFunc(c.read, isField(f.name())) {
			capped = true
		}
		if v > limit {
			o.replace(m, value)
		}
	}
	if capped {
		return nil
	}
	if m, ok := o.find(c.write); ok { // null, or no cap (num_predict -1)
		o.replace(m, value)
	} else {
		o.add(writeKey, value)
	}
	return nil
}

// objectMember is a member of a JSON object: its key (decoded) and where its
// value lies in the object's bytes.
type objectMember struct {
	key        string
	start, end int
}

// objectEdits are changes to one JSON object, spliced into its bytes at
// once by bytes.
type objectEdits struct {
	b       []byte
	members []objectMember
	edits   []edit
}

// edit replaces b[start:end] with text (an insertion when start == end).
type edit struct {
	start, end int
	text       []byte
}

var errNotObject = errors.New("not a JSON object")

func parseObject(b []byte) (*objectEdits, error) {
	if i := skipSpace(b, 0); i >= len(b) || b[i] != '{' {
		return nil, errNotObject
	}
	o := &objectEdits{b: b}
	eachMember(b, func(key string, _, start, end int) bool {
		o.members = append(o.members, objectMember{key, start, end})
		return true
	})
	return o, nil
}

// find returns the member that gives f, in any of its spellings.
func (o *objectEdits) find(f field) (objectMember, bool) {
	for _, m := range o.members {
		if slices.Contains(f, m.key) {
			return m, true
		}
	}
	return objectMember{}, false
}

func (o *objectEdits) value(m objectMember) []byte { return o.b[m.start:m.end] }

func (o *objectEdits) isNull(m objectMember) bool { return string(o.value(m)) == "null" }

func (o *objectEdits) replace(m objectMember, value []byte) {
	o.edits = append(o.edits, edit{m.start, m.end, value})
}

// add appends "key":value as the object's last member.
func (o *objectEdits) add(key string, value []byte) {
	closing := bytes.LastIndexByte(o.b, '}')
	var text []byte
	if len(o.members) > 0 || slices.ContainsFunc(o.edits, func(e edit) bool { return e.start == closing }) {
		text = append(text, ',')
	}
	text = strconv.AppendQuote(text, key)
	text = append(text, ':')
	o.edits = append(o.edits, edit{closing, closing, append(text, value...)})
}

// setNested lets set change the object the body gives as parent (in any of
// its spellings). A missing or null parent becomes an object holding what set
// adds. set gets the spelling of child that matches the parent's: a Gemini
// body that writes generation_config gets max_output_tokens.
func (o *objectEdits) setNested(parent, child field, set func(o *objectEdits, key string) error) error {
	m, ok := o.find(parent)
	spelling := 0
	if ok {
		spelling = min(slices.Index(parent, m.key), len(child)-1)
	}
	inner := []byte("{}")
	if ok && !o.isNull(m) {
		inner = o.value(m)
	}
	nested, err := parseObject(inner)
	if err != nil {
		return err
	}
	if err := set(nested, child[spelling]); err != nil {
		return err
	}
	switch {
	case len(nested.edits) == 0:
	case ok:
		o.replace(m, nested.bytes())
	default:
		o.add(parent.name(), nested.bytes())
	}
	return nil
}

// bytes is the object with its edits spliced in; the object itself when
// there are none.
func (o *objectEdits) bytes() []byte {
	if len(o.edits) == 0 {
		return o.b
	}
	edits := slices.Clone(o.edits)
	slices.SortStableFunc(edits, func(a, b edit) int { return a.start - b.start })
	size := len(o.b)
	for _, e := range edits {
		size += len(e.text) - (e.end - e.start)
	}
	out := make([]byte, 0, size)
	at := 0
	for _, e := range edits {
		out = append(out, o.b[at:e.start]...)
		out = append(out, e.text...)
		at = e.end
	}
	return append(out, o.b[at:]...)
}
