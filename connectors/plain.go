package connectors

import "github.com/pdx-router/pdx/internal/jsonedit"

// Plain returns the decode body of a request served without a prefill (a
// pool's "fallback" policy): the client's body without client-sent protocol
// fields. The decode engine then computes the prompt itself.
func Plain(client jsonedit.Object) []byte { return engineBody(client) }

// MultipleChoices reports whether c can serve requests for n > 1 choices. A
// disaggregated prefill hands over the KV of one sequence; only connectors
// whose decode recomputes or shares the prefix (a connector says so with a
// MultipleChoices method) can fan it out.
func MultipleChoices(c Connector) bool {
	mc, ok := c.(interface{ MultipleChoices() bool })
	return ok && mc.MultipleChoices()
}
