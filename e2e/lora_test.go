package e2e

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// TestLoRAAdapterAwarePicking sends one sequence of requests for four
// adapters to two stacks side by side, each of two prefill and two decode
// engines with two adapter slots apiece: one pool lists the adapters, the
// other (the same pool without a lora config) picks blind to them. Both
// legs' engines load an adapter that is not on their GPU; adapter-aware
// picking must load at least 3× less often.
//
// The requests go one at a time, so the engines' gauges mostly show idle
// batches: the aware pool keeps adapters where it sent them by what it
// sent (the engines' LRU slots), and round robin on both makes the blind
// pool's count a function of the sequence alone, not of timing.
func TestLoRAAdapterAwarePicking(t *testing.T) {
	adapters := []string{"sql", "chat", "code", "math"}
	engine := enginesim.Config{
		LoRAModules: adapters,
		Capacity: &enginesim.Capacity{MaxRunning: 64, BlockTokens: 16, KVBlocks: 10000, PrefillTokensPerSec: 1e6,
			DecodeStep: time.Millisecond, MaxLoRA: 2, LoRALoad: 5 * time.Millisecond},
	}
	const pickers = "prefill_picker: {policy: round_robin}\ndecode_picker: {policy: round_robin}"
	aware := startStack(t, stack.Options{Engine: engine, PoolYAML: pickers + "\nlora: {adapters: [sql, chat, code, math]}"})
	blind := startStack(t, stack.Options{Engine: engine, PoolYAML: pickers})

	rng := rand.New(rand.NewPCG(22, 3))
	seq := make([]string, 60)
	for i := range seq {
		seq[i] = adapters[rng.IntN(len(adapters))]
	}
	loads := func(st *stack.Stack) int {
		n := 0
		for _, e := range st.Engines() {
			n += e.Tally().LoRALoads
		}
		return n
	}
	for _, st := range []*stack.Stack{aware, blind} {
		client, _ := newClient(t, st)
		for i, adapter := range seq {
			resp, err := client.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
				Model:     adapter,
				Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage(fmt.Sprintf("request %d for %s: a prompt long enough to take the prefill leg", i, adapter))},
				MaxTokens: openai.Int(4),
			})
			require.NoError(t, err)
			require.Equal(t, adapter, resp.Model, "the engine served the adapter")
		}
		// Every request took both legs: each leg's engines served it.
		prefills, decodes := 0, 0
		for _, e := range st.Engines() {
			for _, rec := range e.Records() {
				switch rec.Kind {
				case enginesim.KindPrefill:
					prefills++
				case enginesim.KindDecode:
					decodes++
				}
			}
		}
		require.Equal(t, len(seq), prefills)
		require.Equal(t, len(seq), decodes)
	}

	awareLoads, blindLoads := loads(aware), loads(blind)
	t.Logf("adapter loads over %d requests, both legs: aware %d, blind %d", len(seq), awareLoads, blindLoads)
	// Four adapters fit the two engines' two slots on each leg: aware
	// picking loads each once per leg, or little more.
	require.GreaterOrEqual(t, awareLoads, 2*len(adapters)/2, "each adapter loaded somewhere on each leg")
	require.GreaterOrEqual(t, blindLoads, 3*awareLoads, "aware %d, blind %d", awareLoads, blindLoads)

	// pdx counts its adapter picks, and the blind pool has none.
	fams := scrape(t, "http://"+aware.Pdx.AdminAddr()+"/metrics")
	for _, leg := range []string{"prefill", "decode"} {
		picks := 0.0
		for _, outcome := range []string{"loaded", "free_slot", "blind"} {
			for _, m := range matching(fams, "pdx_lora_picks_total", map[string]string{"pool": "demo", "leg": leg, "outcome": outcome}) {
				picks += m.GetCounter().GetValue()
			}
		}
		require.Equal(t, float64(len(seq)), picks, "leg %s", leg)
		loaded := matching(fams, "pdx_lora_picks_total", map[string]string{"pool": "demo", "leg": leg, "outcome": "loaded"})
		require.Len(t, loaded, 1, "leg %s", leg)
		require.Greater(t, loaded[0].GetCounter().GetValue(), float64(len(seq)/2), "leg %s: mostly to engines with the adapter", leg)
	}
	blindFams := scrape(t, "http://"+blind.Pdx.AdminAddr()+"/metrics")
	require.Empty(t, blindFams["pdx_lora_picks_total"].GetMetric(), "a pool without lora config picks blind to adapters")
}
