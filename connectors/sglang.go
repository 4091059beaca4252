package connectors

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"net"
	"strconv"
	"time"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// SGLang is SGLang's PD disaggregation protocol, as its router drives it:
// both legs get the same body naming the prefill engine's bootstrap server
// and a random room; prefill and decode run at the same time and meet in
// that room. The prefill is sent as the client wrote it (no prefill-only
// edits: the SGLang prefill server stops after the first token itself).
type SGLang struct{}

var (
	_ Connector = SGLang{}
	_ Held      = (*sglangHeld)(nil)
)

func sglangSpec() Spec {
	// No decode fallback: the prefill sends its KV to the decode that
	// registered the bootstrap room, and a room serves one attempt.
	traits, build := fixed(SGLang{}, Traits{Prefills: true, Concurrent: true, NotDisaggregated: sglangNotDisaggregated})
	// rid is not among the client keys: this connector replaces a
	// client's itself, and other pools' engines get it as sent.
	return Spec{Names: []string{"sglang"}, Fields: []string{FieldDPSize}, Traits: traits, New: build,
		ClientKeys: []string{keyBootstrapHost, keyBootstrapPort, keyBootstrapRoom, keyRoutedDPRank, keyDisaggPrefillDPRank, keyDataParallelRank}}
}

// sglangNotDisaggregated are the APIs SGLang serves but not under a
// router's P/D: its Messages handler builds a new chat request from the
// Anthropic fields alone, dropping bootstrap_* and rid
// (python/sglang/srt/entrypoints/anthropic/request_conversion.py,
// convert_anthropic_to_openai_request), its Responses handler sends each
// turn through a PD router of its own (entrypoints/openai/pd_responses.py,
// routed_turn, which pops the bootstrap fields), and its own PD router
// routes neither (sgl-model-gateway src/routers/http/pd_router.rs: the
// PDRouter's RouterTrait routes generate, chat, completions and rerank).
const sglangNotDisaggregated = APIResponses | APIMessages

// Prepare implements [Connector].
func (SGLang) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	host := req.Prefill.Host()
	if host == "" {
		return Handoff{}, &engines.Error{Endpoint: req.Prefill, Message: "address is not ip:port"}
	}
	rid := sglangRID()
	room := alignRoom(sglangRoom(), req.Prefill.DPSize, req.PrefillRank)
	b := sglangBootstrap{host: host, port: req.Prefill.Bootstrap(), room: room, rid: rid}
	prefill := sglangBody(req.Body, b, req.PrefillRank, endpoint.Rank{})
	decode := prefill
	if req.PrefillRank != (endpoint.Rank{}) || req.DecodeRank != (endpoint.Rank{}) {
		decode = sglangBody(req.Body, b, req.DecodeRank, req.PrefillRank)
	}
	return Handoff{
		Decode:  Decode{Body: decode},
		Prefill: startPrefill(ctx, env.Engine, req.Prefill, req.Path, req.ID, endpoint.Rank{}, net.Buffers{prefill}, nil),
		Held:    &sglangHeld{rid: rid, id: req.ID, decode: req.Decode, prefill: req.Prefill},
	}, nil
}

// alignRoom returns room, in [0, 2^63-1], moved within its block of size
// rooms to the one that is rank modulo size, when rank is set (rank <
// size). The decode is told the prefill's rank (disagg_prefill_dp_rank),
// but a decode that finds it no other way takes room % dp_size as the
// prefill's rank when the prefill follows bootstrap rooms: aligned, every
// way of reading it agrees, as SGLang's own router aligns rooms.
func alignRoom(room uint64, size int, rank endpoint.Rank) uint64 {
	r, ok := rank.Get()
	if !ok || size <= 1 {
		return room
	}
	s := uint64(size)
	aligned := room - room%s + uint64(r)
	if aligned > math.MaxInt64 {
		aligned -= s // the last block is partial; the one before is whole
	}
	return aligned
}

