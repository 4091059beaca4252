package realvllm

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
)

// The engine restart runs after the other tests of the NIXL engines (files
// run in name order): it costs an engine start, and a restarted engine
// has lost what was loaded into it at run time.

// TestKVEventsEngineRestart: a prefill engine that dies fails its
// prefills, which the pool's fallback serves on the decode engine; once it
// is started again (same address, an empty cache) its publisher's sequence
// starts from 0, and pdx forgets the blocks it held before.
func TestKVEventsEngineRestart(t *testing.T) {
	s := engines.nixlEngines(t)
	p := s.prefill[1]
	st := startStack(t, s.options("on_prefill_failure: fallback\nprefill_attempts: 1", p), p, s.decode)
	hc := httpClient(t)

	c := chat(prompt("served before the engine died"), 4)
	got := send(t, hc, st.URL(), c)
	require.Equal(t, http.StatusOK, got.status, got.raw)
	waitBlocks(t, st, p, 1)

	p.Kill()
	c = chat(prompt("served while the prefill engine is dead"), 4)
	before := sourcesOf(t, s.decode)
	got = send(t, hc, st.URL(), c)
	require.Equal(t, http.StatusOK, got.status, got.raw)
	d := sourcesOf(t, s.decode).minus(before)
	require.Zero(t, d.external, "no prefill engine handed off")
	require.Positive(t, d.local, "the decode engine computed the prompt itself")
	require.Equal(t, reference(t, hc, s.decode, c).text, got.text)

	start := time.Now()
	require.NoError(t, p.Restart(context.Background()))
	t.Logf("prefill-1 restarted in %v", time.Since(start).Round(time.Second))
	restarts := value(pdxMetrics(t, st), "pdx_kv_cache_resets_total", map[string]string{"reason": "restart"})
	c = chat(prompt("served after the restart"), 4)
	before = sourcesOf(t, s.decode)
	got = send(t, hc, st.URL(), c)
	require.Equal(t, http.StatusOK, got.status, got.raw)
	requireHandedOff(t, sourcesOf(t, s.decode).minus(before), "after the restart")
	fresh := float64(got.promptTokens / realvllm.BlockSize)
	require.Eventually(t, func() bool {
		return value(pdxMetrics(t, st), "pdx_kv_cache_resets_total", map[string]string{"reason": "restart"}) > restarts
	}, eventsWait, 100*time.Millisecond, "pdx saw the publisher's sequence start again")
	require.Eventually(t, func() bool { return pdxBlocks(t, st, p) == fresh }, eventsWait, 100*time.Millisecond,
		"pdx holds only what the restarted engine stored")
}
