package connectors

import "context"

// None serves pools of aggregated engines, which compute the prompt and the
// output themselves: pdx only picks the decode endpoint and strips client-sent
// protocol fields. It is also the baseline that separates the cost of pdx's
// ext_proc exchange from that of a prefill hop.
type None struct{}

// Prepare returns the plain client body; no engine is called.
func (None) Prepare(_ context.Context, _ Env, req *Request) (Handoff, error) {
	return Handoff{Decode: Decode{Body: engineBody(req.Body), Rank: req.DecodeRank}}, nil
}

var _ Connector = None{}

func noneSpec() Spec {
	// No prefill leg: n > 1 is the engine's own business, and any engine
	// can serve the request (decode fallback).
	traits, build := fixed(None{}, Traits{MultipleChoices: true, DecodeFallback: true})
	return Spec{Names: []string{"none"}, Fields: []string{FieldDPSize}, Traits: traits, New: build}
}
