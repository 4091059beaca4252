package connectors

import (
	"context"
	"net"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// HTTP is the out-of-band KV protocol (LMCache and other shared KV stores):
// the prefill engine writes the prompt's KV to the store, the decode engine
// finds it there by the prompt's hash. Nothing about the transfer travels in
// the requests, so the decode body is the client's (minus any client-sent
// protocol fields). Registered as "http" and "lmcache".
type HTTP struct{}

var _ Connector = HTTP{}

func httpSpec() Spec {
	// n > 1 works: the decode engine finds the prompt's KV in the store and
	// samples as many sequences as asked. Any decode engine finds it there,
	// so a decode may fall back to another.
	traits, build := fixed(HTTP{}, Traits{Prefills: true, MultipleChoices: true, DecodeFallback: true})
	return Spec{Names: []string{"http", "lmcache"}, Fields: []string{FieldDPSize}, Traits: traits, New: build}
}

// Prepare implements [Connector]. The prefill runs to its end before the
// decode is sent, so the KV is in the store when the decode looks for it.
func (HTTP) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	answer, err := env.Engine.Post(ctx, req.Prefill, req.Path, req.ID, req.PrefillRank, httpPrefillBody(APIOf(req.Path), req.Body))
	if err != nil {
		return Handoff{}, engineFailure(req.Prefill, err)
	}
	return Handoff{Decode: Decode{Body: engineBody(req.Body), Rank: req.DecodeRank}, Prefilled: prefilledOf(answer)}, nil
}

func httpPrefillBody(api API, client jsonedit.Object) net.Buffers {
	var buf [maxEdits]jsonedit.Edit
	return enginePieces(nil, client, prefillOnlyEdits(buf[:0], api, client)...)
}
