package usage

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
)

// The scanner must read what the encoding/json reader before it read
// (reference_test.go), wherever keys are unambiguous: the meter, FromJSON
// and IsUsageOnlyChunk are compared with their references on the golden
// transcripts, on crafted payloads and under fuzzing.

// refNames are the keys the reference decodes into structs (the usage, and
// the choices of refIsUsageOnlyChunk), at any depth. (It reads the output
// tables' names by exact case, as the scanner does.)
var refNames = strings.Fields(`type usage message response usageMetadata choices
	promptTokenCount candidatesTokenCount thoughtsTokenCount cachedContentTokenCount
	done prompt_eval_count eval_count prompt_tokens completion_tokens
	prompt_tokens_details cached_tokens input_tokens output_tokens
	input_tokens_details cache_creation_input_tokens cache_read_input_tokens
	service_tier toolUsePromptTokenCount audio_tokens completion_tokens_details
	reasoning_tokens output_tokens_details cache_creation ephemeral_5m_input_tokens
	ephemeral_1h_input_tokens server_tool_use web_search_requests
	promptTokensDetails modality tokenCount`)

// ambiguousJSON reports whether the JSON text data (after the reference's
// TrimSpace) has an object with a key given twice (in any case), or a key
// that differs from a name the reference reads only in case. There
// encoding/json (case-insensitive, merging repeats) and the scanner (exact
// case, the last repeat counting) read differently, by design.
func ambiguousJSON(data []byte) bool {
	data = bytes.TrimSpace(data)
	if !json.Valid(data) {
		return false
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	type frame struct {
		object  bool
		keys    []string
		wantKey bool
	}
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		if key, ok := tok.(string); ok && top != nil && top.object && top.wantKey {
			for _, k := range top.keys {
				if strings.EqualFold(k, key) {
					return true
				}
			}
			for _, name := range refNames {
				if strings.EqualFold(name, key) && name != key {
					return true
				}
			}
			top.keys = append(top.keys, key)
			top.wantKey = false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &frame{object: true, wantKey: true})
			continue
		case json.Delim('['):
			stack = append(stack, &frame{})
			continue
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
		}
		if len(stack) > 0 && stack[len(stack)-1].object {
			stack[len(stack)-1].wantKey = true
		}
	}
}

// refMeterRead runs a stream through the reference meter in the given
// chunks; ambiguous as ambiguousJSON says of any payload.
func refMeterRead(f Format, framing Framing, chunks ...[]byte) (r Reading, ambiguous bool) {
	m := newRefMeter(f, framing)
	m.checkAmbiguity = true
	for _, c := range chunks {
		m.Write(c)
	}
	m.Close()
	return m.Reading(), m.ambiguous
}

