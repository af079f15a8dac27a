// Package usage reads the LLM wire formats fleetguard budgets: what a request
// asks for (model, streaming, output cap, an estimate of its prompt tokens)
// and what a response reports it used.
//
// Formats: OpenAI Chat Completions (/v1/chat/completions), OpenAI Responses
// (/v1/responses) and Anthropic Messages (/v1/messages), and servers
// compatible with them.
package usage
