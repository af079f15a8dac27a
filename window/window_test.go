package window

import (
	"testing"
	"time"
)

func TestEpoch(t *testing.T) {
	const s = int64(time.Second)
	tests := []struct {
		name string
		now  int64
		w    time.Duration
		want int64
	}{
		{"zero time", 0, time.Second, 0},
		{"negative time", -5 * s, time.Second, 0},
		{"zero window", 10 * s, 0, 0},
		{"first instant of epoch 10", 10 * s, time.Second, 10},
		{"last nanosecond of epoch 9", 10*s - 1, time.Second, 9},
		{"minute windows", 125 * s, time.Minute, 2},
		{"exact minute boundary", 120 * s, time.Minute, 2},
		{"one ns before minute boundary", 120*s - 1, time.Minute, 1},
		{"sub-second window", 1*s + 250*int64(time.Millisecond), 500 * time.Millisecond, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Epoch(tt.now, tt.w); got != tt.want {
				t.Fatalf("Epoch(%d, %v) = %d, want %d", tt.now, tt.w, got, tt.want)
			}
		})
	}
}

func TestElapsedAndRemaining(t *testing.T) {
	const s = int64(time.Second)
	tests := []struct {
		name          string
		now           int64
		w             time.Duration
		wantElapsed   time.Duration
		wantRemaining time.Duration
	}{
		{"at boundary", 60 * s, time.Minute, 0, time.Minute},
		{"one ns after boundary", 60*s + 1, time.Minute, 1, time.Minute - 1},
		{"one ns before boundary", 120*s - 1, time.Minute, time.Minute - 1, 1},
		{"middle", 90 * s, time.Minute, 30 * time.Second, 30 * time.Second},
		{"zero window", 90 * s, 0, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Elapsed(tt.now, tt.w); got != tt.wantElapsed {
				t.Errorf("Elapsed = %v, want %v", got, tt.wantElapsed)
			}
			if got := Remaining(tt.now, tt.w); got != tt.wantRemaining {
				t.Errorf("Remaining = %v, want %v", got, tt.wantRemaining)
			}
		})
	}
}

func TestSlidingEstimate(t *testing.T) {
	w := 10 * time.Second
	tests := []struct {
		name      string
		cur, prev int64
		elapsed   time.Duration
		want      float64
	}{
		{"start of window counts all of previous", 0, 10, 0, 10},
		{"end of window counts none of previous", 3, 10, w, 3},
		{"halfway counts half of previous", 4, 10, 5 * time.Second, 9},
		{"quarter way", 0, 8, 2500 * time.Millisecond, 6},
		{"negative elapsed clamps to start", 1, 10, -time.Second, 11},
		{"elapsed past window clamps to end", 1, 10, 2 * w, 1},
		{"no previous", 7, 0, 3 * time.Second, 7},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := SlidingEstimate(tt.cur, tt.prev, tt.elapsed, w); got != tt.want {
				t.Fatalf("SlidingEstimate(%d, %d, %v) = %v, want %v", tt.cur, tt.prev, tt.elapsed, got, tt.want)
			}
		})
	}
	if got := SlidingEstimate(5, 100, time.Second, 0); got != 5 {
		t.Fatalf("zero window must count only the current window, got %v", got)
	}
}
