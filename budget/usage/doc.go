// Package usage reads the LLM wire formats fleetguard budgets: what a request
// asks for (model, streaming, output cap, an estimate of its prompt tokens)
// and what a response reports it used. Rewrite changes a request the way
// the budget needs before it is forwarded (its output cap, a stream's usage),
// splicing values into the client's bytes.
//
// Formats: OpenAI Chat Completions (/v1/chat/completions), OpenAI Responses
// (/v1/responses) and Anthropic Messages (/v1/messages), and servers
// compatible with them; Gemini and Ollama's native APIs.
//
// Responses and stream events are read by a byte scanner (scan.go): one pass
// per payload that validates it as encoding/json would, reads the few fields
// that carry usage or output by exact key case, and allocates nothing
// (IsUsageOnlyChunk joins an event's data lines when it has several). The
// fields that carry output are one table per format (output.go), from which
// the scanner's readers of them are generated (output_readers.go).
package usage
