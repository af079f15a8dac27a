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

// Checking a config at parse time fills in no default: the adapted JSON says
// what the Caddyfile says, and nothing else.
func TestAdaptedLLMBudgetHoldsNoDefaults(t *testing.T) {
	src := []byte(":0 {\n\tllmbudget {\n\t\tbudget b {\n\t\t\tlimit 10\n\t\t\twindow 1h\n\t\t}\n\t}\n}\n")
	cfg, _, err := adaptCaddyfileFile(src, "Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, field := range []string{"default_max_tokens", "max_request_body", "store_timeout", "max_retry_after"} {
		if strings.Contains(string(cfg), `"`+field+`"`) {
			t.Errorf("adapted JSON holds %s, which the Caddyfile did not set: %s", field, cfg)
		}
	}
}

// A bad store URL is refused with its line, and without echoing a password.
func TestBadRedisURLNamesItsLine(t *testing.T) {
	for _, tt := range []struct{ option, url string }{
		{"redis", "http://user:s3cret@127.0.0.1:6379"},
		{"redis_cluster", "redis://:s3cret@"},
		{"redis_sentinel", "redis://:s3cret@127.0.0.1:26379/0"}, // no master_name
	} {
		src := []byte("{\n\tfleetguard {\n\t\tprefix p\n\t\t" + tt.option + " " + tt.url + "\n\t}\n}\n:0 {\n\trespond ok\n}\n")
		_, _, err := adaptCaddyfileFile(src, "store.Caddyfile")
		if err == nil {
			t.Fatalf("%s %s: accepted", tt.option, tt.url)
		}
		msg := err.Error()
		if !strings.Contains(msg, tt.option) || strings.Count(msg, "store.Caddyfile:4") != 1 || strings.Contains(msg, "s3cret") {
			t.Errorf("%s: error %q: want the option, the position store.Caddyfile:4 once, and no password", tt.option, msg)
		}
	}
}
