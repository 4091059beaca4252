package stack

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// TestPdxReplicas runs three pdx replicas behind one Envoy: every replica
// serves some of the requests.
func TestPdxReplicas(t *testing.T) {
	st, err := Start(t.Context(), Options{PdxReplicas: 3})
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	require.Len(t, st.Replicas, 3)
	require.Same(t, st.Replicas[0], st.Pdx)

	for i := range 12 {
		body := fmt.Sprintf(`{"model": %q, "messages": [{"role": "user", "content": "replica prompt %d"}], "max_tokens": 2}`, Model, i)
		resp, err := http.Post(st.URL()+"/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, st.Logs())
	}
	metrics, err := st.ReplicaMetrics(t.Context())
	require.NoError(t, err)
	require.Len(t, metrics, 3)
	for i, body := range metrics {
		require.Positive(t, requestsTotalOf(body), "replica %d served none", i)
	}
}

// TestStartEngines starts the engines alone, as Start's own, for another
// router to front: no Envoy, no pdx, every engine serving.
func TestStartEngines(t *testing.T) {
	st, err := StartEngines(t.Context(), Options{Prefill: 1, Decode: 3})
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	require.Nil(t, st.Envoy)
	require.Nil(t, st.Pdx)
	require.Empty(t, st.Replicas)
	require.Len(t, st.Prefill, 1)
	require.Len(t, st.Decode, 3)
	for _, e := range st.Engines() {
		require.NoError(t, get(t.Context(), http.DefaultClient, "http://"+e.Addr()+"/health", nil))
	}
}

// TestDecodeCapacity: with DecodeCapacity the decode engines have it and
// the prefill engines Engine's, as each engine says (vLLM's
// cache_config_info).
func TestDecodeCapacity(t *testing.T) {
	c := enginesim.ReferenceCapacity(16, 0.25)
	c.KVBlocks = 100
	d := c
	d.KVBlocks = 7
	st, err := StartEngines(t.Context(), Options{Prefill: 1, Decode: 2, Engine: enginesim.Config{Capacity: &c}, DecodeCapacity: &d})
	require.NoError(t, err)
	t.Cleanup(func() { _ = st.Close() })
	for _, e := range st.Engines() {
		want := `num_gpu_blocks="100"`
		if slices.Contains(st.Decode, e) {
			want = `num_gpu_blocks="7"`
		}
		require.NoError(t, get(t.Context(), http.DefaultClient, "http://"+e.Addr()+"/metrics", func(body string) {
			require.Contains(t, body, want, e.Addr())
		}))
	}
}

// TestCheckConfig refuses a bad pool config without starting anything.
func TestCheckConfig(t *testing.T) {
	require.NoError(t, CheckConfig(Options{PoolYAML: "prefill_picker: {policy: round_robin}"}))
	require.ErrorContains(t, CheckConfig(Options{PoolYAML: "prefill_picker: {policy: nope}"}), "stack config")
	require.ErrorContains(t, CheckConfig(Options{PdxReplicas: 3, Peers: true, PeersYAML: "pick_jitter: 1s"}), "peers.pick_jitter")
}

// The replicas' peers config is the one a user writes: every replica's
// admin address, the profile's fields, config's defaults for the rest.
func TestPeersConfig(t *testing.T) {
	admins := []string{"127.0.0.1:9101", "127.0.0.1:9102"}
	eps := []endpoint{{addr: "127.0.0.1:8000"}}
	for _, tc := range []struct {
		more string
		want time.Duration
	}{
		{more: "", want: placement.DefaultPickJitter},
		{more: "pick_jitter: 0s", want: 0},
	} {
		opts := Options{Peers: true, PeersYAML: tc.more, Connector: "nixl", PrefillTimeout: time.Second}
		cfg, err := config.Parse([]byte(pdxConfig(opts, "", eps, eps, admins)))
		require.NoError(t, err)
		require.Equal(t, admins, cfg.GetPeers().GetAddresses())
		require.Equal(t, tc.want, cfg.GetPeers().GetPickJitter().AsDuration(), tc.more)
	}
	cfg, err := config.Parse([]byte(pdxConfig(Options{Connector: "nixl", PrefillTimeout: time.Second}, "", eps, eps, admins)))
	require.NoError(t, err)
	require.Nil(t, cfg.GetPeers(), "no peers unless asked")
}
