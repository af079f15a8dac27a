package usage

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
)

// ResponsesOutput keeps what a Responses stream has output so far, so that a
// stream cut at its lease ends with the response object it built, as OpenAI's
// own response.incomplete does: the SDKs replace what they accumulated with
// that object (its output becomes the answer's output_text). It keeps the
// response.created event, the events that add or finish output items and
// content parts, and the text of the deltas as it is escaped, at most
// maxResponsesKept bytes in all (past that the cut answer's output is
// what was kept). Observe is cheap on the deltas: a few byte searches, no
// decoding; the rest is decoded once, when a stream is cut.
type ResponsesOutput struct {
	created []byte
	events  [][]byte                // output_item.added|done, content_part.added|done
	texts   map[deltaKey]*deltaText // by output item, content part and kind
	kept    int
}

// maxResponsesKept bounds what a ResponsesOutput keeps.
const maxResponsesKept = 4 << 20

type deltaKey struct {
	output, content int
	kind            deltaKind
}

type deltaKind uint8

const (
	textDelta deltaKind = iota
	refusalDelta
	argumentsDelta
)

// deltaText is the text of one kind of delta of one output item, escaped.
type deltaText struct {
	itemID  []byte
	escaped []byte
}

var (
	typeTextDelta      = []byte(`"type":"response.output_text.delta"`)
	typeRefusalDelta   = []byte(`"type":"response.refusal.delta"`)
	typeArgumentsDelta = []byte(`"type":"response.function_call_arguments.delta"`)
	typeCreated        = []byte(`"type":"response.created"`)
	itemEvents         = [][]byte{[]byte(`"type":"response.output_item.added"`), []byte(`"type":"response.output_item.done"`),
		[]byte(`"type":"response.content_part.added"`), []byte(`"type":"response.content_part.done"`)}
)

// Observe keeps what ev, one event of the stream, adds to its output.
func (o *ResponsesOutput) Observe(ev []byte) {
	if o.kept+len(ev) > maxResponsesKept {
		return
	}
	kind := textDelta
	switch {
	case bytes.Contains(ev, typeTextDelta):
	case bytes.Contains(ev, typeRefusalDelta):
		kind = refusalDelta
	case bytes.Contains(ev, typeArgumentsDelta):
		kind = argumentsDelta
	case o.created == nil && bytes.Contains(ev, typeCreated):
		o.created = bytes.Clone(ev)
		o.kept += len(ev)
		return
	default:
		for _, t := range itemEvents {
			if bytes.Contains(ev, t) {
				o.events = append(o.events, bytes.Clone(ev))
				o.kept += len(ev)
				return
			}
		}
		return
	}
	delta, ok := stringAfter(ev, `"delta":"`)
	if !ok {
		return
	}
	key := deltaKey{output: intAfter(ev, `"output_index":`), content: intAfter(ev, `"content_index":`), kind: kind}
	if o.texts == nil {
		o.texts = make(map[deltaKey]*deltaText)
	}
	t := o.texts[key]
	if t == nil {
		t = &deltaText{}
		t.itemID, _ = stringAfter(ev, `"item_id":"`)
		t.itemID = bytes.Clone(t.itemID)
		o.texts[key] = t
	}
	t.escaped = append(t.escaped, delta...)
	o.kept += len(delta)
}

// stringAfter is the escaped value of the string whose opening quote ends
// prefix (`"key":"`), at its first place in ev. A quote and a colon with no
// space between only occur outside strings, so the place is a key's.
func stringAfter(ev []byte, prefix string) ([]byte, bool) {
	i := bytes.Index(ev, []byte(prefix))
	if i < 0 {
		return nil, false
	}
	start := i + len(prefix)
	for j := start; j < len(ev); j++ {
		switch ev[j] {
		case '\\':
			j++
		case '"':
			return ev[start:j], true
		}
	}
	return nil, false
}

// intAfter is the integer after prefix (`"key":`) in ev, 0 when there is none.
func intAfter(ev []byte, prefix string) int {
	i := bytes.Index(ev, []byte(prefix))
	if i < 0 {
		return 0
	}
	j := i + len(prefix)
	end := j
	for end < len(ev) && '0' <= ev[end] && ev[end] <= '9' {
		end++
	}
	n, _ := strconv.Atoi(string(ev[j:end]))
	return n
}

