//go:build unix

package offheap

import "syscall"

// mapMemory returns n zeroed bytes of anonymous private pages, which the
// kernel backs once touched, or heap memory when the kernel maps none (the
// process is out of memory either way; the heap's failure says so).
func mapMemory(n int) []byte {
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return make([]byte, n)
	}
	return b
}

// unmapMemory gives back what mapMemory returned. Heap memory fails to
// unmap (it was not a mapping of its own) and is left to the collector.
func unmapMemory(b []byte) { _ = syscall.Munmap(b) }