// payloads exercise the scanner's corners: escapes, Unicode, numbers, nulls,
// a wrong type in each field read, nesting, whitespace.
var payloads = []string{
	`{"choices":[{"delta":{"content":"a\"b\\c\/d\b\f\n\r\t"}}]}`,
	`{"choices":[{"delta":{"content":"\u00e9\u4e16\ud83d\ude00\ud83d\u0041\udc00x\ud800"}}]}`,
	"{\"choices\":[{\"delta\":{\"content\":\"caf\xc3\xa9 \xff\xfe \xed\xa0\x80 \xef\xbf\xbd\"}}]}",
	`{"choices":[{"delta":{"content":"\u0000\u007f\u0080\u07ff\u0800\uffff"}}]}`,
	`{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":1.5}}`,
	`{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":1e3}}`,
	`{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":9223372036854775807,"completion_tokens":-9223372036854775808}}`,
	`{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":9223372036854775808}}`,
	`{"choices":[{"delta":{"content":"ok"}}],"usage":{"prompt_tokens":-0,"completion_tokens":00}}`,
	`{"choices":[],"usage":{"prompt_tokens":null,"completion_tokens":null,"input_tokens":4}}`,
	`{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}`,
	`{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":null}}}`,
	`{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":"2"}}}`,
	`{"choices":[],"usage":{"prompt_tokens":3,"prompt_tokens_details":[]}}`,
	`{"choices":[],"usage":[]}`,
	`{"choices":[],"service_tier":"priority","usage":{"prompt_tokens":30,"prompt_tokens_details":{"cached_tokens":10,"audio_tokens":12},"completion_tokens":9,"completion_tokens_details":{"reasoning_tokens":4,"audio_tokens":3}}}`,
	`{"choices":[],"service_tier":"fl\u0065x","usage":{"prompt_tokens":30,"prompt_tokens_details":{"audio_tokens":"12"}}}`,
	`{"choices":[],"service_tier":null,"usage":{"prompt_tokens":30,"completion_tokens_details":{"reasoning_tokens":null,"audio_tokens":[]}}}`,
	`{"choices":[],"service_tier":7,"usage":{"prompt_tokens":30,"completion_tokens_details":[]}}`,
	`{"choices":[],"service_tier":"\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9","usage":{"prompt_tokens":3}}`,
	`{"service_tier":"flex","usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":10},"output_tokens":87,"output_tokens_details":{"reasoning_tokens":64}}}`,
	`{"type":"response.completed","response":{"service_tier":"priority","usage":{"input_tokens":36,"output_tokens":87,"output_tokens_details":{"reasoning_tokens":"x"}}}}`,
	`{"type":"response.completed","response":{"service_tier":"flex","usage":"x"}}`,
	`{"type":"response.created","response":{"service_tier":"priority"}}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_creation_input_tokens":3000,"cache_creation":{"ephemeral_5m_input_tokens":1000,"ephemeral_1h_input_tokens":2000},"output_tokens":1}}}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_creation":{"ephemeral_5m_input_tokens":1000,"ephemeral_1h_input_tokens":9000}}}}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_creation_input_tokens":10,"cache_creation":{"ephemeral_1h_input_tokens":90}}}}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_creation":{"ephemeral_1h_input_tokens":-9}}}}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_creation":[1]}}}`,
	`{"type":"message_delta","usage":{"output_tokens":70,"server_tool_use":{"web_search_requests":2}}}`,
	`{"type":"message_delta","usage":{"output_tokens":70,"server_tool_use":{"web_search_requests":null}}}`,
	`{"type":"message_delta","usage":{"output_tokens":70,"server_tool_use":{"web_search_requests":1.5}}}`,
	`{"usage":{"input_tokens":9,"output_tokens":70,"cache_read_input_tokens":5,"server_tool_use":{"web_search_requests":3,"web_fetch_requests":1},"service_tier":"standard"}}`,
	`{"usageMetadata":{"promptTokenCount":12,"toolUsePromptTokenCount":20000,"candidatesTokenCount":1,"thoughtsTokenCount":30}}`,
	`{"usageMetadata":{"promptTokenCount":12,"toolUsePromptTokenCount":"2"}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[{"modality":"TEXT","tokenCount":1000},{"modality":"AUDIO","tokenCount":2000},null,{"modality":"AU\u0044IO","tokenCount":5},{"tokenCount":7},{"modality":null,"tokenCount":9}]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[{"modality":"AUDIO","tokenCount":-2000}]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[{"modality":"AUDIO","tokenCount":9223372036854775807},{"modality":"AUDIO","tokenCount":1}]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[{"modality":1,"tokenCount":2}]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[{"modality":"AUDIO","tokenCount":2.5}]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":[7]}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":{"modality":"AUDIO"}}}`,
	`{"usageMetadata":{"promptTokenCount":3000,"promptTokensDetails":null,"cacheTokensDetails":[{"modality":"AUDIO","tokenCount":3}]}}`,
	`{"choices":{},"usage":{"prompt_tokens":3}}`,
	`{"choices":[1],"usage":{"prompt_tokens":3}}`,
	`{"choices":[null,{"delta":null},{"delta":{"content":null,"refusal":"no","reasoning_content":"hm"}}]}`,
	`{"choices":[{"delta":{"tool_calls":[null,{"function":null},{"function":{"arguments":null}},{"function":{"arguments":"{}"}}]}}]}`,
	`{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":1}}]}}]}`,
	`{"choices":[{"delta":{"tool_calls":{}}}]}`,
	`{"choices":[{"delta":{"content":5}}]}`,
	`{"choices":[{"delta":[]}]}`,
	`{"type":"message_start","message":{"usage":{"input_tokens":25,"cache_read_input_tokens":2000,"output_tokens":1}}}`,
	`{"type":"message_start","message":null,"usage":{"input_tokens":5}}`,
	`{"type":"message_start","message":{"content":"x"},"usage":{"input_tokens":5}}`,
	`{"type":"message_start","message":"x"}`,
	`{"type":"message_start","message":{"usage":"x"}}`,
	`{"type":"message\u005fdelta","usage":{"output_tokens":7,"input_tokens":3}}`,
	`{"type":"message_delta","usage":{"cache_creation_input_tokens":0}}`,
	`{"type":"message_delta","usage":null}`,
	`{"type":5}`,
	`{"type":null,"usage":{"input_tokens":5}}`,
	`{"type":"response.completed","response":{"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":10},"output_tokens":87}}}`,
	`{"type":"response.completed","response":{"usage":{"input_tokens":"36"}},"usage":{"input_tokens":1}}`,
	`{"type":"response.incomplete","response":"text"}`,
	`{"type":"response.failed","response":null}`,
	`{"type":"response.failed","response":[1,2]}`,
	`{"type":"response.created","response":{"usage":"odd"}}`,
	`{"type":"response.output_text.delta","delta":"Rayleigh \u00e9"}`,
	`{"type":"content_block_delta","delta":{"type":"text_delta","text":"hi","partial_json":"{","thinking":"t"}}`,
	`{"type":"content_block_delta","delta":{"text":5}}`,
	`{"type":"content_block_delta","delta":{"text":null}}`,
	`{"type":"content_block_delta","delta":[1]}`,
	`{"type":"content_block_delta","delta":7}`,
	`{"candidates":[{"content":{"parts":[{"text":"Nile"},null,{"text":null}]}}],"usageMetadata":{"promptTokenCount":12,"candidatesTokenCount":1,"thoughtsTokenCount":30,"cachedContentTokenCount":4}}`,
	`{"candidates":[{"content":null}],"usageMetadata":null}`,
	`{"candidates":[{"content":{"parts":{}}}]}`,
	`{"candidates":[{"content":[]}]}`,
	`{"usageMetadata":{"promptTokenCount":1.0}}`,
	`{"usageMetadata":{"promptTokenCount":-4,"candidatesTokenCount":null}}`,
	`{"message":{"content":"The"},"done":false}`,
	`{"message":{"content":["parts"]},"done":true,"prompt_eval_count":26,"eval_count":290}`,
	`{"response":"Blue","done":"yes"}`,
	`{"done":true,"prompt_eval_count":null,"eval_count":3}`,
	`{"done":true,"eval_count":-3}`,
	`{"done":null,"prompt_eval_count":2}`,
	`{"done":true,"prompt_eval_count":{}}`,
	` 	{ "choices" : [ { "delta" : { "content" : "spaced" } } ] , "usage" : { "prompt_tokens" : 1 } } 	`,
	"\v{\"usage\":{\"prompt_tokens\":1}}\u00a0",
	`{"usage":{"prompt_tokens":1}} x`,
	`{"usage":{"prompt_tokens":1},}`,
	`{"usage":{"prompt_tokens":1}`,
	`{"usage":{"prompt_tokens":1}}}`,
	`{"a":[1,2,{"b":[true,false,null,"s",-1.5e+3,0.25E-2]}],"usage":{"prompt_tokens":1}}`,
	`{"a":[1,],"usage":{"prompt_tokens":1}}`,
	`{"a":{"b":1,},"usage":{"prompt_tokens":1}}`,
	`{"a":tru,"usage":{"prompt_tokens":1}}`,
	`{"a":01,"usage":{"prompt_tokens":1}}`,
	`{"a":-,"usage":{"prompt_tokens":1}}`,
	`{"a":1.,"usage":{"prompt_tokens":1}}`,
	`{"a":"\x","usage":{"prompt_tokens":1}}`,
	`{"a":"\u12g4","usage":{"prompt_tokens":1}}`,
	"{\"a\":\"tab\tin string\",\"usage\":{\"prompt_tokens\":1}}",
	`{"\u0075sage":{"prompt_tokens":2}}`,
	`{"usag\u00e9":{"prompt_tokens":2}}`,
	`{"a":` + strings.Repeat(`{"b":`, 80) + `1` + strings.Repeat("}", 80) + `,"usage":{"prompt_tokens":1}}`,
	`{"a":` + strings.Repeat(`[{"b":`, 40) + `1` + strings.Repeat("}]", 40) + `,"usage":{"prompt_tokens":1}}`,
	`{"a":` + strings.Repeat(`[{"b":`, 40) + `1` + strings.Repeat("]}", 40) + `,"usage":{"prompt_tokens":1}}`,
	`[{"usage":{"prompt_tokens":1}}]`,
	`null`,
	``,
	// The output tables' fields, of every format, and of other types than
	// their tables say.
	`{"choices":[{"text":"Once","index":0},{"text":null},{"text":5},null,{"delta":{"content":"x"}}]}`,
	`{"choices":[{"delta":{"reasoning":"ab","reasoning_content":"abc"}},{"delta":{"reasoning":"abcd","reasoning_content":null}},{"delta":{"reasoning":7}}]}`,
	`{"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":"{}"}},{"function":{"name":null}},{"function":[]}],"function_call":{"name":"g","arguments":"x"},"audio":{"transcript":"hi","data":"AAAA"}}}]}`,
	`{"choices":[{"delta":{"function_call":"x","audio":null,"tool_calls":[1,"a",null]}}]}`,
	`{"type":"response.output_item.done","item":{"type":"reasoning","encrypted_content":"gAAA","summary":[{"text":"not counted"}]}}`,
	`{"type":"response.output_item.added","item":{"encrypted_content":null}}`,
	`{"type":"response.output_item.done","item":"x","delta":{"text":"an object"}}`,
	`{"type":"content_block_start","index":0,"content_block":{"type":"redacted_thinking","data":"EmwK"}}`,
	`{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"t","name":"convert","input":{"a": [1, "b", null, {"c": -0.5e3}]}}}`,
	`{"type":"content_block_start","content_block":{"input":null,"text":5,"thinking":"th","signature":"not in the table"}}`,
	`{"type":"content_block_delta","delta":{"type":"signature_delta","signature":"EqQB\u00e9"}}`,
	`{"type":"content_block_start","content_block":[{"text":"x"}],"delta":"a string"}`,
	`{"candidates":[{"content":{"parts":[{"text":"a","thought":true,"thoughtSignature":"sig"},{"functionCall":{"name":"f","args":{"x":"y\"z","n":[1,2]}}},{"functionCall":{"args":null}},{"executableCode":{"code":"print(1)"}},{"functionCall":"x"}]},"finishReason":"STOP"}],"usageMetadata":{"promptTokenCount":3,"candidatesTokenCount":4}}`,
	`{"candidates":[{"finishReason":""},{"finishReason":null},{"finishReason":5}],"usageMetadata":{"promptTokenCount":3}}`,
	`{"candidates":[{"finishReason":"MAX_TOKENS"}],"promptFeedback":{"blockReason":""},"usageMetadata":{"promptTokenCount":3}}`,
	`{"promptFeedback":{"blockReason":"SAFETY"},"usageMetadata":{"promptTokenCount":3}}`,
	`{"promptFeedback":{"blockReason":7},"usageMetadata":{"candidatesTokenCount":3}}`,
	`{"message":{"role":"assistant","content":"","thinking":"hm","tool_calls":[{"function":{"name":"f","arguments":{"city":"Paris"}}},{"function":{"arguments":"a string"}},{"function":{"arguments":null}}]},"done":false}`,
	`{"response":"","thinking":"hm","done":false}`,
	`{"response":{"usage":{"input_tokens":2}},"thinking":null}`,
	`{"\u0074hinking":"an escaped key","choices":[{"t\u0065xt":"e","delta":{"r\u0065asoning":"r"}}]}`,
}

