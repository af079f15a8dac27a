package safego

import (
	"strings"
	"testing"
)

func TestRecoverStopsAPanicAndReportsIt(t *testing.T) {
	var where string
	var value any
	var stack []byte
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer Recover("settle", func(w string, v any, s []byte) { where, value, stack = w, v, s })
		var m map[string]int
		m["boom"]++ // a nil map write panics
	}()
	<-done
	if where != "settle" || value == nil {
		t.Fatalf("report got (%q, %v), want the panic in settle", where, value)
	}
	if !strings.Contains(string(stack), "safego_test.go") {
		t.Errorf("stack does not show where it panicked:\n%s", stack)
	}
}

func TestRecoverWithoutAPanicReportsNothing(t *testing.T) {
	called := false
	func() {
		defer Recover("pass", func(string, any, []byte) { called = true })
	}()
	if called {
		t.Error("report called without a panic")
	}
}

func TestRecoverWithoutAReportStillStopsThePanic(t *testing.T) {
	func() {
		defer Recover("pass", nil)
		panic("boom")
	}()
}
