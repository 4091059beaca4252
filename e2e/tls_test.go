package e2e

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// pdx's gRPC listener with mutual TLS: Envoy with the client certificate
// routes as usual; an Envoy without it is refused by pdx, and the request
// fails closed with a clear error.
func TestMutualTLS(t *testing.T) {
	pki, err := stack.NewPKI(t.TempDir())
	require.NoError(t, err)

	t.Run("Envoy with its client certificate", func(t *testing.T) {
		st := startStack(t, stack.Options{PKI: pki})
		_, hc := newClient(t, st)
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"over mTLS","max_tokens":2}`)
		require.Equal(t, 200, a.status, a.body)
		requireHandoff(t, st, "over mTLS")
		require.Contains(t, st.PdxLog(), `"mtls":true`)
	})

	t.Run("Envoy without a client certificate", func(t *testing.T) {
		st := startStack(t, stack.Options{PKI: pki, EnvoyWithoutClientCert: true})
		_, hc := newClient(t, st)
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"no cert","max_tokens":2}`)
		requireAPIError(t, a, 503, "router_unavailable", "ext_proc")
		requireNoEngineTraffic(t, st)
	})
}
