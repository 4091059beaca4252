package realvllm

import (
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// These tests run last (files run in name order): their engines replace
// the NIXL ones.

// TestHTTPConnectorSharedStorage: pdx's `http` connector over two engines
// of vLLM's ExampleConnector sharing a directory, which works on CPU: the
// prefill leg (a plain call, its answer discarded) leaves the prompt's KV
// in the directory and the decode engine loads it from there, counting it
// as external; the answer is the decode engine's own. The engines dial
// pdx's KV event socket (kv_events mode bind), naming themselves in their
// topics: pdx hears both.
func TestHTTPConnectorSharedStorage(t *testing.T) {
	s := engines.storageEngines(t)
	opts := stack.Options{
		Connector: "http", KVEvents: "bind", PrefillTimeout: 2 * time.Minute, LogLevel: slog.LevelDebug,
		External: &stack.External{Prefill: []stack.Endpoint{{Addr: s.prefill.Addr()}}, Decode: []stack.Endpoint{{Addr: s.decode.Addr()}},
			KVBind: s.kvBind, BlockSize: realvllm.BlockSize},
		ConfigYAML: "engine_metrics: {interval: 500ms, stale_after: 5s}",
		PoolYAML:   "render: {timeout: 10s}",
	}
	st := startStack(t, opts, s.prefill, s.decode)
	hc := httpClient(t)
	for _, c := range []call{
		completion(prompt("shared storage, completions"), 6),
		chat(prompt("shared storage, chat"), 6).streamed(),
	} {
		before := sourcesOf(t, s.decode)
		got := send(t, hc, st.URL(), c)
		require.Equal(t, http.StatusOK, got.status, got.raw)
		d := sourcesOf(t, s.decode).minus(before)
		// ExampleConnector loads whole blocks of the prompt but its last
		// token; the decode computes the rest.
		require.Equal(t, float64((got.promptTokens-1)/realvllm.BlockSize*realvllm.BlockSize), d.external,
			"the decode engine loaded the prompt's whole blocks from the shared storage (%+v)", d)
		require.Less(t, d.local, float64(realvllm.BlockSize), "and computed only the rest (%+v)", d)
		require.Equal(t, reference(t, hc, s.decode, c).text, got.text)
	}
	for _, e := range []*realvllm.Engine{s.prefill, s.decode} {
		waitBlocks(t, st, e, 1)
	}
	fams := pdxMetrics(t, st)
	require.Zero(t, value(fams, "pdx_kv_events_total", map[string]string{"kind": "unknown_topics"}))
	require.Zero(t, value(fams, "pdx_kv_events_total", map[string]string{"kind": "decode_errors"}))
}
