package realvllm

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// loadAdapter loads the test LoRA adapter into e at run time under name
// (POST /v1/load_lora_adapter, which VLLM_ALLOW_RUNTIME_LORA_UPDATING
// allows); one loaded already is fine.
func loadAdapter(t *testing.T, e *realvllm.Engine, name string) {
	t.Helper()
	hc := httpClient(t)
	body, _ := json.Marshal(map[string]string{"lora_name": name, "lora_path": engines.in.LoRA})
	status, answer := postRaw(t, hc, e.URL()+"/v1/load_lora_adapter", string(body))
	if status == http.StatusBadRequest && strings.Contains(answer, "already been loaded") {
		return
	}
	require.Equal(t, http.StatusOK, status, "%s: loading %s: %s", e.Name(), name, answer)
}

// loadAdapters loads names into the prefill engines, the NIXL set's
// engines with LoRA.
func loadAdapters(t *testing.T, s *nixlSet, names ...string) {
	t.Helper()
	for _, e := range s.prefill {
		for _, n := range names {
			loadAdapter(t, e, n)
		}
	}
}

// aggregated are a stack whose pool serves requests on the prefill engines
// alone, as aggregated engines (connector none: no prefill leg): vLLM 0.32
// on CPU cannot run a NIXL consumer with LoRA (see nixlSet). pdx reads
// their KV events in mode dial.
func aggregated(s *nixlSet, poolYAML string) stack.Options {
	o := s.options(poolYAML)
	o.Connector = "none"
	o.External.Decode = nil
	for _, p := range s.prefill {
		e := endpoint(p)
		e.KVAddr = ""
		o.External.Decode = append(o.External.Decode, e)
	}
	o.External.Prefill = nil
	return o
}

// servedOn sends c through the stack and returns the engine of es that
// served it, from the engines' own count of finished requests.
func servedOn(t *testing.T, hc *http.Client, st *stack.Stack, c call, es []*realvllm.Engine) int {
	t.Helper()
	before := make([]float64, len(es))
	for i, e := range es {
		before[i] = successes(t, e)
	}
	got := send(t, hc, st.URL(), c)
	require.Equal(t, http.StatusOK, got.status, got.raw)
	on := -1
	for i, e := range es {
		if successes(t, e) > before[i] {
			require.Equal(t, -1, on, "one engine served it")
			on = i
		}
	}
	require.NotEqual(t, -1, on, "an engine served it")
	return on
}

// TestKVEventsLoRABlocks: an adapter's blocks are published with its name
// (lora_name, extra keys), and pdx matches them to requests for that
// adapter: a prompt warmed with adapter lora-a on one engine, behind pdx's
// back, brings the follow-up for lora-a there.
func TestKVEventsLoRABlocks(t *testing.T) {
	s := engines.nixlEngines(t)
	loadAdapters(t, s, "lora-a")
	st := startStack(t, aggregated(s, ""), s.prefill...)
	hc := httpClient(t)
	for i, e := range []int{1, 0, 1} {
		text := prompt(fmt.Sprintf("an adapter's document %d", i))
		c := chat(text, 4).with("model", "lora-a")
		before := pdxBlocks(t, st, s.prefill[e])
		waitBlocks(t, st, s.prefill[e], before+warm(t, hc, s.prefill[e], c))
		got := servedOn(t, hc, st, chat(text+" And a question about it?", 4).with("model", "lora-a"), s.prefill)
		require.Equal(t, e, got, "lora-a's prompt %d, warmed on prefill-%d, served on prefill-%d", i, e, got)
	}
}

// TestLoRAAffinity: adapters loaded at run time, each engine holding one at
// a time (--max-loras 1). A pool that lists them keeps each adapter's
// requests on the engine that has it, by vLLM's lora_requests_info and
// what pdx sent where, rather than making engines swap adapters.
func TestLoRAAffinity(t *testing.T) {
	s := engines.nixlEngines(t)
	loadAdapters(t, s, "lora-a", "lora-b")
	st := startStack(t, aggregated(s, "lora: {adapters: [lora-a, lora-b]}"), s.prefill...)
	hc := httpClient(t)
	on := map[string]map[int]bool{"lora-a": {}, "lora-b": {}}
	for i := range 6 {
		adapter := []string{"lora-a", "lora-b"}[i%2]
		c := completion(prompt(fmt.Sprintf("adapter request %d", i)), 4).with("model", adapter)
		on[adapter][servedOn(t, hc, st, c, s.prefill)] = true
	}
	require.Len(t, on["lora-a"], 1, "lora-a's requests stayed on one engine: %v", on)
	require.Len(t, on["lora-b"], 1, "lora-b's requests stayed on one engine: %v", on)
	require.NotEqual(t, on["lora-a"], on["lora-b"], "the adapters went to different engines")
	fams := pdxMetrics(t, st)
	require.Equal(t, 4.0, value(fams, "pdx_lora_picks_total", map[string]string{"leg": "decode", "outcome": "loaded"}))
	require.Equal(t, 2.0, value(fams, "pdx_lora_picks_total", map[string]string{"leg": "decode", "outcome": "free_slot"}))
}
