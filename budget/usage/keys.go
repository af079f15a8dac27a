package usage

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Go's encoding/json matches object keys to struct fields without regard to
// case and keeps the last of duplicate keys; upstream APIs match exact case.
// A body with "MODEL" next to "model", or "Max_Tokens" beside "max_tokens",
// would be priced and capped by one value and served by another. So every
// object whose fields the budget reads is checked first: a field that appears
// twice (in one spelling or two), or in another case than its own, makes the
// request ambiguous.

// ErrAmbiguous is the reason of a body with a field the budget reads given
// twice, in both its spellings, or in another case; it wraps ErrBadRequest.
var ErrAmbiguous = fmt.Errorf("%w: ambiguous request", ErrBadRequest)

// A field is one field the budget reads, by its spellings. Most fields have
// one; Gemini's have two, because Google's JSON API parses requests as proto
// JSON, which accepts a field's lowerCamel JSON name and its original
// snake_case proto name alike ("generationConfig" and "generation_config").
// A body that gives both spellings of one field is as ambiguous as one that
// gives a field twice: which one the upstream serves is not defined.
type field []string

// name is the field's canonical spelling, the one the budget writes.
func (f field) name() string { return f[0] }

// readFields are the fields the budget reads, per object.
var (
	topFields = []field{
		{"model"}, {"stream"}, {"stream_options"}, {"n"}, {"best_of"}, {"service_tier"},
		{"max_tokens"}, {"max_completion_tokens"}, {"max_output_tokens"},
		{"messages"}, {"input"}, {"instructions"}, {"system"}, {"tools"}, {"prompt"},
		{"contents"}, {"systemInstruction", "system_instruction"}, geminiConfig,
		ollamaOptions,
	}
	// nestedFields are keyed by the parent's canonical spelling.
	nestedFields = map[string][]field{
		"stream_options":   {{"include_usage"}},
		"generationConfig": {geminiMaxOutputTokens, {"candidateCount", "candidate_count"}},
		"options":          {ollamaNumPredict},
	}

	// The objects that hold Gemini's and Ollama's caps, and the cap fields
	// in them, which Rewrite writes too.
	geminiConfig          = field{"generationConfig", "generation_config"}
	geminiMaxOutputTokens = field{"maxOutputTokens", "max_output_tokens"}
	ollamaOptions         = field{"options"}
	ollamaNumPredict      = field{"num_predict"}
	// geminiPartFields are the keys of a Gemini part the prompt estimate
	// reads (a media part counts a fixed amount, whatever its bytes).
	geminiPartFields = []field{{"inlineData", "inline_data"}, {"fileData", "file_data"}}
)

// checkAmbiguous reports the first field the budget reads that body (a valid
// JSON object) gives twice, in two spellings, or in another case than its
// own, at the top or in one of the nested objects the budget reads.
func checkAmbiguous(body []byte) error {
	type member struct {
		key   string // as the body spells it
		value []byte
	}
	nested := make(map[string]member, 4)
	if bad := checkObject(body, topFields, func(f field, key string, value []byte) { nested[f.name()] = member{key, value} }); bad != "" {
		return ambiguous(bad, "")
	}
	for parent, fields := range nestedFields {
		if m := nested[parent]; len(m.value) > 0 {
			if bad := checkObject(m.value, fields, nil); bad != "" {
				return ambiguous(bad, strconv.Quote(m.key))
			}
		}
	}
	return nil
}

// checkObject returns the first key of obj that gives one of fields again
// (twice, or in its other spelling) or in another case than a spelling of
// its own, or "" when there is none. found, if set, is called with each
// field obj gives, its key and its raw value.
func checkObject(obj []byte, fields []field, found func(f field, key string, value []byte)) (bad string) {
	seen := make([]bool, len(fields))
	eachKey(obj, func(key string, value []byte) bool {
		i, exact := matchField(key, fields)
		if i < 0 {
			return true
		}
		if seen[i] || !exact {
			bad = key
			return false
		}
		seen[i] = true
		if found != nil {
			found(fields[i], key, value)
		}
		return true
	})
	return bad
}

// ambiguous is the error of key, given in the object named by where ("" for
// the body itself).
func ambiguous(key, where string) error {
	if where == "" {
		where = "the body"
	}
	return fmt.Errorf("%w: %s: key %q repeats a field (or its other spelling) or differs from it only in case; upstream APIs read keys by exact case", ErrAmbiguous, where, key)
}

// matchField returns the index of the field of fields that key names
// without regard to case (as encoding/json would match it), or -1, and
// whether key is exactly one of that field's spellings.
func matchField(key string, fields []field) (i int, exact bool) {
	for i, f := range fields {
		for _, spelling := range f {
			if strings.EqualFold(key, spelling) {
				return i, slices.Contains(f, key)
			}
		}
	}
	return -1, false
}

// eachKey calls fn with every key of the JSON object obj (already known to be
// valid JSON) and its raw value, until fn returns false. A value that is not
// an object has no keys.
func eachKey(obj []byte, fn func(key string, value []byte) bool) {
	eachMember(obj, func(key string, _, start, end int) bool { return fn(key, obj[start:end]) })
}

// eachMember is eachKey with the member given by where it lies in obj, for
// splicing: its key from keyStart, its value from start to end.
func eachMember(obj []byte, fn func(key string, keyStart, start, end int) bool) {
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return
	}
	i++
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] == '}' {
			return
		}
		if obj[i] == ',' {
			i++
			continue
		}
		keyStart, end := i, stringEnd(obj, i)
		key := decodeKey(obj[i:end])
		i = skipSpace(obj, end)
		i = skipSpace(obj, i+1) // the colon
		vEnd := valueEnd(obj, i)
		if !fn(key, keyStart, i, vEnd) {
			return
		}
		i = vEnd
	}
}

// decodeKey turns a JSON string token into its value; escapes count, since
// the upstream decodes them ("\u006dodel" is "model").
func decodeKey(tok []byte) string {
	if !strings.ContainsRune(string(tok), '\\') {
		return string(tok[1 : len(tok)-1])
	}
	var s string
	if json.Unmarshal(tok, &s) != nil {
		return ""
	}
	return s
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index after the string token starting at b[i] ('"').
func stringEnd(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(b)
}

// valueEnd returns the index after the JSON value starting at b[i].
func valueEnd(b []byte, i int) int {
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				i = stringEnd(b, i) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
		return len(b)
	}
	for ; i < len(b); i++ {
		switch b[i] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return i
		}
	}
	return i
}

// EachMember calls fn with each member of the JSON object obj (valid JSON),
// its key decoded and the member as written: `"key": value`.
func EachMember(obj []byte, fn func(key string, member []byte)) {
	eachMember(obj, func(key string, keyStart, _, end int) bool {
		fn(key, obj[keyStart:end])
		return true
	})
}
