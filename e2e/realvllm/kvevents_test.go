package realvllm

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// eventsWait bounds how long the engines' events take to reach pdx: they
// travel on their own, after the answer.
const eventsWait = time.Minute

// pdxBlocks is how many blocks pdx's index holds for the engine's GPU
// tier, as pdx_kv_cache_blocks tells.
func pdxBlocks(t *testing.T, st *stack.Stack, e *realvllm.Engine) float64 {
	t.Helper()
	return value(pdxMetrics(t, st), "pdx_kv_cache_blocks", map[string]string{"endpoint": e.Addr(), "tier": "gpu"})
}

// waitBlocks waits until pdx's index holds at least n blocks of e.
func waitBlocks(t *testing.T, st *stack.Stack, e *realvllm.Engine, n float64) {
	t.Helper()
	var held float64
	require.Eventually(t, func() bool {
		held = pdxBlocks(t, st, e)
		return held >= n
	}, eventsWait, 100*time.Millisecond, "pdx heard of %v of %s's %v blocks", held, e.Name(), n)
}

// prefillsOK is pdx_prefill_attempts_total{result="ok"} by endpoint.
func prefillsOK(t *testing.T, st *stack.Stack) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, m := range matching(pdxMetrics(t, st), "pdx_prefill_attempts_total", map[string]string{"result": "ok"}) {
		out[labelOf(m, "endpoint")] += m.GetCounter().GetValue()
	}
	return out
}

// prefilledOn sends c through the stack and returns the prefill engine pdx
// sent its prefill leg to, from pdx's own count of prefill attempts.
func prefilledOn(t *testing.T, hc *http.Client, st *stack.Stack, c call, es []*realvllm.Engine) int {
	t.Helper()
	before := prefillsOK(t, st)
	got := send(t, hc, st.URL(), c)
	require.Equal(t, http.StatusOK, got.status, got.raw)
	after := prefillsOK(t, st)
	on := -1
	for i, e := range es {
		if after[e.Addr()] > before[e.Addr()] {
			require.Equal(t, -1, on, "one prefill")
			on = i
		}
	}
	require.NotEqual(t, -1, on, "a prefill ran on one of the engines: %v → %v", before, after)
	return on
}

// learned is what pdx's service models say of each prefill endpoint, for
// a failure's message.
func learned(t *testing.T, st *stack.Stack) string {
	t.Helper()
	fams := pdxMetrics(t, st)
	var b strings.Builder
	for _, m := range matching(fams, "pdx_prefill_service_overhead_seconds", nil) {
		ep := labelOf(m, "endpoint")
		fmt.Fprintf(&b, "%s: overhead %.1f ms, prompt %.0f tokens/s; ", ep, 1000*m.GetGauge().GetValue(),
			value(fams, "pdx_prefill_service_rate_tokens_per_second", map[string]string{"endpoint": ep, "kind": "prompt"}))
	}
	return b.String()
}

// warm computes c's prompt directly on e (behind pdx's back) and returns
// the full blocks it leaves there, those its events publish.
func warm(t *testing.T, hc *http.Client, e *realvllm.Engine, c call) float64 {
	t.Helper()
	r := send(t, hc, e.URL(), c.with("max_tokens", 1))
	require.Equal(t, http.StatusOK, r.status, r.raw)
	return float64(r.promptTokens / realvllm.BlockSize)
}

// warmOn are the prefill engines TestPrecisePlacement warms its prompts on.
var warmOn = []int{1, 0, 1, 1, 0, 0}

// TestPrecisePlacement prefills each prompt first directly on one prefill
// engine, behind pdx's back, so that only that engine's KV events (real
// vLLM's, pdx dialing its publisher) can tell pdx where the prefix is; a
// follow-up through Envoy must then prefill there, its tokens rendered by
// the engines. The engine confirms it: the follow-up's prompt was a local
// cache hit there. Then pdx restarts: the prompts warmed before it, which
// the new pdx never heard of, prefill where they were warmed (it caught up
// with the engines' replay sockets as it subscribed), and so do prompts
// warmed after.
func TestPrecisePlacement(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	// followUps sends a follow-up of each text and checks it prefilled
	// where the text was warmed, by its rendered tokens.
	followUps := func(tag string, texts []string, question string) {
		t.Helper()
		rendered := value(pdxMetrics(t, st), "pdx_prompt_tokens_total", map[string]string{"source": "render"})
		for i, e := range warmOn {
			hits := sourcesOf(t, s.prefill[e]).cacheHit
			got := prefilledOn(t, hc, st, chat(texts[i]+question, 4), s.prefill)
			if got != e {
				t.Fatalf("%s: prompt %d, warmed on prefill-%d, prefilled on prefill-%d; pdx's service models: %s", tag, i, e, got, learned(t, st))
			}
			require.Greater(t, sourcesOf(t, s.prefill[e]).cacheHit, hits, "%s: the engine found the prompt %d's prefix in its cache", tag, i)
		}
		require.Equal(t, rendered+float64(len(warmOn)),
			value(pdxMetrics(t, st), "pdx_prompt_tokens_total", map[string]string{"source": "render"}),
			"every follow-up was placed by its rendered tokens")
	}
	warmUps := func(tag string) []string {
		t.Helper()
		texts := make([]string, len(warmOn))
		for i, e := range warmOn {
			texts[i] = prompt(fmt.Sprintf("%s: tenant %d's shared document", tag, i))
			before := pdxBlocks(t, st, s.prefill[e])
			waitBlocks(t, st, s.prefill[e], before+warm(t, hc, s.prefill[e], chat(texts[i], 1)))
		}
		return texts
	}
	texts := warmUps("before the restart")
	followUps("before the restart", texts, " And a question about it?")
	// A new pdx never heard the warm-ups' events: it learns them from
	// the engines' replay sockets as it subscribes (its catch-up), before
	// the engines publish anything new.
	require.NoError(t, st.RestartPdx(t.Context()))
	require.Eventually(t, func() bool {
		return value(pdxMetrics(t, st), "pdx_kv_events_total", map[string]string{"kind": "catch_ups"}) >= float64(len(s.all()))
	}, time.Minute, 100*time.Millisecond, "every engine's replay socket caught up with")
	followUps("after the restart, warmed before it", texts, " And another question about it?")
	followUps("after the restart", warmUps("after the restart"), " And a question about it?")
	fams := pdxMetrics(t, st)
	require.Zero(t, value(fams, "pdx_kv_events_total", map[string]string{"kind": "decode_errors"}))
	require.Zero(t, value(fams, "pdx_kv_events_total", map[string]string{"kind": "malformed"}))
	require.Zero(t, value(fams, "pdx_kv_cache_ignored_total", map[string]string{"kind": "orphans"}))
	require.Zero(t, value(fams, "pdx_kv_cache_ignored_total", map[string]string{"kind": "block_size"}))
}

