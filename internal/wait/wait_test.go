package wait

import (
	"testing"
	"time"
)

func TestPollReturnsOnceTheConditionHolds(t *testing.T) {
	calls := 0
	if !Poll(time.Second, func() bool { calls++; return calls == 3 }) || calls != 3 {
		t.Fatalf("Poll: %d calls, want true after 3", calls)
	}
}

func TestPollGivesUpAtTheTimeout(t *testing.T) {
	start := time.Now()
	if Poll(30*time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll of a condition that never holds: true")
	}
	if took := time.Since(start); took < 30*time.Millisecond || took > time.Second {
		t.Fatalf("Poll gave up after %s, want about 30 ms", took)
	}
}
