package usage

// The strict bound of a stream's output tokens from its text. Every
// tokenizer the providers use (byte-level BPE: OpenAI's, Anthropic's, the
// Llama and Qwen families; SentencePiece with byte fallback: Gemini's,
// Gemma's) makes no token of less than one byte of text, so a text of n bytes
// is at most n tokens, whatever it holds: prose, digits, base64, emoji. The
// bound over-counts English prose about 4.3 times (o200k; measured in
// bench/tokenbound) and random base64 about 1.5 times; a model's history may
// shrink it on evidence (outputHistory, llmbudget_lease.go), never this function.
//
// What a bill adds to the visible text (an end-of-turn token, the framing of
// a tool call) is OutputOverheadTokens a stream at most.
const OutputOverheadTokens = 16

// OutputTokenBound bounds the output tokens of a stream that showed
// textBytes bytes of output text.
func OutputTokenBound(textBytes int64) int64 {
	return max(textBytes, 0) + OutputOverheadTokens
}
