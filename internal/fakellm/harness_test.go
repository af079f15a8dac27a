package fakellm

import (
	"testing"
	"time"
)

// eventually waits until cond holds, checking every 10 ms, and fails the
// test saying what did not happen when timeout passes first (as the root
// package's and ratelimit's harness_test.go do).
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after %s: %s did not happen", timeout, what)
		}
	}
}
