package connectors

import (
	"context"
	"math/rand/v2"
	"net"
	"strconv"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// SGLang is SGLang's PD disaggregation protocol, as its router drives it:
// both legs get the same body naming the prefill engine's bootstrap server
// and a random room; prefill and decode run at the same time and meet in
// that room. The prefill is sent as the client wrote it (no prefill-only
// edits: the SGLang prefill server stops after the first token itself).
type SGLang struct{}

// Concurrent reports that the prefill still runs when Prepare returns.
func (SGLang) Concurrent() bool { return true }

// Prepare implements [Connector].
func (SGLang) Prepare(ctx context.Context, engine Engine, req *Request) (Decode, error) {
	host := req.Prefill.Host()
	if host == "" {
		return Decode{}, &EngineError{Endpoint: req.Prefill, Message: "address is not ip:port"}
	}
	body := sglangBody(req.Body, host, req.Prefill.Bootstrap(), sglangRoom())
	return Decode{Body: body, Prefill: startPrefill(ctx, engine, req.Prefill, req.Path, req.ID, net.Buffers{body})}, nil
}

// sglangRoom returns a fresh random room in [0, 2^63-1], the range SGLang's
// router uses (the engine keeps rooms as int64). math/rand/v2's top-level
// generator is safe for concurrent use and seeded from the OS; a room is a
// rendezvous key, not a secret, since clients cannot set it.
func sglangRoom() uint64 { return uint64(rand.Int64()) }

// sglangBody is the body of both legs: the client's plus the bootstrap
// fields. The room is written as integer text, never through float64.
func sglangBody(client jsonedit.Object, host string, port int, room uint64) []byte {
	return engineBody(client,
		jsonedit.Set(keyBootstrapHost, appendJSONString(nil, host)),
		jsonedit.Set(keyBootstrapPort, strconv.AppendInt(nil, int64(port), 10)),
		jsonedit.Set(keyBootstrapRoom, strconv.AppendUint(nil, room, 10)))
}
