package usage

import (
	"fmt"
	"strings"
)

// The output each format streams: the members of its events that carry
// generated output. The meter counts them (tally.outputTextBytes) so that a
// stream cut before its usage report is charged for what it delivered, not
// for its prompt alone. A field an API starts to stream is one more line;
// the scanner reads the tables by readers generated from them, as
// hand-written readers would (a switch per object, not a lookup in a table
// per key), and go test ./budget/usage -run TestOutputReadersAreGenerated
// -update rewrites them (output_readers.go).
//
// A path names the objects a member is in, from the event's top, then the
// member: "a.b" is member b of object a, "a[].b" member b of each object of
// array a. "a|b" as the last step is one output under either name (servers
// moving from one name to the other send both): the larger counts, not the
// sum.
//
// An output member holding another type than its line says (a number for a
// text, a string where an object is) counts nothing, and the rest of the
// event is still read: a field the meter cannot read never hides the usage
// next to it.
var outputTables = [...][]outputLine{
	OpenAIChat: {
		{"choices[].delta.content", textField},
		// reasoning_content: DeepSeek and earlier vLLM; reasoning: vLLM,
		// OpenRouter, Groq, Ollama's OpenAI API.
		{"choices[].delta.reasoning_content|reasoning", textField},
		{"choices[].delta.refusal", textField},
		{"choices[].delta.tool_calls[].function.name", textField},
		{"choices[].delta.tool_calls[].function.arguments", textField},
		// The function calling that tool_calls superseded.
		{"choices[].delta.function_call.name", textField},
		{"choices[].delta.function_call.arguments", textField},
		{"choices[].delta.audio.transcript", textField},
	},
	OpenAICompletions: {
		{"choices[].text", textField},
	},
	OpenAIResponses: {
		// Every response.*.delta event: output_text, refusal,
		// reasoning_text, reasoning_summary_text, function_call_arguments,
		// custom_tool_call_input, mcp_call_arguments,
		// code_interpreter_call_code, audio_transcript.
		{"delta", textField},
		// Reasoning the model does not show, encrypted (output_item.done,
		// when the request includes it): the only trace of billed tokens.
		{"item.encrypted_content", opaqueField},
	},
	Anthropic: {
		// content_block_delta: text_delta, input_json_delta, thinking_delta,
		// signature_delta (the full thinking, encrypted, where the thinking
		// shown is a summary of what is billed).
		{"delta.text", textField},
		{"delta.partial_json", textField},
		{"delta.thinking", textField},
		{"delta.signature", opaqueField},
		// content_block_start: mostly empty, but a block may start with its
		// content; redacted_thinking comes whole, in data.
		{"content_block.text", textField},
		{"content_block.thinking", textField},
		{"content_block.data", opaqueField},
		{"content_block.name", textField},
		{"content_block.input", jsonField},
	},
	Gemini: {
		// Thought summaries are text parts too (thought: true).
		{"candidates[].content.parts[].text", textField},
		// The thoughts, encrypted: a trace of the thinking billed.
		{"candidates[].content.parts[].thoughtSignature", opaqueField},
		{"candidates[].content.parts[].functionCall.name", textField},
		{"candidates[].content.parts[].functionCall.args", jsonField},
		{"candidates[].content.parts[].executableCode.code", textField},
		// What ends a response: until then usageMetadata is a running
		// count (tally.add).
		{"candidates[].finishReason", endField},
		{"promptFeedback.blockReason", endField},
	},
	Ollama: {
		// /api/chat.
		{"message.content", textField},
		{"message.thinking", textField},
		{"message.tool_calls[].function.name", textField},
		{"message.tool_calls[].function.arguments", jsonField},
		// /api/generate.
		{"response", textField},
		{"thinking", textField},
	},
}

// outputLine is one line of a format's table.
type outputLine struct {
	path string
	kind outputKind
}

// outputKind is what a member of an output table holds.
type outputKind uint8

const (
	// textField is a string whose bytes (decoded) count as output.
	textField outputKind = iota + 1
	// jsonField is a value of any type whose bytes count as written: the
	// tool call arguments Gemini and Ollama send as an object.
	jsonField
	// endField is a string that, when not empty, says the response is
	// finished (tally.finished).
	endField
	// objectField and arrayField lead to the object, or the array of
	// objects, holding more of the table.
	objectField
	arrayField
	// opaqueField is a string that counts as output as a textField does,
	// but holds no text the model wrote (encrypted reasoning, a signature
	// of it): a token counter counts it a token a byte.
	opaqueField
)

// The tables compiled (outputNodes) are what the readers are generated
// from, what the event reader tells the top-level names by, and what the
// reference meter of the tests reads by.

// maxOutputNames bounds the names at the top of a table: an event keeps
// what each held (outputSum).
const maxOutputNames = 8

// maxOutputNameBytes bounds a name's length: the scanner decodes an escaped
// key into scanner.key for comparison.
const maxOutputNameBytes = len(scanner{}.key)

// outputNode is an object of a format's output table: the names of its
// members that hold output, or lead to it.
type outputNode struct {
	names  []string
	fields []outputField
	// groups are the indexes of the names of each "a|b" step.
	groups [][]int
	// lengths has bit n%64 set when a name is n bytes long: most keys at
	// the top of an event are no name, and are told by their length.
	lengths uint64
	// message and response are the indexes of those names at the top
	// (whose members the usage reader reads too), or -1.
	message, response int
}

// outputField is what the member of a name holds.
type outputField struct {
	kind outputKind
	node *outputNode // objectField and arrayField: the object(s) it leads to
}

