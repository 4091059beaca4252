package connectors

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net"
	"slices"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// The members through which engines take KV transfer instructions, as the
// specs list them in ClientKeys.
const (
	keyKVTransferParams    = "kv_transfer_params"   // vLLM (NIXL, Mooncake)
	keyBootstrapHost       = "bootstrap_host"       // SGLang
	keyBootstrapPort       = "bootstrap_port"       // SGLang
	keyBootstrapRoom       = "bootstrap_room"       // SGLang
	keyDisaggregatedParams = "disaggregated_params" // TensorRT-LLM
	// SGLang's data-parallel ranks: the rank to serve the request, and a
	// decode's prefill rank, whose bootstrap it takes the KV from.
	// data_parallel_rank is routed_dp_rank's deprecated name, which SGLang
	// still reads. pdx picks ranks; a client's would pin an engine rank of
	// its choosing, or point a decode at another rank's bootstrap.
	keyRoutedDPRank        = "routed_dp_rank"
	keyDisaggPrefillDPRank = "disagg_prefill_dp_rank"
	keyDataParallelRank    = "data_parallel_rank"
)

// keySGLangRID is SGLang's request id. A client's would let it collide with
// another request's or be aborted with it; pdx's replaces it.
const keySGLangRID = "rid"

// clientKeyDeletes are the edits that remove every connector's ClientKeys,
// built once from the specs: whatever the pool's connector, a client can
// set no protocol's keys.
var clientKeyDeletes = deletes(specs())

// deletes returns the edits deleting the ClientKeys of all, each once.
func deletes(all []Spec) []jsonedit.Edit {
	var edits []jsonedit.Edit
	for _, s := range all {
		for _, key := range s.ClientKeys {
			if !slices.ContainsFunc(edits, func(e jsonedit.Edit) bool { return e.Key == key }) {
				edits = append(edits, jsonedit.Delete(key))
			}
		}
	}
	return edits
}

// stripped appends to dst the edits that remove every client-sent protocol
// field and every null optional member pdx reads, followed by edits. Since
// the last edit of a key wins, a connector's own value for one of those keys
// replaces the client's in place; keys the connector does not write are
// removed. jsonedit compares keys unescaped, so "kv_transfer_param\u0073" is
// removed (or replaced) too.
func stripped(dst []jsonedit.Edit, client jsonedit.Object, edits ...jsonedit.Edit) []jsonedit.Edit {
	dst = append(dst, clientKeyDeletes...)
	// OpenAI clients send null for options they leave unset, and pdx reads
	// null as absent. Engines do not all agree (SGLang's "stream" is a
	// plain bool, vLLM's completions "n" a plain int): they get such
	// members left out, so that they read the request as pdx did.
	for _, key := range [...]string{"stream", "stream_options", "max_tokens", "max_completion_tokens", "n"} {
		if raw, ok := client.Raw(key); ok && string(raw) == "null" {
			dst = append(dst, jsonedit.Delete(key))
		}
	}
	return append(dst, edits...)
}

// present reports whether the client set key to something other than null.
func present(client jsonedit.Object, key string) bool {
	raw, ok := client.Raw(key)
	return ok && string(raw) != "null"
}

// maxEdits is the number of edits (protocol fields stripped included) that
// engineBody and its callers gather on the stack, without allocating.
const maxEdits = 24

// engineBody returns the client body without client-sent protocol fields and
// with edits applied; every other member keeps its bytes and position. The
// body is allocated once, at its exact size.
func engineBody(client jsonedit.Object, edits ...jsonedit.Edit) []byte {
	var buf [maxEdits]jsonedit.Edit
	return client.Edited(stripped(buf[:0], client, edits...)...)
}

// enginePieces appends to dst engineBody as pieces of the client body and
// the edits, for a prefill: the engine client sends them one after another,
// so the prefill body costs no copy of the prompt (a request in flight holds
// its prompt once, not twice). The pieces refer to edits' values, which must
// stay unchanged until the prefill is sent.
func enginePieces(dst net.Buffers, client jsonedit.Object, edits ...jsonedit.Edit) net.Buffers {
	var buf [maxEdits]jsonedit.Edit
	return client.EditedPieces(dst, stripped(buf[:0], client, edits...)...)
}

// Fixed JSON values of prefill edits. They are only ever read (see
// stateless_test.go): package-level so that the edits referring to them
// need no allocation per request.
var (
	jsonFalse = []byte("false")
	jsonOne   = []byte("1")
)

// appendJSONString appends s as a JSON string.
func appendJSONString(dst []byte, s string) []byte {
	// Marshalling a string cannot fail; invalid UTF-8 becomes U+FFFD.
	quoted, _ := json.Marshal(s)
	return append(dst, quoted...)
}

// engineFailure makes sure an engine call's error is an *engines.Error naming
// ep, as [Engine] promises and the processor relies on to choose the
// client's status. Errors of conforming engines pass unchanged.
func engineFailure(ep endpoint.Endpoint, err error) error {
	if ee, ok := err.(*engines.Error); ok {
		if ee.Endpoint == (endpoint.Endpoint{}) {
			named := *ee
			named.Endpoint = ep
			return &named
		}
		return err
	}
	if _, ok := errors.AsType[*engines.Error](err); ok {
		return err
	}
	return &engines.Error{Endpoint: ep, Err: err}
}

// startPrefill posts the prefill in a goroutine of its own and returns it as
// Pending: its channel receives exactly one value, nil on success, and is
// buffered, so the goroutine never waits for a reader; it ends when Post
// returns, which an [Engine] does once ctx is done. The answer's body is
// discarded (the engine client has read it to the end). failed, if not nil,
// is called before a failure is delivered.
func startPrefill(ctx context.Context, engine Engine, ep endpoint.Endpoint, path, requestID string, rank endpoint.Rank, body net.Buffers, failed func()) Pending {
	done := make(chan error, 1)
	go func() {
		_, err := engine.Post(ctx, ep, path, requestID, rank, body)
		if err != nil {
			err = engineFailure(ep, err)
			if failed != nil {
				failed()
			}
		}
		done <- err
	}()
	return running(done)
}

// running is a prefill's outcome channel as [Pending]; a channel is a
// pointer, so the conversion allocates nothing.
type running <-chan error

// Done implements [Pending].
func (r running) Done() <-chan error { return r }

// uuidHex returns a random UUID (version 4) as 32 hex digits, as Python's
// uuid4().hex spells it. Ids that engines key KV by are made fresh per
// attempt, never taken from the client, whose X-Request-Id may repeat.
func uuidHex() string {
	var b [32]byte
	return string(appendUUIDHex(b[:0]))
}

// appendUUIDHex appends uuidHex's digits to dst.
func appendUUIDHex(dst []byte) []byte {
	var u [16]byte
	_, _ = rand.Read(u[:])  // never fails (crypto/rand since Go 1.24)
	u[6] = u[6]&0x0f | 0x40 // version 4
	u[8] = u[8]&0x3f | 0x80 // RFC 4122 variant
	return hex.AppendEncode(dst, u[:])
}
