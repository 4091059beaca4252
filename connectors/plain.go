package connectors

import (
	"net"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Plain returns the decode body of a request served without a prefill (a
// pool's "fallback" policy): the client's body without client-sent protocol
// fields. The decode engine then computes the prompt itself.
func Plain(client jsonedit.Object) []byte { return engineBody(client) }

// PlainPieces appends Plain's body to dst as pieces of the client body, for
// a call that sends it on (a render) without a copy of the prompt.
func PlainPieces(dst net.Buffers, client jsonedit.Object) net.Buffers {
	return enginePieces(dst, client)
}