// deepPayloads sit at encoding/json's nesting limit, on either side of it
// (too slow for a fuzzer's seeds).
var deepPayloads = []string{
	`{"a":` + strings.Repeat("[", 9999) + strings.Repeat("]", 9999) + `,"usage":{"prompt_tokens":1}}`,
	`{"a":` + strings.Repeat("[", 10000) + strings.Repeat("]", 10000) + `,"usage":{"prompt_tokens":1}}`,
	`{"a":` + strings.Repeat(`{"b":`, 9999) + `1` + strings.Repeat("}", 9999) + `,"usage":{"prompt_tokens":1}}`,
	`{"a":` + strings.Repeat(`{"b":`, 10000) + `1` + strings.Repeat("}", 10000) + `,"usage":{"prompt_tokens":1}}`,
}

// memoStreams are event sequences whose events share leading members, for
// the prefix memo: the same run then a change of kind, of usage, a run that
// ends in a syntax error, an event that is only the run, a repeat of the run
// with another value, an event cut inside the run, a run that ends inside a
// longer number.
var memoStreams = [][]string{
	{
		`{"type":"message_delta","index":0,"usage":{"output_tokens":3}}`,
		`{"type":"message_delta","index":0,"usage":{"output_tokens":5}}`,
		`{"type":"message_delta","index":0}`,
		`{"type":"message_delta","index":0,"type":"message_start","message":{"usage":{"input_tokens":7}}}`,
		`{"type":"message_delta","index":1,"usage":{"output_tokens":9}}`,
	},
	{
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"ab"}}],"usage":null}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"abc"}}],"usage":null}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":2}}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"y"}}],"usage":{"prompt_tokens":"bad"}}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"zz"}}],"usage":null,}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"zz"}}]}`,
		`{"id":"c","object":"chunk"}`,
		`{"id":"c","object":"chunk"`,
		`{"id":"c","object":"chunk","done":5,"choices":[{"delta":{"content":"q"}}]}`,
		`{"id":"c","object":"chunk","done":true,"choices":[{"delta":{"content":"q"}}]}`,
		`{"id":"d","object":"chunk","choices":[{"delta":{"content":"q"}}]}`,
		`{"id":"c","object":"chunk","choices":[{"delta":{"content":"q"}}]} `,
	},
	{
		`{"id":"c","object":"chunk`,
		`{"id":"c","object":"chunk,"choices":[{"delta":{"content":"0"}}]}`,
		`{"n":1,"choices":[]}`,
		`{"n":12,"choices":[{"delta":{"content":"x"}}]}`,
		`{"n":1.5,"choices":[{"delta":{"content":"x"}}]}`,
		`{"n":1 ,"choices":[{"delta":{"content":"x"}}]}`,
		`{"n":true,"choices":[]}`,
		`{"n":truex,"choices":[{"delta":{"content":"x"}}]}`,
	},
	{
		`{"model":"m","created_at":"t1","message":{"content":"The"},"done":false}`,
		`{"model":"m","created_at":"t1","message":{"content":" sky"},"done":false}`,
		`{"model":"m","created_at":"t2","message":{"content":""},"done":true,"prompt_eval_count":26,"eval_count":290}`,
	},
	// Events that differ from the one before in a few values: what a
	// template (eventTemplate) may read by comparison, and what it may not.
	{
		`{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}`, // two texts
		`{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"bc"}}]}`,
		`{"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}`,
		`{"choices":[{"delta":{"content":"ab","refusal":null}}]}`,
		`{"choices":[{"delta":{"content":"abc","refusal":null}}]}`,
		`{"choices":[{"delta":{"content":"x\"y"}}],"obfuscation":"k\u00e9"}`,
		`{"choices":[{"delta":{"content":"\u00e9\ud83d\ude00"}}],"obfuscation":"\""}`,
		`{"choices":[{"delta":{"content":"\ud800"}}],"obfuscation":""}`,
		"{\"choices\":[{\"delta\":{\"content\":\"ctl\x01\"}}],\"obfuscation\":\"a\"}", // invalid
		"{\"choices\":[{\"delta\":{\"content\":\"ok\"}}],\"obfuscation\":\"a\x01\"}",  // invalid
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":5}`,
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":1"}`, // invalid
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":x"}}],"obfuscation":"a"}`, // invalid
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"} `,
		` {"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":"ok"}}],"obfuscation":"a"}}`,
		`{"choices":[{"delta":{"content":""}}],"obfuscation":"a"}`,
		`{"choices":[{"delta":{"content":"xyz"}}],"obfuscation":"a"}`,
	},
	{
		`{"type":"response.output_text.delta","sequence_number":1,"delta":"a","obfuscation":"x"}`,
		`{"type":"response.output_text.delta","sequence_number":12,"delta":"bc","obfuscation":"yz"}`,
		`{"type":"response.output_text.delta","sequence_number":-0.5e3,"delta":"d","obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":"13","delta":"e","obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":13,"delta":"e","obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":01,"delta":"e","obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":14,"delta":5,"obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":15,"delta":6,"obfuscation":""}`,
		`{"type":"response.output_text.delta","sequence_number":16,"delta":"f","obfuscation":""}`,
		`{"type":"response.completed","sequence_number":17,"response":{"usage":{"input_tokens":3,"output_tokens":4}}}`,
		`{"type":"response.completed","sequence_number":18,"response":{"usage":{"input_tokens":3,"output_tokens":4}}}`,
		`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}`,
		`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"bb"}}`,
		`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":7}}`,
		`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":8}}`,
		`{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a"}}`,
		`{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"\":1}"}}`,
		`{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}`,
		`{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":15}}`,
	},
	// Output no template may take for a hole: a JSON value counted as
	// written, what ends a response, a text under either of two names.
	{
		`{"model":"q","created_at":"t1","message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"city":"Paris"}}}]},"done":false}`,
		`{"model":"q","created_at":"t2","message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"city":"Rome"}}}]},"done":false}`,
		`{"model":"q","created_at":"t3","message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"city":12}}}]},"done":false}`,
		`{"model":"q","created_at":"t4","message":{"role":"assistant","content":"x","thinking":"y"},"done":false}`,
		`{"model":"q","created_at":"t5","message":{"role":"assistant","content":"xy","thinking":"y"},"done":false}`,
	},
	{
		`{"candidates":[{"content":{"parts":[{"text":"a"}]},"index":0}],"usageMetadata":{"promptTokenCount":7}}`,
		`{"candidates":[{"content":{"parts":[{"text":"ab"}]},"index":0}],"usageMetadata":{"promptTokenCount":7}}`,
		`{"candidates":[{"content":{"parts":[{"text":"ab"}]},"finishReason":"","index":0}],"usageMetadata":{"promptTokenCount":7}}`,
		`{"candidates":[{"content":{"parts":[{"text":"ab"}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":7}}`,
		`{"candidates":[{"content":{"parts":[{"text":"abc"}]},"finishReason":"STOP","index":0}],"usageMetadata":{"promptTokenCount":8}}`,
	},
	{
		`{"choices":[{"delta":{"reasoning":"ab","reasoning_content":"ab"}}]}`,
		`{"choices":[{"delta":{"reasoning":"abc","reasoning_content":"abc"}}]}`,
		`{"choices":[{"delta":{"reasoning":"abc","reasoning_content":"a"}}]}`,
		`{"choices":[{"delta":{"reasoning":"a","reasoning_content":"abcd"}}]}`,
	},
}

