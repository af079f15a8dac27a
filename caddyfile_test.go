package fleetguard

import (
	"strings"
	"testing"
)

// A `fleetguard` block inside a site says it is a global option, with its
// position once.
func TestFleetguardInsideASiteSaysItIsAGlobalOption(t *testing.T) {
	src := []byte(":8080 {\n\tfleetguard {\n\t\tprefix x\n\t}\n\trespond ok\n}\n")
	_, _, err := adaptCaddyfileFile(src, "site.Caddyfile")
	if err == nil {
		t.Fatal("a fleetguard block inside a site must be refused")
	}
	msg := err.Error()
	if !strings.Contains(msg, "fleetguard is a global option") || strings.Count(msg, "site.Caddyfile:2") != 1 {
		t.Fatalf("error %q: want 'fleetguard is a global option' and the position site.Caddyfile:2 once", msg)
	}
}
