package processor

import (
	"context"
	"fmt"

	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// FULL_DUPLEX_STREAMED request bodies, the mode of the Gateway API Inference
// Extension's endpoint pickers: Envoy streams the body to pdx in chunks as
// they arrive, without waiting for pdx's answer to the headers, and forwards
// whatever pdx streams back. pdx holds its answer to the headers until the
// body has ended, then answers the headers (the decode endpoint) and streams
// the decode body back. Envoy says which mode its filter uses in the
// protocol_config of a stream's first message; pdx needs no setting of its
// own.

// streamedBody is a FULL_DUPLEX_STREAMED request body on its way through
// pdx.
type streamedBody struct {
	// chunks are the chunks received so far, len their length, trailers
	// whether trailers ended the body.
	chunks   [][]byte
	len      int
	trailers bool
	// queued are the answers to send after the one handle returned: the
	// decode body's chunks.
	queued []*extprocv3.ProcessingResponse
}

// streamedChunkBytes bounds each StreamedBodyResponse chunk pdx sends.
// Envoy recommends at most 64 KiB. Through a real Envoy, 1 MB prompts took
// the same time with 16 KiB, 64 KiB, 256 KiB or single-chunk answers.
const streamedChunkBytes = 64 << 10

// duplex reports whether Envoy streams the request body in
// FULL_DUPLEX_STREAMED mode.
func (r *request) duplex() bool {
	return r.filter.GetRequestBodyMode() == filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// checkBodyMode refuses filter configurations pdx cannot route with: only a
// buffered or a full-duplex body lets pdx rewrite the body together with the
// headers. Without a protocol_config (older Envoys) pdx assumes
// BUFFERED, and a partial body chunk says otherwise (see requestBody).
func (r *request) checkBodyMode() error {
	if r.filter == nil {
		return nil
	}
	switch m := r.filter.GetRequestBodyMode(); m {
	case filterextprocv3.ProcessingMode_BUFFERED, filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return nil
	default:
		return fmt.Errorf("%w: the ext_proc filter sends the request body in mode %s; configure request_body_mode BUFFERED or FULL_DUPLEX_STREAMED", errConfig, m)
	}
}

// bodyChunk takes one chunk of a FULL_DUPLEX_STREAMED request body. Nothing
// is answered until the body has ended; then the request is routed.
func (r *request) bodyChunk(ctx context.Context, b *extprocv3.HttpBody) (*extprocv3.ProcessingResponse, error) {
	// The message's own bytes are kept, not copied: nothing else uses them.
	r.body.chunks = append(r.body.chunks, b.GetBody())
	r.body.len += len(b.GetBody())
	if max := r.table.MaxBodyBytes(); max > 0 && r.body.len > max {
		// Stop at once: the rest of the body need not reach pdx.
		return nil, &apiError{status: 413, typ: typeInvalidRequest, code: "body_too_large",
			msg: fmt.Sprintf("the request body is at least %d bytes, over the limit of %d", r.body.len, max)}
	}
	if !b.GetEndOfStream() {
		return nil, nil
	}
	return r.bodyEnded(ctx, false)
}

// bodyEnded routes a FULL_DUPLEX_STREAMED request once its body is complete:
// with the last chunk, or with the trailers that follow a body whose last
// chunk did not end the stream.
func (r *request) bodyEnded(ctx context.Context, trailers bool) (*extprocv3.ProcessingResponse, error) {
	var body []byte
	switch len(r.body.chunks) {
	case 0:
	case 1:
		body = r.body.chunks[0]
	default:
		body = make([]byte, 0, r.body.len) // the one copy: the parser needs contiguous bytes
		for _, c := range r.body.chunks {
			body = append(body, c...)
		}
	}
	r.body.chunks = nil
	r.body.trailers = trailers
	return r.bodyDone(ctx, body)
}

// takeQueued returns the answers that follow the last one handle returned.
func (r *request) takeQueued() []*extprocv3.ProcessingResponse {
	q := r.body.queued
	r.body.queued = nil
	return q
}

// streamedRequestBody cuts body into StreamedBodyResponse chunks; the last
// one ends the stream unless trailers follow. The chunks share body's bytes.
func streamedRequestBody(body []byte, endOfStream bool) []*extprocv3.ProcessingResponse {
	out := make([]*extprocv3.ProcessingResponse, 0, len(body)/streamedChunkBytes+1)
	for start := 0; ; start += streamedChunkBytes {
		end := min(start+streamedChunkBytes, len(body))
		last := end == len(body)
		out = append(out, streamedRequestChunk(body[start:end], last && endOfStream))
		if last {
			return out
		}
	}
}

func streamedRequestChunk(b []byte, endOfStream bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{BodyMutation: streamedMutation(b, endOfStream)},
	}}}
}

func streamedMutation(b []byte, endOfStream bool) *extprocv3.BodyMutation {
	return &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: endOfStream},
	}}
}

// passRequestBody answers a request body chunk pdx leaves as it is. In
// FULL_DUPLEX_STREAMED mode Envoy forwards only what pdx sends back, so the
// chunk is echoed.
func (r *request) passRequestBody(b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if !r.duplex() {
		return continueRequestBody()
	}
	return streamedRequestChunk(b.GetBody(), b.GetEndOfStream())
}

// passResponseBody is passRequestBody for the response body, for filters
// that send it to pdx.
func (r *request) passResponseBody(b *extprocv3.HttpBody) *extprocv3.ProcessingResponse {
	if !r.duplexResponse() {
		return continueResponseBody()
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{
		Response: &extprocv3.CommonResponse{BodyMutation: streamedMutation(b.GetBody(), b.GetEndOfStream())},
	}}}
}

// observesResponse reports whether Envoy sends pdx the response body (the
// InferencePool integrations' FULL_DUPLEX_STREAMED response), so that the
// request's record can wait for the response's end.
func (r *request) observesResponse() bool {
	m := r.filter.GetResponseBodyMode()
	return m != filterextprocv3.ProcessingMode_NONE
}

// duplexResponse reports whether Envoy streams the response body to pdx in
// FULL_DUPLEX_STREAMED mode, forwarding only what pdx sends back.
func (r *request) duplexResponse() bool {
	return r.filter.GetResponseBodyMode() == filterextprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
}
