package keyhash

import "testing"

func TestStableAcrossProcesses(t *testing.T) {
	// The digest names keys shared by every instance and release, so it is
	// pinned: a change here would silently split a fleet's counters.
	const emptyDigest = "99aa06d3014798d86001c324468d497f" // XXH3-128 of ""
	if got := Of("").String(); got != emptyDigest {
		t.Fatalf("Of(\"\") = %s, want %s", got, emptyDigest)
	}
	if Of("a") == Of("b") {
		t.Fatal("distinct keys must have distinct digests")
	}
	if len(Of("x").String()) != 32 {
		t.Fatal("a digest renders as 32 hex digits")
	}
}

func TestOfBytesIsOfString(t *testing.T) {
	// A key assembled into bytes and one read as a string must name the
	// same counter. Lengths cross XXH3's size classes (0, 1-3, 4-8, 9-16,
	// 17-128, 129-240, longer).
	for _, n := range []int{0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1000} {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('a' + i%26)
		}
		if OfBytes(b) != Of(string(b)) {
			t.Fatalf("length %d: OfBytes and Of differ", n)
		}
	}
}

func TestOfDoesNotAllocate(t *testing.T) {
	s := "Bearer sk-live-abcdefghijklmnopqrstuvwxyz"
	if n := testing.AllocsPerRun(100, func() { _ = Of(s) }); n != 0 {
		t.Fatalf("Of allocates %v times per call, want 0", n)
	}
	b := []byte(s)
	if n := testing.AllocsPerRun(100, func() { _ = OfBytes(b) }); n != 0 {
		t.Fatalf("OfBytes allocates %v times per call, want 0", n)
	}
}

// BenchmarkOf hashes an Authorization-sized value, as the request path does
// for every zone key and budget principal.
func BenchmarkOf(b *testing.B) {
	s := "Bearer sk-proj-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		_ = Of(s)
	}
}

func TestParseReadsString(t *testing.T) {
	for _, s := range []string{"", "a", "sk-123456"} {
		h := Of(s)
		if got, ok := Parse(h.String()); !ok || got != h {
			t.Fatalf("Parse(%q) = %v %v, want %v", h.String(), got, ok, h)
		}
	}
	for _, bad := range []string{"", "00", "zz" + Of("x").String()[2:]} {
		if _, ok := Parse(bad); ok {
			t.Fatalf("Parse(%q) accepted", bad)
		}
	}
}
