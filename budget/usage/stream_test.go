package usage

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/bpe"
)

// streamCases lists testdata/streams/<name>.<format>.sse|ndjson.
func streamCases(t testing.TB) []struct {
	path    string
	format  Format
	framing Framing
} {
	files, err := filepath.Glob(filepath.Join("testdata", "streams", "*"))
	if err != nil {
		t.Fatal(err)
	}
	var out []struct {
		path    string
		format  Format
		framing Framing
	}
	for _, f := range files {
		parts := strings.Split(filepath.Base(f), ".")
		if len(parts) != 3 || parts[2] == "golden" {
			continue
		}
		format, err := ParseFormat(parts[1])
		if err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		framing := SSE
		if parts[2] == "ndjson" {
			framing = NDJSON
		}
		out = append(out, struct {
			path    string
			format  Format
			framing Framing
		}{f, format, framing})
	}
	if len(out) == 0 {
		t.Fatal("no stream transcripts in testdata/streams")
	}
	return out
}

// allFormats are the formats, Unknown included.
var allFormats = []Format{Unknown, OpenAIChat, OpenAIResponses, Anthropic, Gemini, Ollama, OpenAIEmbeddings, OpenAICompletions}

// fuzzFormat is the format a fuzzer's byte names.
func fuzzFormat(b uint8) Format { return allFormats[int(b)%len(allFormats)] }

// meter runs a stream through a Meter in the given chunks.
// meter meters chunks, and panics if a meter that keeps a template from
// its first event (see eventTemplate) reads them differently.
func meter(f Format, framing Framing, chunks ...[]byte) Reading {
	var readings [2]Reading
	for i := range readings {
		m := NewMeter(f, framing)
		if i == 1 {
			m.reads = templateAfter
		}
		for _, c := range chunks {
			m.Write(c)
		}
		m.Close()
		readings[i] = m.Reading()
	}
	if readings[0] != readings[1] {
		panic(fmt.Sprintf("with a template from the first event %+v, else %+v", readings[1], readings[0]))
	}
	// Counting tokens, with and without a template, changes nothing else,
	// and counts no more tokens than bytes (none is less than a byte).
	for _, reads := range []uint8{0, templateAfter} {
		m := NewMeter(f, framing)
		m.reads = reads
		m.CountTokens(bpe.Load(bpe.O200k))
		for _, c := range chunks {
			m.Write(c)
		}
		m.Close()
		r := m.Reading()
		if r.OutputTokens > r.OutputTokensText || r.OutputTokens < 0 {
			panic(fmt.Sprintf("%d tokens of %d bytes", r.OutputTokens, r.OutputTokensText))
		}
		if r.OutputTokens, r.OutputTokensText = 0, 0; r != readings[0] {
			panic(fmt.Sprintf("counting tokens: %+v, else %+v", r, readings[0]))
		}
	}
	return readings[0]
}

func TestMeterGolden(t *testing.T) {
	for _, c := range streamCases(t) {
		t.Run(filepath.Base(c.path), func(t *testing.T) {
			stream, err := os.ReadFile(c.path)
			if err != nil {
				t.Fatal(err)
			}
			whole := meter(c.format, c.framing, stream)
			checkGolden(t, strings.TrimSuffix(c.path, filepath.Ext(c.path))+".json", whole)

			// Split at every byte boundary: the same reading.
			for i := 1; i < len(stream); i++ {
				if got := meter(c.format, c.framing, stream[:i], stream[i:]); got != whole {
					t.Fatalf("split at byte %d: %+v, want %+v", i, got, whole)
				}
			}
			// One byte at a time.
			bytewise := make([][]byte, len(stream))
			for i := range stream {
				bytewise[i] = stream[i : i+1]
			}
			if got := meter(c.format, c.framing, bytewise...); got != whole {
				t.Fatalf("byte by byte: %+v, want %+v", got, whole)
			}
		})
	}
}

func TestMeterBoundsAHugeDataLine(t *testing.T) {
	huge := bytes.Repeat([]byte("x"), 5*MaxEventBytes)
	m := NewMeter(OpenAIChat, SSE)
	m.Write([]byte("data: {\"choices\":[{\"delta\":{\"content\":\""))
	for i := 0; i < len(huge); i += 64 << 10 {
		m.Write(huge[i : i+64<<10])
	}
	m.Write([]byte("\"}}]}\n\n"))
	if cap(m.line) > MaxEventBytes || cap(m.data) > MaxEventBytes {
		t.Fatalf("meter holds %d + %d bytes for one event, want at most %d each", cap(m.line), cap(m.data), MaxEventBytes)
	}
	m.Write([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n\n"))
	m.Close()
	r := m.Reading()
	if !r.Complete || r.Usage.InputTokens != 3 || r.Usage.OutputTokens != 4 {
		t.Fatalf("the usage after an oversized event is still read: %+v", r)
	}
	if r.OutputTextBytes < int64(len(huge)) {
		t.Fatalf("an oversized event counts as generated text: %d bytes, want >= %d", r.OutputTextBytes, len(huge))
	}
}

func FuzzMeter(f *testing.F) {
	for _, c := range streamCases(f) {
		if b, err := os.ReadFile(c.path); err == nil {
			f.Add(b, uint16(len(b)/3), uint8(c.format), c.framing == NDJSON)
		}
	}
	f.Fuzz(func(t *testing.T, stream []byte, split uint16, format uint8, ndjson bool) {
		framing := SSE
		if ndjson {
			framing = NDJSON
		}
		fm := fuzzFormat(format)
		whole := meter(fm, framing, stream)
		i := int(split) % (len(stream) + 1)
		if got := meter(fm, framing, stream[:i], stream[i:]); got != whole {
			t.Fatalf("split at %d: %+v, want %+v", i, got, whole)
		}
		if whole.Bytes != int64(len(stream)) {
			t.Fatalf("counted %d bytes of %d", whole.Bytes, len(stream))
		}
		if whole.OutputTextBytes < 0 {
			t.Fatalf("negative text %+v", whole)
		}
		neverChargedNegative(t, whole.Usage)
	})
}

func FuzzFromJSON(f *testing.F) {
	for _, dir := range []string{"responses", "requests"} {
		files, _ := filepath.Glob(filepath.Join("testdata", dir, "*.json"))
		for _, file := range files {
			if b, err := os.ReadFile(file); err == nil {
				f.Add(b, uint8(0))
			}
		}
	}
	f.Fuzz(func(t *testing.T, body []byte, format uint8) {
		u, ok := FromJSON(fuzzFormat(format), body)
		neverChargedNegative(t, u)
		if !ok && u != (budget.Usage{}) {
			t.Fatalf("usage %+v without found", u)
		}
		_, _ = ParseRequest(fuzzFormat(format), "/v1beta/models/m:generateContent", body)
	})
}

// neverChargedNegative checks that usage with a count below zero (counts are
// read as the upstream reported them) is refused before it is charged.
func neverChargedNegative(t *testing.T, u budget.Usage) {
	t.Helper()
	if min(u.InputTokens, u.OutputTokens, u.CachedInputTokens, u.CacheWriteTokens, u.CacheWrite1hTokens,
		u.AudioInputTokens, u.ReasoningTokens, u.AudioOutputTokens, u.WebSearchCalls) >= 0 {
		return
	}
	if _, err := (budget.Price{Rates: budget.Rates{Input: 1, Output: 1}}).SpendOf(u); !errors.Is(err, budget.ErrUsageOutOfRange) {
		t.Fatalf("usage %+v with a negative count is chargeable: %v", u, err)
	}
}