// TestReadersMatchReference: on the golden inputs and the crafted payloads
// (as SSE events, NDJSON lines and JSON bodies, in every format) the scanner
// reads what the reference read.
func TestReadersMatchReference(t *testing.T) {
	for _, c := range streamCases(t) {
		stream, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i <= len(stream); i++ {
			want, _ := refMeterRead(c.format, c.framing, stream[:i], stream[i:])
			if got := meter(c.format, c.framing, stream[:i], stream[i:]); got != want {
				t.Fatalf("%s split at %d: %+v, the reference %+v", c.path, i, got, want)
			}
		}
	}
	for _, events := range memoStreams {
		for _, framing := range []Framing{SSE, NDJSON} {
			var stream []byte
			for _, e := range events {
				if framing == SSE {
					stream = append(stream, "data: "+e+"\n\n"...)
				} else {
					stream = append(stream, e+"\n"...)
				}
			}
			for _, f := range allFormats {
				for i := 0; i <= len(stream); i += 7 {
					want, _ := refMeterRead(f, framing, stream[:i], stream[i:])
					if got := meter(f, framing, stream[:i], stream[i:]); got != want {
						t.Fatalf("%v %v %q split at %d: %+v, the reference %+v", f, framing, stream, i, got, want)
					}
				}
			}
		}
	}
	responses, _ := filepath.Glob(filepath.Join("testdata", "responses", "*.json"))
	for _, file := range responses {
		body, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		payloads = append(payloads, string(body))
	}
	for _, p := range append(payloads, deepPayloads...) {
		if ambiguousJSON([]byte(p)) {
			t.Fatalf("payload %.80q is ambiguous: it cannot be compared", p)
		}
		for _, f := range allFormats {
			compareWithReference(t, []byte(p), f)
		}
	}
}

