package usage

import (
	"fmt"
	"strings"
)

// Format is an LLM API wire format.
type Format uint8

const (
	// Unknown is a request fleetguard does not budget.
	Unknown Format = iota
	// OpenAIChat is OpenAI Chat Completions.
	OpenAIChat
	// OpenAIResponses is the OpenAI Responses API.
	OpenAIResponses
	// Anthropic is the Anthropic Messages API.
	Anthropic
)

func (f Format) String() string {
	switch f {
	case OpenAIChat:
		return "openai_chat"
	case OpenAIResponses:
		return "openai_responses"
	case Anthropic:
		return "anthropic"
	}
	return "unknown"
}

// ParseFormat reads a format name as String writes it.
func ParseFormat(s string) (Format, error) {
	for _, f := range []Format{OpenAIChat, OpenAIResponses, Anthropic} {
		if s == f.String() {
			return f, nil
		}
	}
	return Unknown, fmt.Errorf("format %q: want openai_chat, openai_responses or anthropic", s)
}

// FormatFromPath recognises the format by the request path's ending, so
// /v1/chat/completions and /openai/v1/chat/completions both match.
func FormatFromPath(path string) Format {
	path = strings.TrimSuffix(path, "/")
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return OpenAIChat
	case strings.HasSuffix(path, "/responses"):
		return OpenAIResponses
	case strings.HasSuffix(path, "/messages"):
		return Anthropic
	}
	return Unknown
}
