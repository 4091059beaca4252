package processor

import (
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/usage"
)

// decodeResponse is what pdx reads of a decode's response as Envoy streams
// it: when its headers, its output's first byte (the first token: a
// Responses stream announces the response before it, which does not count
// when the body is read) and end came, and the token usage its body
// reports. The routing stream, when Envoy sends it the response
// (observe.go), and the observability pass (observer.go) both read
// responses, and record the TTFT split and usage, through it.
type decodeResponse struct {
	headersAt, firstAt, doneAt time.Time
	// usage reads the body's token usage; nil when the body is not read
	// (not 2xx, encoded, or not asked for).
	usage *usage.Reader
}

// read takes one message of the response at now. readUsage asks for the
// token usage of a 2xx body that is not encoded. It reports whether the
// message brought the body's first byte, and whether it ended the response.
func (d *decodeResponse) read(msg *extprocv3.ProcessingRequest, now time.Time, readUsage bool) (first, ended bool) {
	switch m := msg.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		h := m.ResponseHeaders
		d.headersAt = now
		if enc := header(h, "content-encoding"); readUsage && strings.HasPrefix(header(h, ":status"), "2") && (enc == "" || enc == "identity") {
			d.usage = usage.NewReader(strings.HasPrefix(header(h, "content-type"), "text/event-stream"))
		}
		ended = h.GetEndOfStream()
	case *extprocv3.ProcessingRequest_ResponseBody:
		b := m.ResponseBody.GetBody()
		started := len(b) > 0
		if d.usage != nil {
			_, _ = d.usage.Write(b) // scanned in place
			started = d.usage.Started()
		}
		if d.firstAt.IsZero() && started {
			d.firstAt, first = now, true
		}
		ended = m.ResponseBody.GetEndOfStream()
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		ended = true
	}
	if ended && d.doneAt.IsZero() {
		d.doneAt = now
	}
	return first, ended
}

// handoffStart is when a request's KV hand-off began: the prefill's
// answer; for a concurrent connector, whose prefill runs on, and a request
// decoded without a prefill (prefilled zero), pdx's routing answer.
func handoffStart(concurrent bool, prefilled, routed time.Time) time.Time {
	if prefilled.IsZero() || concurrent {
		return routed
	}
	return prefilled
}

// recordFirstByte records the TTFT split once the first byte is in: the
// hand-off, from handoff to the first byte, and the time to first token
// from the request's start. Times another pdx replica took may run ahead
// of this host's clock: such a split is not recorded.
func (d *decodeResponse) recordFirstByte(pm *metrics.Pool, start, handoff time.Time) {
	if d.firstAt.IsZero() {
		return
	}
	if h, ttft := d.firstAt.Sub(handoff), d.firstAt.Sub(start); h >= 0 && ttft >= 0 {
		pm.FirstByte(h, ttft)
	}
}

// recordDone records the decode, from the first byte to the end, and the
// answer's token usage.
func (d *decodeResponse) recordDone(pm *metrics.Pool) {
	if !d.firstAt.IsZero() && !d.doneAt.IsZero() {
		pm.DecodeDone(d.doneAt.Sub(d.firstAt))
	}
	if d.usage == nil {
		return
	}
	if u, ok := d.usage.Usage(); ok {
		pm.Tokens(u.Prompt, u.Cached, u.Completion)
	}
}
