package routing

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
)

func TestLookup(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: big
  models: [big-model]
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
- name: rest
  default: true
  connector: nixl
  prefill_timeout: 2s
  prefill: [{address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:4}]
`))
	require.NoError(t, err)
	table, err := New(cfg)
	require.NoError(t, err)

	p, ok := table.Lookup("big-model")
	require.True(t, ok)
	require.Equal(t, "big", p.Name)
	prefill, _ := p.Prefill.Pick()
	decode, _ := p.Decode.Pick()
	require.Equal(t, "127.0.0.1:1", prefill.Address)
	require.Equal(t, "127.0.0.1:2", decode.Address)
	require.Equal(t, config.DefaultPrefillTimeout, p.PrefillTimeout)
	require.Equal(t, config.DefaultPrefillTimeout, p.AttemptTimeout)
	require.Equal(t, config.DefaultPrefillAttempts, p.Attempts)
	require.False(t, p.Fallback)

	p, ok = table.Lookup("anything-else")
	require.True(t, ok)
	require.Equal(t, "rest", p.Name)
	require.Equal(t, "2s", p.PrefillTimeout.String())

	cfg.Pools = cfg.Pools[:1]
	table, err = New(cfg)
	require.NoError(t, err)
	_, ok = table.Lookup("anything-else")
	require.False(t, ok, "no default pool")
}

func TestUnknownConnector(t *testing.T) {
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixel
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`))
	require.NoError(t, err)
	_, err = New(cfg)
	require.ErrorContains(t, err, `pools[0].connector: unknown connector "nixel" (known: http, lmcache, mooncake, nixl, none, p2p-nccl, sglang, trtllm)`)
}
