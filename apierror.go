package fleetguard

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/fleetguard/fleetguard/budget/usage"
)

// Errors are written in the shape of the API being called, so that each
// official SDK raises its own error class (RateLimitError for a 429, …) with
// the message, which names the budget:
//
//	OpenAI (and compatible servers, Ollama): {"error":{"type","code","message","param"}}
//	Anthropic: {"type":"error","error":{"type":"rate_limit_error","message"}}
//	Gemini:    {"error":{"code":429,"status":"RESOURCE_EXHAUSTED","message"}}

type openAIError struct {
	Error struct {
		Type    string  `json:"type"`
		Code    string  `json:"code"`
		Message string  `json:"message"`
		Param   *string `json:"param"`
	} `json:"error"`
}

type anthropicError struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
}

type geminiError struct {
	Error struct {
		Code    int    `json:"code"`
		Status  string `json:"status"`
		Message string `json:"message"`
	} `json:"error"`
}

// reject answers status with an error of the format's API; nothing is
// forwarded. errType and code are the OpenAI-style type and code; the
// message carries the code for APIs whose shape has no field for it.
func (h *LLMBudget) reject(w http.ResponseWriter, f usage.Format, status int, errType, code, message string) error {
	var v any
	switch f {
	case usage.Anthropic:
		var e anthropicError
		e.Type, e.Error.Type, e.Error.Message = "error", anthropicType(status), message+" ("+code+")"
		v = e
	case usage.Gemini:
		var e geminiError
		e.Error.Code, e.Error.Status, e.Error.Message = status, geminiStatus(status), message+" ("+code+")"
		v = e
	default:
		var e openAIError
		e.Error.Type, e.Error.Code, e.Error.Message = errType, code, message
		v = e
	}
	body, err := json.Marshal(v)
	if err != nil {
		return err
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, err = w.Write(body)
	return err
}

// anthropicType is the Anthropic error type of a status.
func anthropicType(status int) string {
	switch status {
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusPaymentRequired:
		return "billing_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return "request_too_large"
	case http.StatusServiceUnavailable:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// geminiStatus is the Google API status of an HTTP status.
func geminiStatus(status int) string {
	switch status {
	case http.StatusTooManyRequests, http.StatusPaymentRequired:
		return "RESOURCE_EXHAUSTED"
	case http.StatusNotFound:
		return "NOT_FOUND"
	case http.StatusServiceUnavailable:
		return "UNAVAILABLE"
	}
	if status >= 500 {
		return "INTERNAL"
	}
	return "INVALID_ARGUMENT"
}
