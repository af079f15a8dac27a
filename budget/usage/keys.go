package usage

import (
	"encoding/json"
	"fmt"
	"strings"
)

// Go's encoding/json matches object keys to struct fields without regard to
// case and keeps the last of duplicate keys; upstream APIs match exact case.
// A body with "MODEL" next to "model", or "Max_Tokens" beside "max_tokens",
// would be priced and capped by one value and served by another. So every
// object whose fields the budget reads is checked first: a field that appears
// twice, or in another case than its own, makes the request ambiguous.

// ErrAmbiguous is the reason of a body with a field the budget reads given
// twice or in another case; it wraps ErrBadRequest.
var ErrAmbiguous = fmt.Errorf("%w: ambiguous request", ErrBadRequest)

// readFields are the fields the budget reads, per object.
var (
	topFields = []string{
		"model", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "max_output_tokens",
		"messages", "input", "instructions", "system", "tools", "prompt",
		"contents", "systemInstruction", "generationConfig", "options",
	}
	nestedFields = map[string][]string{
		"stream_options":   {"include_usage"},
		"generationConfig": {"maxOutputTokens", "candidateCount"},
		"options":          {"num_predict"},
	}
)

// checkAmbiguous reports the first field the budget reads that body (a valid
// JSON object) gives twice or in another case, at the top or in one of the
// nested objects the budget reads.
func checkAmbiguous(body []byte) error {
	var bad string
	nested := make(map[string][]byte, 4)
	eachKey(body, func(key string, value []byte) bool {
		if f, ok := matchField(key, topFields); ok {
			if _, again := nested[f]; again || key != f {
				bad = key
				return false
			}
			nested[f] = value
		}
		return true
	})
	if bad != "" {
		return ambiguous(bad, "")
	}
	for parent, fields := range nestedFields {
		value := nested[parent]
		if len(value) == 0 {
			continue
		}
		seen := make(map[string]bool, len(fields))
		eachKey(value, func(key string, _ []byte) bool {
			if f, ok := matchField(key, fields); ok {
				if seen[f] || key != f {
					bad = key
					return false
				}
				seen[f] = true
			}
			return true
		})
		if bad != "" {
			return ambiguous(bad, parent)
		}
	}
	return nil
}

func ambiguous(key, parent string) error {
	where := "the body"
	if parent != "" {
		where = `"` + parent + `"`
	}
	return fmt.Errorf("%w: %s: key %q repeats a field or differs from it only in case; upstream APIs read keys by exact case", ErrAmbiguous, where, key)
}

// matchField returns the field of fields that key names without regard to
// case (as encoding/json would match it).
func matchField(key string, fields []string) (string, bool) {
	for _, f := range fields {
		if strings.EqualFold(key, f) {
			return f, true
		}
	}
	return "", false
}

// eachKey calls fn with every key of the JSON object obj (already known to be
// valid JSON) and its raw value, until fn returns false. A value that is not
// an object has no keys.
func eachKey(obj []byte, fn func(key string, value []byte) bool) {
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
		end := stringEnd(obj, i)
		key := decodeKey(obj[i:end])
		i = skipSpace(obj, end)
		i = skipSpace(obj, i+1) // the colon
		vEnd := valueEnd(obj, i)
		if !fn(key, obj[i:vEnd]) {
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
