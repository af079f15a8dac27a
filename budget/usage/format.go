package usage

import (
	"fmt"
	"path"
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
	// OpenAIEmbeddings is OpenAI's /v1/embeddings: input only.
	OpenAIEmbeddings
	// OpenAICompletions is OpenAI's legacy /v1/completions.
	OpenAICompletions
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
	case OpenAIEmbeddings:
		return "openai_embeddings"
	case OpenAICompletions:
		return "openai_completions"
	}
	return "unknown"
}

// ParseFormat reads a format name as String writes it.
func ParseFormat(s string) (Format, error) {
	for _, f := range []Format{OpenAIChat, OpenAIResponses, Anthropic, Gemini, Ollama, OpenAIEmbeddings, OpenAICompletions} {
		if s == f.String() {
			return f, nil
		}
	}
	return Unknown, fmt.Errorf("format %q: want openai_chat, openai_responses, anthropic, gemini, ollama, openai_embeddings or openai_completions", s)
}

// FormatFromPath recognises the format by the request path's ending, so
// /v1/chat/completions and /openai/v1/chat/completions both match. It reads
// the normalized path (see NormalizePath), so a variant an upstream might
// still route (another case, a trailing "/." or space, ";params") is
// budgeted like the path it varies.
func FormatFromPath(p string) Format {
	p = NormalizePath(p)
	switch {
	case strings.HasSuffix(p, ":generatecontent") || strings.HasSuffix(p, ":streamgeneratecontent"):
		return Gemini
	case strings.HasSuffix(p, "/api/chat") || strings.HasSuffix(p, "/api/generate"):
		return Ollama
	case strings.HasSuffix(p, "/chat/completions"):
		return OpenAIChat
	case strings.HasSuffix(p, "/completions"):
		return OpenAICompletions
	case strings.HasSuffix(p, "/embeddings"):
		return OpenAIEmbeddings
	case strings.HasSuffix(p, "/responses"):
		return OpenAIResponses
	case strings.HasSuffix(p, "/messages"):
		return Anthropic
	}
	return Unknown
}

// NormalizePath is the form of a (decoded) request path that budgeting
// decides on: each segment without ";parameters" and surrounding spaces,
// cleaned of "." and ".." and repeated slashes, in lower case.
func NormalizePath(p string) string {
	if strings.ContainsAny(p, "; \t") {
		segs := strings.Split(p, "/")
		for i, s := range segs {
			s, _, _ = strings.Cut(s, ";")
			segs[i] = strings.TrimSpace(s)
		}
		p = strings.Join(segs, "/")
	}
	return strings.ToLower(path.Clean("/" + p))
}

// geminiModel is the model named by a Gemini path such as
// /v1beta/models/gemini-2.5-flash:streamGenerateContent, read from the
// normalized path, the one FormatFromPath recognised the format on: the
// upstream resolves "." and ".." before it routes, so
// /models/gemini-2.0-flash/../gemini-2.5-pro:generateContent is served, and
// priced, as gemini-2.5-pro. The model comes out in lower case: Google's
// model ids are lower case, so a variant in another case is either served as
// that model or not found, and in both cases budgeted as that model (a
// `model` budget cannot be stepped around by changing case).
func geminiModel(path string) (model string, stream bool) {
	p := NormalizePath(path)
	i := strings.LastIndex(p, "/models/")
	if i < 0 {
		return "", false
	}
	model, method, _ := strings.Cut(p[i+len("/models/"):], ":")
	return strings.TrimSpace(model), method == "streamgeneratecontent"
}

// azureDeployment is the deployment an Azure OpenAI path names,
// /openai/deployments/<name>/chat/completions (or /completions,
// /embeddings, /responses), read from the normalized path (in lower case, as
// Azure matches deployment names); "" for any other path.
func azureDeployment(path string) string {
	p := NormalizePath(path)
	i := strings.LastIndex(p, "/openai/deployments/")
	if i < 0 {
		return ""
	}
	name, _, more := strings.Cut(p[i+len("/openai/deployments/"):], "/")
	if !more {
		return ""
	}
	return name
}
