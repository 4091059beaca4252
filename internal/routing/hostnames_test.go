package routing

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// TestNamedEndpoints: a pool starts with the endpoints its config lists by
// IP (URLs written as host:port); those named by host name wait for the
// resolver, and a rebuilt pool that names hosts starts from its
// predecessor's endpoints, keeping their health.
func TestNamedEndpoints(t *testing.T) {
	parse := func(yaml string) *configv1.Config {
		cfg, err := config.Parse([]byte(yaml))
		require.NoError(t, err)
		return cfg
	}
	const yaml = `
pools:
- name: p
  models: [m]
  connector: p2p-nccl
  eject_after_failures: 1
  render: {address: "http://render:8000/"}
  prefill:
  - {address: "http://127.0.0.1:1", kv_address: "127.0.0.1:5601"}
  - {address: "http://vllm-prefill:8000/", kv_address: "vllm-prefill:5600", bootstrap_port: 9000}
  decode: [{address: "vllm-decode:8000", kv_address: "10.0.0.9:5600"}]
`
	cfg := parse(yaml)
	require.Equal(t, []endpoint.Endpoint{
		{Address: "127.0.0.1:1", KVAddress: "127.0.0.1:5601"},
		{Address: "vllm-prefill:8000", KVAddress: "vllm-prefill:5600", BootstrapPort: 9000},
	}, Endpoints(cfg.GetPools()[0].GetPrefill()))

	old, err := New(cfg)
	require.NoError(t, err)
	p, _ := old.Pool("p")
	require.Equal(t, []string{"127.0.0.1:1"}, p.Prefill.Set.Addresses())
	require.Empty(t, p.Decode.Set.Endpoints(), "named endpoints wait for the resolver")
	require.Equal(t, "render:8000", p.Render.Address)

	resolved := endpoint.Endpoint{Address: "10.0.0.5:8000", KVAddress: "10.0.0.5:5600", BootstrapPort: 9000}
	p.SetEndpoints(append(p.Prefill.Set.Endpoints(), resolved), []endpoint.Endpoint{{Address: "10.0.0.6:8000", KVAddress: "10.0.0.9:5600"}})
	p.Prefill.Report(resolved, false)
	require.False(t, p.Prefill.Set.Healthy(resolved))

	table, err := Rebuild(parse(yaml), old)
	require.NoError(t, err)
	p, _ = table.Pool("p")
	require.Equal(t, []string{"127.0.0.1:1", "10.0.0.5:8000"}, p.Prefill.Set.Addresses(), "the predecessor's resolved endpoints, until the resolver sets them")
	require.Equal(t, []string{"10.0.0.6:8000"}, p.Decode.Set.Addresses())
	require.False(t, p.Prefill.Set.Healthy(resolved), "an ejected engine stays ejected across the reload")
}