// sglangRoom returns a fresh random room in [0, 2^63-1], the range SGLang's
// router uses (the engine keeps rooms as int64). math/rand/v2's top-level
// generator is safe for concurrent use and seeded from the OS; a room is a
// rendezvous key, not a secret, since clients cannot set it.
func sglangRoom() uint64 { return uint64(rand.Int64()) }

// sglangRID returns a fresh request id for both legs. SGLang takes a
// request's id from the body's "rid" (it ignores X-Request-Id), and its
// /abort_request matches ids by prefix: pdx's ids all have one length, so
// none is a prefix of another, and a client's rid is replaced.
func sglangRID() string {
	var b [4 + 32]byte
	return string(appendUUIDHex(append(b[:0], "pdx-"...)))
}

// sglangBootstrap is where and under which ids the two legs meet.
type sglangBootstrap struct {
	host string
	port int
	room uint64
	rid  string
}

// sglangBody is the body of a leg: the client's plus the bootstrap fields,
// the request id and, when set, the DP rank that is to serve it
// (routed_dp_rank) and, on the decode, the prefill's rank, whose bootstrap
// the decode takes the KV from (disagg_prefill_dp_rank), as SGLang's router
// sends them. Without ranks both legs get the same body. The room is
// written as integer text, never through float64.
func sglangBody(client jsonedit.Object, b sglangBootstrap, routed, prefill endpoint.Rank) []byte {
	edits := [...]jsonedit.Edit{
		jsonedit.Set(keyBootstrapHost, appendJSONString(nil, b.host)),
		jsonedit.Set(keyBootstrapPort, strconv.AppendInt(nil, int64(b.port), 10)),
		jsonedit.Set(keyBootstrapRoom, strconv.AppendUint(nil, b.room, 10)),
		jsonedit.Set(keySGLangRID, appendJSONString(nil, b.rid)),
		{}, {},
	}
	n := 4
	if r, ok := routed.Get(); ok {
		edits[n] = jsonedit.Set(keyRoutedDPRank, strconv.AppendInt(nil, int64(r), 10))
		n++
	}
	if r, ok := prefill.Get(); ok {
		edits[n] = jsonedit.Set(keyDisaggPrefillDPRank, strconv.AppendInt(nil, int64(r), 10))
		n++
	}
	return engineBody(client, edits[:n]...)
}

// sglangAbortRetry is when the abort is sent a second time. SGLang answers
// 200 to an abort of a request it does not know yet and forgets it: the
// decode may still be on its way through Envoy when pdx gives up on it.
const sglangAbortRetry = 500 * time.Millisecond

// sglangHeld is a request both SGLang engines hold: a decode waiting for
// its KV holds pre-allocated KV pages, a prefill waiting for its decode
// holds the KV. Both let go of it when aborted by its rid.
type sglangHeld struct {
	rid             string
	id              string // X-Request-Id of the aborts
	decode, prefill endpoint.Endpoint
}

// Release implements [Held]: it asks both engines to abort the request by
// its rid (SGLang's /abort_request). A decode waiting for KV that will not
// come frees its pre-allocated KV pages at once instead of after
// SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s), or when SGLang notices that
// its client went away (it checks every 4 s); a prefill waiting for its
// decode frees its KV. Aborting a request that already ended is a no-op.
func (h *sglangHeld) Release(ctx context.Context, env Env) error {
	abort := append(appendJSONString([]byte(`{"rid":`), h.rid), '}')
	var errs []error
	for i := range 2 {
		if i > 0 {
			select {
			case <-time.After(sglangAbortRetry):
			case <-ctx.Done():
				return errors.Join(append(errs, ctx.Err())...)
			}
		}
		errs = errs[:0]
		for _, ep := range []endpoint.Endpoint{h.decode, h.prefill} {
			if _, err := env.Engine.Post(ctx, ep, "/abort_request", h.id, endpoint.Rank{}, net.Buffers{abort}); err != nil {
				errs = append(errs, engineFailure(ep, err))
			}
		}
	}
	return errors.Join(errs...)
}