func compareWithReference(t *testing.T, payload []byte, f Format) {
	t.Helper()
	gotU, gotOK := FromJSON(f, payload)
	wantU, wantOK := refFromJSON(f, payload)
	if gotU != wantU || gotOK != wantOK {
		t.Fatalf("FromJSON(%v, %.200q) = %+v %v, the reference %+v %v", f, payload, gotU, gotOK, wantU, wantOK)
	}
	sse := append(append([]byte("data: "), payload...), "\n\n"...)
	if got, want := IsUsageOnlyChunk(sse), refIsUsageOnlyChunk(sse); got != want {
		t.Fatalf("IsUsageOnlyChunk(%.200q) = %v, the reference %v", sse, got, want)
	}
	for _, framing := range []Framing{SSE, NDJSON} {
		stream := sse
		if framing == NDJSON {
			stream = append(payload[:len(payload):len(payload)], '\n')
		}
		want, _ := refMeterRead(f, framing, stream)
		if got := meter(f, framing, stream); got != want {
			t.Fatalf("meter(%v, %v, %.200q) = %+v, the reference %+v", f, framing, stream, got, want)
		}
	}
}

// inWritesOf cuts stream into writes of n bytes.
func inWritesOf(stream []byte, n int) [][]byte {
	var writes [][]byte
	for off := 0; off < len(stream); off += n {
		writes = append(writes, stream[off:min(off+n, len(stream))])
	}
	return writes
}

