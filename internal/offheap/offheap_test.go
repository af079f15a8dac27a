package offheap

import "testing"

// Regions come zeroed and writable, are counted while held and given back
// one at a time or all at once.
func TestRegionsAreZeroedCountedAndGivenBack(t *testing.T) {
	var m Memory
	a, b := m.Alloc(1<<16), m.Alloc(100)
	for _, r := range [][]byte{a, b} {
		for i, c := range r {
			if c != 0 {
				t.Fatalf("byte %d of a new region is %d", i, c)
			}
		}
		r[len(r)-1] = 1
	}
	if got := m.Size(); got != 1<<16+100 {
		t.Fatalf("held %d bytes, want %d", got, 1<<16+100)
	}
	m.Free(a)
	if got := m.Size(); got != 100 {
		t.Fatalf("after a free: %d bytes, want 100", got)
	}
	m.Release()
	if got := m.Size(); got != 0 {
		t.Fatalf("after Release: %d bytes", got)
	}
}