// response is the response object a cut stream ends with: the one
// response.created announced (a bare one if none), status incomplete, its
// output as far as it was streamed.
func (o *ResponsesOutput) response() map[string]any {
	var resp map[string]any
	if o != nil {
		resp, _ = eventObject(o.created)["response"].(map[string]any)
	}
	if resp == nil {
		resp = map[string]any{"object": "response"}
	}
	resp["status"] = "incomplete"
	resp["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
	resp["output"] = o.output()
	return resp
}

// output rebuilds the output items: as output_item.done gave them, or as
// output_item.added and content_part.added did with the text of their deltas,
// status incomplete.
func (o *ResponsesOutput) output() []any {
	if o == nil {
		return []any{}
	}
	items, done := o.itemsSeen()
	o.addTexts(items, done)
	indexes := make([]int, 0, len(items))
	for i, item := range items {
		if !done[i] {
			item["status"] = "incomplete"
		}
		indexes = append(indexes, i)
	}
	slices.Sort(indexes)
	out := make([]any, 0, len(indexes))
	for _, i := range indexes {
		out = append(out, items[i])
	}
	return out
}

// itemsSeen are the output items the events added and their content parts,
// by output index, and which of them are done.
func (o *ResponsesOutput) itemsSeen() (items map[int]map[string]any, done map[int]bool) {
	items, done = make(map[int]map[string]any), make(map[int]bool)
	for _, raw := range o.events {
		ev := eventObject(raw)
		index := intOf(ev["output_index"])
		switch ev["type"] {
		case "response.output_item.added", "response.output_item.done":
			if item, ok := ev["item"].(map[string]any); ok && !done[index] {
				items[index], done[index] = item, ev["type"] == "response.output_item.done"
			}
		case "response.content_part.added", "response.content_part.done":
			item := items[index]
			part, ok := ev["part"].(map[string]any)
			if item == nil || !ok || done[index] {
				continue
			}
			content, _ := item["content"].([]any)
			ci := intOf(ev["content_index"])
			for len(content) <= ci {
				content = append(content, nil)
			}
			content[ci] = part
			item["content"] = content
		}
	}
	return items, done
}

// addTexts puts the text, refusal and arguments deltas seen into the items
// not done, making the items and parts they name where none was added.
func (o *ResponsesOutput) addTexts(items map[int]map[string]any, done map[int]bool) {
	for key, t := range o.texts {
		var text string
		if json.Unmarshal(append(append([]byte{'"'}, t.escaped...), '"'), &text) != nil || done[key.output] {
			continue
		}
		item := items[key.output]
		if item == nil {
			item = map[string]any{"type": "message", "role": "assistant", "content": []any{}}
			if key.kind == argumentsDelta {
				item = map[string]any{"type": "function_call", "arguments": ""}
			}
			if len(t.itemID) > 0 {
				item["id"] = string(t.itemID)
			}
			items[key.output] = item
		}
		if key.kind == argumentsDelta {
			item["arguments"] = text
			continue
		}
		content, _ := item["content"].([]any)
		for len(content) <= key.content {
			content = append(content, nil)
		}
		content[key.content] = textPart(content[key.content], key.kind, text)
		item["content"] = content
	}
}

// textPart is part (a content part, or nil) with its text or refusal.
func textPart(part any, kind deltaKind, text string) map[string]any {
	p, _ := part.(map[string]any)
	if p == nil {
		p = map[string]any{"type": "output_text", "annotations": []any{}}
		if kind == refusalDelta {
			p = map[string]any{"type": "refusal"}
		}
	}
	if kind == refusalDelta {
		p["refusal"] = text
	} else {
		p["text"] = text
	}
	return p
}

// intOf is a decoded JSON number as an int (0 for anything else).
func intOf(v any) int {
	switch n := v.(type) {
	case int64:
		return int(n)
	case float64:
		return int(n)
	}
	return 0
}