// TestMeterMatchesReferenceInWritesOfAnySize: with lines cut again and
// again (the meter's line and data trade their rooms, an event is read
// where it is or from a copy), the meter reads what the reference read, on
// the golden transcripts and on events of several data lines, with other
// fields between and CRLF or CR line ends.
func TestMeterMatchesReferenceInWritesOfAnySize(t *testing.T) {
	type stream struct {
		data    []byte
		format  Format
		framing Framing
	}
	var streams []stream
	for _, c := range streamCases(t) {
		b, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, stream{b, c.format, c.framing})
	}
	usage := `{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}`
	text := `{"choices":[{"delta":{"content":"hello there"}}]}`
	for _, s := range []string{
		"data: " + text + "\ndata: " + text + "\n\ndata: " + usage + "\n\n",
		"data: {\"choices\":\ndata: []\ndata: ,\"usage\":{\"prompt_tokens\":5}}\n\n",
		"data: " + text + "\nid: 7\nevent: x\n\n: comment\ndata: " + usage + "\nretry: 10\n\n",
		"data: " + text + "\r\n\r\ndata: " + usage + "\r\n\r\n",
		"data: " + text + "\r\rdata:" + usage + "\r\r",
		"data: " + text + "\n\ndata: " + strings.Repeat("x", 700) + "\ndata: " + text + "\n\ndata: " + usage + "\n\n",
		"data: " + usage,
	} {
		streams = append(streams, stream{[]byte(s), OpenAIChat, SSE})
	}
	for _, s := range streams {
		want, _ := refMeterRead(s.format, s.framing, s.data)
		for n := 1; n <= 96; n++ {
			if got := meter(s.format, s.framing, inWritesOf(s.data, n)...); got != want {
				t.Fatalf("%.60q in writes of %d: %+v, the reference %+v", s.data, n, got, want)
			}
		}
	}
}

