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
	// Gemini is Google's generateContent / streamGenerateContent API.
	Gemini
	// Ollama is Ollama's native /api/chat and /api/generate API.
	Ollama
)

func (f Format) String() string {
	switch f {
	case OpenAIChat:
		return "openai_chat"
	case OpenAIResponses:
		return "openai_responses"
	case Anthropic:
		return "anthropic"
	case Gemini:
		return "gemini"
	case Ollama:
		return "ollama"
	}
	return "unknown"
}

// ParseFormat reads a format name as String writes it.
func ParseFormat(s string) (Format, error) {
	for _, f := range []Format{OpenAIChat, OpenAIResponses, Anthropic, Gemini, Ollama} {
		if s == f.String() {
			return f, nil
		}
	}
	return Unknown, fmt.Errorf("format %q: want openai_chat, openai_responses, anthropic, gemini or ollama", s)
}

// FormatFromPath recognises the format by the request path's ending, so
// /v1/chat/completions and /openai/v1/chat/completions both match.
func FormatFromPath(path string) Format {
	path = strings.TrimSuffix(path, "/")
	switch {
	case strings.HasSuffix(path, ":generateContent") || strings.HasSuffix(path, ":streamGenerateContent"):
		return Gemini
	case strings.HasSuffix(path, "/api/chat") || strings.HasSuffix(path, "/api/generate"):
		return Ollama
	case strings.HasSuffix(path, "/chat/completions"):
		return OpenAIChat
	case strings.HasSuffix(path, "/responses"):
		return OpenAIResponses
	case strings.HasSuffix(path, "/messages"):
		return Anthropic
	}
	return Unknown
}

// geminiModel is the model named by a Gemini path such as
// /v1beta/models/gemini-2.5-flash:streamGenerateContent.
func geminiModel(path string) (model string, stream bool) {
	i := strings.LastIndex(path, "/models/")
	if i < 0 {
		return "", false
	}
	model, method, _ := strings.Cut(path[i+len("/models/"):], ":")
	return model, strings.HasPrefix(method, "streamGenerateContent")
}
