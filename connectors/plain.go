package connectors

import "github.com/pdx-router/pdx/internal/jsonedit"

// Plain returns the decode body of a request served without a prefill (a
// pool's "fallback" policy): the client's body without client-sent protocol
// fields. The decode engine then computes the prompt itself.
func Plain(client jsonedit.Object) []byte { return engineBody(client) }