// relay forwards an engine's KV event messages to pdx, as the network
// between them does, and can lose some: a ZMQ SUB on the engine's
// publisher, a PUB pdx dials.
type relay struct {
	addr string
	drop atomic.Int32 // messages still to lose
	seen atomic.Int64
}

func startRelay(t *testing.T, publisher int) *relay {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
	require.NoError(t, sub.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", publisher)))
	pub := zmq4.NewPub(ctx)
	r := &relay{addr: loopback.FreeAddr(t)}
	require.NoError(t, pub.Listen("tcp://"+r.addr))
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return
			}
			r.seen.Add(1)
			if r.drop.Load() > 0 {
				r.drop.Add(-1)
				continue
			}
			if pub.Send(msg) != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		cancel()
		sub.Close()
		pub.Close()
		<-done
	})
	return r
}

func (r *relay) port(t *testing.T) int {
	_, p, _ := strings.Cut(r.addr, ":")
	var n int
	_, err := fmt.Sscan(p, &n)
	require.NoError(t, err)
	return n
}

// TestKVEventsReplayAfterGap loses one batch of prefill-1's events on the
// way to pdx: the next batch's sequence number shows the gap, and pdx
// fills it from the engine's replay socket (vLLM's ROUTER), learning the
// lost batch's blocks without forgetting the engine's others.
func TestKVEventsReplayAfterGap(t *testing.T) {
	s := engines.nixlEngines(t)
	p := s.prefill[1]
	r := startRelay(t, p.KVEventsPort())
	opts := s.options("", p)
	opts.External.Prefill[0].KVEventsPort = r.port(t)
	st := startStack(t, opts, p)
	hc := httpClient(t)

	// Until pdx's subscription through the relay is up, the relay's PUB
	// drops what it is sent: warm until pdx has heard of something.
	var n float64
	require.Eventually(t, func() bool {
		n += warm(t, hc, p, chat(prompt(fmt.Sprintf("before the gap %v", n)), 1))
		return pdxBlocks(t, st, p) > 0
	}, eventsWait, time.Second, "pdx hears prefill-1's events through the relay")
	before := pdxBlocks(t, st, p)
	gapsBefore := value(pdxMetrics(t, st), "pdx_kv_events_total", map[string]string{"kind": "gaps"})

	seen := r.seen.Load()
	r.drop.Store(1)
	lost := warm(t, hc, p, chat(prompt("in the gap"), 1))
	require.Eventually(t, func() bool { return r.seen.Load() > seen }, eventsWait, 50*time.Millisecond, "the engine published the batch the relay loses")
	require.Zero(t, r.drop.Load())
	after := warm(t, hc, p, chat(prompt("after the gap"), 1))

	waitBlocks(t, st, p, before+lost+after)
	fams := pdxMetrics(t, st)
	gaps := value(fams, "pdx_kv_events_total", map[string]string{"kind": "gaps"})
	require.Greater(t, gaps, gapsBefore)
	require.Equal(t, gaps, value(fams, "pdx_kv_events_total", map[string]string{"kind": "replays"}), "every gap was filled by replay")
	require.Zero(t, value(fams, "pdx_kv_events_total", map[string]string{"kind": "replay_failures"}))
	require.Zero(t, value(fams, "pdx_kv_cache_resets_total", nil), "pdx forgot nothing")
	require.Equal(t, before+lost+after, pdxBlocks(t, st, p))
}

// TestKVEventsAllBlocksCleared: POST /reset_prefix_cache (a development
// route) empties the engine's prefix cache, and vLLM publishes
// AllBlocksCleared at its next step: pdx forgets the engine's blocks.
func TestKVEventsAllBlocksCleared(t *testing.T) {
	s, st := sharedStack(t)
	p := s.prefill[0]
	hc := httpClient(t)
	before := pdxBlocks(t, st, p)
	waitBlocks(t, st, p, before+warm(t, hc, p, chat(prompt("before the reset"), 1)))
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, p.URL()+"/reset_prefix_cache", nil)
	require.NoError(t, err)
	resp, err := hc.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "the engine reset its prefix cache (no request holds blocks)")
	// The event goes out with the engine's next step.
	after := warm(t, hc, p, chat(prompt("after the reset"), 1))
	require.Eventually(t, func() bool { return pdxBlocks(t, st, p) == after }, eventsWait, 100*time.Millisecond,
		"pdx holds only the blocks stored since the reset")
}
