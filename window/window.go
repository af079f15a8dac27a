// Package window holds the pure time arithmetic of slotted sliding windows.
//
// Every instance of a fleet must agree on where a slot starts, so slots are
// numbered from the Unix epoch. Times are Unix nanoseconds so the request
// path never builds a time.Time it does not need.
package window
