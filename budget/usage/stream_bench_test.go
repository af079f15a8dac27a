package usage

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// benchStreams is one golden transcript per format.
var benchStreams = []struct {
	file    string
	format  Format
	framing Framing
}{
	{"chat_usage.openai_chat.sse", OpenAIChat, SSE},
	{"responses_completed.openai_responses.sse", OpenAIResponses, SSE},
	{"messages.anthropic.sse", Anthropic, SSE},
	{"gemini.gemini.sse", Gemini, SSE},
	{"chat.ollama.ndjson", Ollama, NDJSON},
}

// writeIn512 feeds stream to w as an upstream's body arrives: in 512-byte
// writes.
func writeIn512(w interface{ Write([]byte) (int, error) }, stream []byte) {
	for off := 0; off < len(stream); off += 512 {
		w.Write(stream[off:min(off+512, len(stream))])
	}
}

// BenchmarkMeter meters each golden transcript, a new Meter per stream, in
// 512-byte writes; SetBytes makes the figure a throughput.
// BenchmarkMeterReference is the encoding/json meter it replaced, on the
// same input: run both in one go test invocation to compare.
func BenchmarkMeter(b *testing.B) {
	benchmarkMeters(b, func(f Format, fr Framing) meterUnderTest { return NewMeter(f, fr) })
}

func BenchmarkMeterReference(b *testing.B) {
	benchmarkMeters(b, func(f Format, fr Framing) meterUnderTest { return newRefMeter(f, fr) })
}

// meterUnderTest is what Meter and the reference meter share.
type meterUnderTest interface {
	Write([]byte) (int, error)
	Close()
	Reading() Reading
}

// benchmarkMeters meters each golden transcript with a new meter per stream.
func benchmarkMeters(b *testing.B, newMeter func(Format, Framing) meterUnderTest) {
	for _, c := range benchStreams {
		b.Run(c.format.String(), func(b *testing.B) {
			stream := readStream(b, c.file)
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			for b.Loop() {
				m := newMeter(c.format, c.framing)
				writeIn512(m, stream)
				m.Close()
				if !m.Reading().Complete {
					b.Fatal("no usage")
				}
			}
		})
	}
}

// BenchmarkMeterLongStream is the steady state of a long stream: each op
// passes the transcript once more through one Meter (allocs/op is then the
// allocations per pass, which TestMeterAllocatesNothingPerEvent holds at 0).
func BenchmarkMeterLongStream(b *testing.B) {
	for _, c := range benchStreams {
		b.Run(c.format.String(), func(b *testing.B) {
			stream := readStream(b, c.file)
			m := NewMeter(c.format, c.framing)
			writeIn512(m, stream)
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				writeIn512(m, stream)
			}
			m.Close()
			if !m.Reading().Complete {
				b.Fatal("no usage")
			}
		})
	}
}

// BenchmarkIsUsageOnlyChunk is the strip check on every event of an OpenAI
// stream (each chunk carries "usage", null but for the last).
func BenchmarkIsUsageOnlyChunk(b *testing.B) {
	for _, impl := range []struct {
		name string
		fn   func([]byte) bool
	}{{"scanner", IsUsageOnlyChunk}, {"reference", refIsUsageOnlyChunk}} {
		b.Run(impl.name, func(b *testing.B) {
			stream := readStream(b, "chat_usage.openai_chat.sse")
			b.SetBytes(int64(len(stream)))
			b.ReportAllocs()
			for b.Loop() {
				found := 0
				for rest := stream; len(rest) > 0; {
					end := EventEnd(rest, 0)
					if end < 0 {
						end = len(rest)
					}
					if impl.fn(rest[:end]) {
						found++
					}
					rest = rest[end:]
				}
				if found != 1 {
					b.Fatalf("%d usage-only chunks, want 1", found)
				}
			}
		})
	}
}

func readStream(tb testing.TB, name string) []byte {
	tb.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "streams", name))
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// TestMeterAllocatesNothingPerEvent: once its buffers have grown, a Meter
// reads every golden transcript again and again without allocating.
func TestMeterAllocatesNothingPerEvent(t *testing.T) {
	for _, c := range streamCases(t) {
		stream, err := os.ReadFile(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasSuffix(stream, []byte("\n")) {
			stream = append(stream, '\n') // so that repeats stay whole lines
		}
		m := NewMeter(c.format, c.framing)
		for range 3 {
			writeIn512(m, stream)
		}
		if n := testing.AllocsPerRun(100, func() { writeIn512(m, stream) }); n != 0 {
			t.Errorf("%s: %.1f allocations per pass, want 0", c.path, n)
		}
	}
}
