package bpe

import (
	"runtime"
	"testing"
)

// BenchmarkCount counts one delta of a stream: English of 40 bytes, a few
// tokens; CJK; a CSV line.
func BenchmarkCount(b *testing.B) {
	for _, tt := range []struct{ name, text string }{
		{"english40", " the river runs north through eleven cou"},
		{"word", " budget"},
		{"cjk", "日本語のテキストは一文字ずつ"},
		{"csv", "2026-03-14,187.15,188.44,-0.0123\n"},
	} {
		b.Run(tt.name, func(b *testing.B) {
			c := Load(O200k)
			text := []byte(tt.text)
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			for b.Loop() {
				c.Count(text)
			}
		})
	}
}

// BenchmarkLoad builds o200k_base's table (the codec's own vocabulary map
// is built once, on the first); heap-MB is the heap the first build kept,
// the codec's map and the table, table-MB the table alone.
func BenchmarkLoad(b *testing.B) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	c := build(O200k)
	runtime.GC()
	runtime.ReadMemStats(&after)
	first := after.HeapAlloc - before.HeapAlloc
	for b.Loop() {
		c = build(O200k)
	}
	b.ReportMetric(float64(first)/1e6, "heap-MB")
	b.ReportMetric(float64(c.MemoryBytes())/1e6, "table-MB")
}
