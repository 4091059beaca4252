package connectors

import "context"

// None serves pools of aggregated engines, which compute the prompt and the
// output themselves: pdx only picks the decode endpoint and strips client-sent
// protocol fields. It is also the baseline that separates the cost of pdx's
// ext_proc exchange from that of a prefill hop.
type None struct{}

// Prepare returns the plain client body; no engine is called.
func (None) Prepare(_ context.Context, _ Env, req *Request) (Decode, error) {
	return Decode{Body: engineBody(req.Body)}, nil
}

// Prefills reports that pools of this connector have no prefill leg.
func (None) Prefills() bool { return false }

// Prefills reports whether c calls a prefill engine; a connector without a
// prefill leg says so with a Prefills method.
func Prefills(c Connector) bool {
	p, ok := c.(interface{ Prefills() bool })
	return !ok || p.Prefills()
}
