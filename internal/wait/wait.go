// Package wait is how the tests wait for something to happen: one loop
// that polls a condition until it holds or a deadline passes, so that no
// test writes its own deadline loop and every failed wait reads alike.
package wait

import (
	"testing"
	"time"
)

// Every is how often Poll checks its condition.
const Every = 10 * time.Millisecond

// Poll checks cond every 10 ms until it holds (true) or timeout passes
// (false).
func Poll(timeout time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(timeout); !cond(); time.Sleep(Every) {
		if time.Now().After(deadline) {
			return false
		}
	}
	return true
}

// Until waits until cond holds, and fails the test saying what did not
// happen when timeout passes first.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Poll(timeout, cond) {
		t.Fatalf("after %s: %s did not happen", timeout, what)
	}
}