// FuzzMeterMatchesReference: whatever the stream and its split, the meter
// reads what the reference meter read, unless a payload's keys are
// ambiguous (see ambiguousJSON).
func FuzzMeterMatchesReference(f *testing.F) {
	for _, c := range streamCases(f) {
		if b, err := os.ReadFile(c.path); err == nil {
			f.Add(b, uint16(len(b)/3), uint8(c.format), c.framing == NDJSON)
		}
	}
	for i, events := range memoStreams {
		f.Add([]byte("data: "+strings.Join(events, "\n\ndata: ")+"\n\n"), uint16(i*31), uint8(i), false)
		f.Add([]byte(strings.Join(events, "\n")), uint16(i*17), uint8(i), true)
	}
	for i, p := range payloads {
		for _, fm := range allFormats {
			f.Add([]byte("data: "+p+"\n\n"), uint16(i), uint8(fm), false)
			f.Add([]byte(p+"\n"), uint16(i), uint8(fm), true)
		}
	}
	f.Fuzz(func(t *testing.T, stream []byte, split uint16, format uint8, ndjson bool) {
		framing := SSE
		if ndjson {
			framing = NDJSON
		}
		fm := fuzzFormat(format)
		i := int(split) % (len(stream) + 1)
		want, ambiguous := refMeterRead(fm, framing, stream[:i], stream[i:])
		if ambiguous {
			return
		}
		if got := meter(fm, framing, stream[:i], stream[i:]); got != want {
			t.Fatalf("split at %d: %+v, the reference %+v", i, got, want)
		}
		n := int(split)%61 + 1
		if got := meter(fm, framing, inWritesOf(stream, n)...); got != want {
			t.Fatalf("in writes of %d: %+v, the reference %+v", n, got, want)
		}
	})
}

