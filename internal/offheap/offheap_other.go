//go:build !unix

package offheap

// mapMemory is heap memory where there is no mmap.
func mapMemory(n int) []byte { return make([]byte, n) }

func unmapMemory([]byte) {}
