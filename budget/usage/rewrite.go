package usage

import (
	"bytes"
	"encoding/json"
	"fmt"
)

// WithIncludeUsage returns an OpenAI chat request body with
// stream_options.include_usage set to true, keeping every other field and
// stream option. Without it an OpenAI stream reports no usage at all.
func WithIncludeUsage(body []byte) ([]byte, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		return nil, fmt.Errorf("rewriting the request: %w", err)
	}
	opts := map[string]json.RawMessage{}
	if raw, ok := obj["stream_options"]; ok && !bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		if err := json.Unmarshal(raw, &opts); err != nil {
			return nil, fmt.Errorf("rewriting the request: stream_options: %w", err)
		}
	}
	opts["include_usage"] = json.RawMessage("true")
	var err error
	if obj["stream_options"], err = marshalNoEscape(opts); err != nil {
		return nil, err
	}
	return marshalNoEscape(obj)
}

// marshalNoEscape marshals without turning <, > and & into \u escapes, so
// the prompt text reaches the upstream as the client wrote it.
func marshalNoEscape(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}
