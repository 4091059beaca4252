package enginesim

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoRASlotsLRU(t *testing.T) {
	tests := []struct {
		name string
		// seq is the adapters of requests run one after another.
		seq       []string
		wantLoads int64
		wantOnGPU []string
	}{
		{name: "base model loads nothing", seq: []string{"", "", ""}, wantLoads: 0, wantOnGPU: nil},
		{name: "a resident adapter loads once", seq: []string{"a", "a", "a"}, wantLoads: 1, wantOnGPU: []string{"a"}},
		{name: "two slots hold two adapters", seq: []string{"a", "b", "a", "b"}, wantLoads: 2, wantOnGPU: []string{"b", "a"}},
		{name: "a third evicts the least recently used", seq: []string{"a", "b", "a", "c", "b"}, wantLoads: 4, wantOnGPU: []string{"b", "c"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := newLoRASlots(&Capacity{MaxLoRA: 2, LoRALoad: time.Second})
			for _, a := range tt.seq {
				l.queue(a)
				require.True(t, l.admits(a))
				l.start(a)
				l.stop(a)
			}
			require.Equal(t, tt.wantLoads, l.loads)
			require.Equal(t, tt.wantOnGPU, l.resident)
			require.Empty(t, l.running)
			require.Empty(t, l.waiting)
		})
	}
}

func TestLoRASlotsMaxLorasInBatch(t *testing.T) {
	l := newLoRASlots(&Capacity{MaxLoRA: 2, LoRALoad: time.Second})
	require.Equal(t, time.Second, l.start("a"), "a load costs LoRALoad")
	l.start("b")
	require.Zero(t, l.start("a"), "a resident adapter costs nothing")
	require.False(t, l.admits("c"), "two distinct adapters run: a third waits")
	require.True(t, l.admits("a"))
	require.True(t, l.admits(""), "the base model needs no slot")
	l.stop("b")
	require.True(t, l.admits("c"))
	l.start("c")
	require.Equal(t, []string{"c", "a"}, l.resident, "b, unused, was evicted; a still runs")
	require.Equal(t, loraSeries{running: "a,c"}, l.current())
}

func TestLoRAEngine(t *testing.T) {
	s := startSim(t, Config{LoRAModules: []string{"sql", "chat"}, Capacity: testCapacity(func(c *Capacity) {
		c.MaxLoRA = 1
		c.LoRALoad = 300 * time.Millisecond
		c.DecodeStep = 10 * time.Millisecond
	})})
	req := func(model string) body { return plain(tokensText('a', 8), 2).with("model", model) }
	// A first request of an adapter pays its load, the next does not.
	require.GreaterOrEqual(t, timed(t, s, "r1", req("sql")), 300*time.Millisecond)
	require.Less(t, timed(t, s, "r2", req("sql")), 300*time.Millisecond)
	timed(t, s, "r3", req("base")) // not a module: the base model
	require.Equal(t, 1, s.Tally().LoRALoads)
	timed(t, s, "r4", req("chat"))
	timed(t, s, "r5", req("sql"))
	require.Equal(t, 3, s.Tally().LoRALoads, "one slot: sql, chat, sql")

	// With one slot, a chat request waits while sql runs, and the gauge
	// says so with vLLM's labels.
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	long := goPostCtx(t, ctx, s, "/v1/completions", "long", plain(tokensText('b', 8), 1000).with("model", "sql"))
	waiting := goPostCtx(t, ctx, s, "/v1/completions", "waiting", plain(tokensText('c', 8), 1000).with("model", "chat"))
	require.Eventually(t, func() bool {
		l, ok := latestLoRA(t, s)
		return ok && l["running_lora_adapters"] == "sql" && l["waiting_lora_adapters"] == "chat" && l["max_lora"] == "1"
	}, 10*time.Second, 5*time.Millisecond)
	// vLLM skips the held-back request, not the queue: a base-model
	// request behind it is served meanwhile.
	post(t, s, "/v1/completions", "behind", req("base")).decode(t)
	select {
	case <-waiting:
		t.Fatal("the chat request ran while sql held the only slot")
	default:
	}
	cancel()
	<-long
	<-waiting
	requireIdle(t, s)
	l, ok := latestLoRA(t, s)
	require.True(t, ok)
	require.Empty(t, l["running_lora_adapters"])
	require.Empty(t, l["waiting_lora_adapters"])
}

// latestLoRA is the labels of the vllm:lora_requests_info series with the
// latest value, as a reader of vLLM's gauge takes it.
func latestLoRA(t *testing.T, s *Server) (map[string]string, bool) {
	t.Helper()
	f, ok := scrape(t, s, "/metrics")["vllm:lora_requests_info"]
	if !ok {
		return nil, false
	}
	var best map[string]string
	at := -1.0
	for _, m := range f.GetMetric() {
		if v := m.GetGauge().GetValue(); v > at {
			at, best = v, map[string]string{}
			for _, lp := range m.GetLabel() {
				best[lp.GetName()] = lp.GetValue()
			}
		}
	}
	return best, best != nil
}

func TestLoRAMetricAbsentWithoutSlots(t *testing.T) {
	s := startSim(t, Config{Capacity: testCapacity(nil)})
	_, ok := scrape(t, s, "/metrics")["vllm:lora_requests_info"]
	require.False(t, ok, "vLLM without --enable-lora has no such gauge")
}
