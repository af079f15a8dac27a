// Package safego keeps a panic in a goroutine the plugin starts from ending
// the process: a Caddy serves many sites, and one bad upstream answer or one
// bug in a background step must not take them all down.
package safego

import "runtime/debug"

// Report is told of a recovered panic: where it happened (a fixed name, fit
// for a metric label), the value, and the goroutine's stack.
type Report func(where string, value any, stack []byte)

// Recover stops a panic in the goroutine that defers it and tells report
// (when not nil). Defer it directly (defer safego.Recover(...)): recover only
// works in the deferred function itself.
func Recover(where string, report Report) {
	if v := recover(); v != nil && report != nil {
		report(where, v, debug.Stack())
	}
}
