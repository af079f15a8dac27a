package fleetguard

import (
	"io"
	"mime"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/fleetguard/fleetguard/budget"
	"github.com/fleetguard/fleetguard/budget/usage"
)

// maxUsageCapture bounds the copy of a JSON response kept to read its usage.
// A larger response passes through untouched and keeps its reservation.
const maxUsageCapture = 8 << 20

// meteringWriter passes the response through as it is written and keeps what
// it needs to read the usage: the status, and a bounded copy of a successful
// JSON body. Flushes reach the client through Unwrap/Flush.
type meteringWriter struct {
	*caddyhttp.ResponseWriterWrapper
	status   int
	isStream bool
	capture  []byte
	overflow bool
}

var (
	_ http.Flusher  = (*meteringWriter)(nil)
	_ io.ReaderFrom = (*meteringWriter)(nil)
)

// WriteHeader records the final status; informational 1xx answers pass
// through without counting as the response.
func (w *meteringWriter) WriteHeader(status int) {
	if w.status == 0 && status >= 200 {
		w.status = status
		ct, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type"))
		w.isStream = ct == "text/event-stream"
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *meteringWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(p)
	w.observe(p[:n])
	return n, err
}

// ReadFrom copies through Write so that the body is observed; the wrapped
// writer's own ReadFrom would bypass it.
func (w *meteringWriter) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(writeOnly{w}, r)
}

// Flush sends what was written to the client now.
func (w *meteringWriter) Flush() {
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *meteringWriter) observe(p []byte) {
	if w.status < 200 || w.status >= 300 || w.isStream || w.overflow {
		return
	}
	if len(w.capture)+len(p) > maxUsageCapture {
		w.overflow, w.capture = true, nil
		return
	}
	w.capture = append(w.capture, p...)
}

// usage is what the response reported, if it could be read.
func (w *meteringWriter) usage(f usage.Format) (budget.Usage, bool) {
	if w.isStream || w.overflow {
		return budget.Usage{}, false
	}
	return usage.FromJSON(f, w.capture)
}

type writeOnly struct{ io.Writer }