// noOutput is the table of a format that streams no output (embeddings).
var noOutput = &outputNode{message: -1, response: -1}

// outputNodes is each format's table, compiled: its top object.
var outputNodes = compileOutputTables()

// outputOf is the top object of format f's table.
func outputOf(f Format) *outputNode {
	if int(f) < len(outputNodes) && outputNodes[f] != nil {
		return outputNodes[f]
	}
	return noOutput
}

// mayName reports whether key may be a name of n (its length is a name's).
func (n *outputNode) mayName(key []byte) bool { return n.lengths&(1<<(len(key)%64)) != 0 }

// index is the index of name among n's names, or -1.
func (n *outputNode) index(name string) int {
	for j, x := range n.names {
		if x == name {
			return j
		}
	}
	return -1
}

// outputSum adds up the output the members at the top of an event hold,
// the last of a repeated key counting.
type outputSum struct {
	held [maxOutputNames]int64 // per name
	sum  int64
	ends uint8 // bit j: name j's member ended the response
}

// set records what the member of name j holds.
func (o *outputSum) set(j int, text int64, end bool) {
	o.sum += text - o.held[j]
	o.held[j] = text
	o.ends = o.ends&^(1<<j) | uint8(btoi(end))<<j
}

// total is the output of the top of an event, n its table's top: the sum,
// but of each group of names only the largest.
func (o *outputSum) total(n *outputNode) int64 {
	sum := o.sum
	if len(n.groups) == 0 {
		return sum
	}
	for _, g := range n.groups {
		var all, largest int64
		for _, j := range g {
			all, largest = all+o.held[j], max(largest, o.held[j])
		}
		sum -= all - largest
	}
	return sum
}

// The top-level members the event reader reads for usage: a table may name
// message (as an object) and response (as a text), whose usage it reads
// too, but none of the others.
var (
	usageMembers        = []string{"type", "usage", "usageMetadata", "done", "prompt_eval_count", "eval_count"}
	usageAndOutputKinds = map[string]outputKind{"message": objectField, "response": textField}
)

func compileOutputTables() []*outputNode {
	nodes := make([]*outputNode, len(outputTables))
	for f, lines := range outputTables {
		if lines == nil {
			continue
		}
		top := &outputNode{}
		for _, l := range lines {
			if err := top.add(l.path, l.kind); err != nil {
				panic(fmt.Sprintf("usage: output table of %v: %q: %v", Format(f), l.path, err))
			}
		}
		if len(top.names) > maxOutputNames {
			panic(fmt.Sprintf("usage: output table of %v: more than %d names at the top", Format(f), maxOutputNames))
		}
		for j, name := range top.names {
			if kind, both := usageAndOutputKinds[name]; both && top.fields[j].kind != kind {
				panic(fmt.Sprintf("usage: output table of %v: %s: the usage reader reads it as kind %d only", Format(f), name, kind))
			}
			for _, u := range usageMembers {
				if name == u {
					panic(fmt.Sprintf("usage: output table of %v: %s is read for usage", Format(f), name))
				}
			}
			top.lengths |= 1 << (len(name) % 64)
		}
		top.message, top.response = top.index("message"), top.index("response")
		nodes[f] = top
	}
	return nodes
}

// add adds the member at path, holding kind, to the table whose top object
// is n.
func (n *outputNode) add(path string, kind outputKind) error {
	step, rest, nested := strings.Cut(path, ".")
	if !nested {
		if strings.HasSuffix(step, "[]") {
			return fmt.Errorf("an output member is a value, not an array of them")
		}
		var group []int
		for _, name := range strings.Split(step, "|") {
			j, err := n.member(name, kind)
			if err != nil {
				return err
			}
			group = append(group, j)
		}
		if len(group) > 1 {
			if kind != textField {
				return fmt.Errorf("only texts may be named as alternatives")
			}
			n.groups = append(n.groups, group)
		}
		return nil
	}
	if strings.Contains(step, "|") {
		return fmt.Errorf("only the last step may name alternatives")
	}
	name, isArray := strings.CutSuffix(step, "[]")
	lead := objectField
	if isArray {
		lead = arrayField
	}
	j, err := n.member(name, lead)
	if err != nil {
		return err
	}
	return n.fields[j].node.add(rest, kind)
}

// member returns the index of name in n, adding it as a member holding
// kind (with an object of its own, if it leads to one) the first time.
func (n *outputNode) member(name string, kind outputKind) (int, error) {
	if name == "" || len(name) > maxOutputNameBytes || strings.IndexFunc(name, notKeyRune) >= 0 {
		return 0, fmt.Errorf("name %q: want 1 to %d printable ASCII bytes, no quote or backslash", name, maxOutputNameBytes)
	}
	if j := n.index(name); j >= 0 {
		if n.fields[j].kind != kind || kind != objectField && kind != arrayField {
			return 0, fmt.Errorf("%s is named twice, or with two kinds", name)
		}
		return j, nil
	}
	f := outputField{kind: kind}
	if kind == objectField || kind == arrayField {
		f.node = &outputNode{message: -1, response: -1}
	}
	n.names, n.fields = append(n.names, name), append(n.fields, f)
	return len(n.names) - 1, nil
}

// notKeyRune reports whether r may not be in a name: a name is compared
// with keys as they are written, or as decodeASCII decodes them.
func notKeyRune(r rune) bool { return r < 0x20 || r > 0x7e || r == '"' || r == '\\' }