// FuzzFromJSONMatchesReference: FromJSON and IsUsageOnlyChunk read what the
// reference read, unless the keys are ambiguous.
func FuzzFromJSONMatchesReference(f *testing.F) {
	for _, p := range payloads {
		for _, fm := range allFormats {
			f.Add([]byte(p), uint8(fm))
		}
	}
	f.Fuzz(func(t *testing.T, body []byte, format uint8) {
		if ambiguousJSON(body) {
			return
		}
		fm := fuzzFormat(format)
		gotU, gotOK := FromJSON(fm, body)
		wantU, wantOK := refFromJSON(fm, body)
		if gotU != wantU || gotOK != wantOK {
			t.Fatalf("FromJSON = %+v %v, the reference %+v %v", gotU, gotOK, wantU, wantOK)
		}
		// As the data of an event, split into lines at newlines.
		ev := append([]byte("data: "), bytes.ReplaceAll(body, []byte("\n"), []byte("\ndata: "))...)
		if refIsUsageOnlyChunk(ev) != IsUsageOnlyChunk(ev) && !ambiguousJSON(joinedData(ev)) {
			t.Fatalf("IsUsageOnlyChunk(%q) = %v, the reference %v", ev, IsUsageOnlyChunk(ev), refIsUsageOnlyChunk(ev))
		}
	})
}

// joinedData is the data of an event as IsUsageOnlyChunk joins it.
func joinedData(ev []byte) []byte {
	var data []byte
	for _, line := range bytes.FieldsFunc(ev, func(r rune) bool { return r == '\n' || r == '\r' }) {
		if v, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			data = append(data, bytes.TrimPrefix(v, []byte(" "))...)
		}
	}
	return data
}

// TestReadersReadExactCase: where encoding/json read keys without regard to
// case and merged repeated keys, the readers read what an upstream or SDK
// reads: the exact key, the last of repeats.
func TestReadersReadExactCase(t *testing.T) {
	tests := []struct {
		name, payload string
		want          Reading
		asBefore      bool // the reference read it alike
	}{
		{"another case is another key", `{"Usage":{"prompt_tokens":3,"completion_tokens":4}}`, Reading{}, false},
		{"a field in another case is another field", `{"usage":{"Prompt_Tokens":3,"completion_tokens":4}}`,
			Reading{Usage: usageOf(0, 0, 4), Complete: true, InputKnown: true}, false},
		{"the last repeat counts", `{"usage":{"prompt_tokens":3},"usage":{"completion_tokens":4}}`,
			Reading{Usage: usageOf(0, 0, 4), Complete: true, InputKnown: true}, false},
		{"a repeat of null clears", `{"usage":{"prompt_tokens":3},"usage":null}`, Reading{}, false},
		{"a kelvin sign is no k", "{\"usage\":{\"prompt_to\u212aens\":3,\"completion_tokens\":4}}",
			Reading{Usage: usageOf(0, 0, 4), Complete: true, InputKnown: true}, false},
		{"escapes are decoded", `{"\u0075sage":{"prompt_tokens":3,"completion_tokens":4}}`,
			Reading{Usage: usageOf(3, 0, 4), Complete: true, InputKnown: true}, true},
		{"text in another case is not text", `{"choices":[{"delta":{"Content":"hello"}}]}`, Reading{}, true},
		{"repeated text counts once", `{"choices":[{"delta":{"content":"hello","content":"hi"}}]}`, Reading{OutputTextBytes: 2}, true},
		{"a type in another case is no type", `{"Type":"message_delta","usage":{"output_tokens":4}}`,
			Reading{Usage: usageOf(0, 0, 4), Complete: true, InputKnown: true}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stream := []byte("data: " + tt.payload + "\n\n")
			tt.want.Bytes = int64(len(stream))
			if got := meter(OpenAIChat, SSE, stream); got != tt.want {
				t.Fatalf("read %+v, want %+v", got, tt.want)
			}
			before, ambiguous := refMeterRead(OpenAIChat, SSE, stream)
			switch {
			case tt.asBefore && before != tt.want:
				t.Fatalf("the reference read %+v", before)
			case !tt.asBefore && !ambiguous:
				t.Fatal("the reference reads this payload alike: the case proves nothing")
			}
		})
	}
}

func usageOf(in, cached, out int64) budget.Usage {
	return budget.Usage{InputTokens: in, CachedInputTokens: cached, OutputTokens: out}
}
