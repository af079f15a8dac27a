package fleetguard

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// A Realtime session's audio delta (16 KiB of base64, most of what a
// session's server sends) as the session reads it, beside decoding it (what
// the session did for every event before it looked for the types it decides
// on first).
func BenchmarkRealtimeAudioDelta(b *testing.B) {
	delta := []byte(fmt.Sprintf(`{"type":"response.output_audio.delta","event_id":"event_1","response_id":"resp_1","item_id":"item_1","output_index":0,"content_index":0,"delta":%q}`, strings.Repeat("AAAA", 4096)))
	b.Run("read", func(b *testing.B) {
		s := &realtime{turns: &turns{}}
		b.SetBytes(int64(len(delta)))
		b.ReportAllocs()
		for range b.N {
			s.serverEvent(delta)
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.SetBytes(int64(len(delta)))
		b.ReportAllocs()
		for range b.N {
			var ev struct {
				Type     string
				Response struct{ ID string }
			}
			_ = json.Unmarshal(delta, &ev)
		}
	})
}
