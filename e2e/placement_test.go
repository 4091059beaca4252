package e2e

import (
	"encoding/json"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// shedStack is one prefill and one decode engine whose decodes take a
// while, in a pool that holds one request per decode engine.
func shedStack(t *testing.T, saturation string) *stack.Stack {
	return startStack(t, stack.Options{
		Prefill: 1, Decode: 1,
		Engine:   enginesim.Config{DecodeLatency: 1500 * time.Millisecond},
		PoolYAML: "saturation: {max_in_flight: 1, " + saturation + "}",
	})
}

type reply struct {
	status     int
	retryAfter string
	code       string
	took       time.Duration
}

// postAll sends n chat requests at once through Envoy.
func postAll(t *testing.T, st *stack.Stack, n int) []reply {
	t.Helper()
	_, hc := newClient(t, st)
	out := make([]reply, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			resp, err := hc.Post(st.URL()+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"`+stack.Model+`","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`))
			if !noError(t, err) {
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			var e struct {
				Error struct{ Code string } `json:"error"`
			}
			_ = json.Unmarshal(b, &e)
			out[i] = reply{resp.StatusCode, resp.Header.Get("retry-after"), e.Error.Code, time.Since(start)}
		})
		time.Sleep(400 * time.Millisecond) // the first is routed, and decoding, before the next arrives
	}
	wg.Wait()
	return out
}

func noError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// A decode engine that has as many of pdx's requests as the pool allows is
// saturated until Envoy ends their streams: pdx counts a decode until its
// response is over, through the real Envoy.
func TestSheddingThroughEnvoy(t *testing.T) {
	t.Run("reject", func(t *testing.T) {
		st := shedStack(t, "action: reject")
		got := postAll(t, st, 2)
		require.Equal(t, 200, got[0].status)
		require.Equal(t, reply{status: 429, retryAfter: "1", code: "overloaded"}, reply{got[1].status, got[1].retryAfter, got[1].code, 0})
		// Once the first is over, the engine has room again.
		again := postAll(t, st, 1)
		require.Equal(t, 200, again[0].status)
	})
	t.Run("queue", func(t *testing.T) {
		st := shedStack(t, "action: queue, max_queue_time: 10s")
		got := postAll(t, st, 2)
		require.Equal(t, 200, got[0].status)
		require.Equal(t, 200, got[1].status, "the second waited for the first to finish")
		require.Greater(t, got[1].took, 2*time.Second, "two decodes of 1.5s one after the other, the second sent 0.4s later")
		for _, e := range st.Decode {
			require.Zero(t, e.Tally().Rejected)
		}
	})
}

// The disaggregation decider sends a prompt with too little to prefill to
// the decode engine alone, through the real Envoy: the decode engine
// computes it (a plain request), and no prefill engine is called.
func TestDeciderDecodesShortPromptsAlone(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1, PoolYAML: "disaggregation: {min_uncached_tokens: 1000}"})
	_, hc := newClient(t, st)
	a := post(t, hc, st.URL()+"/v1/chat/completions",
		`{"model":"`+stack.Model+`","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`)
	require.Equal(t, 200, a.status, a.body)
	require.Empty(t, st.Prefill[0].Records(), "no prefill")
	recs := st.Decode[0].Records()
	require.Len(t, recs, 1)
	require.Equal(t, enginesim.KindPlain, recs[0].Kind)
	require.Equal(t, enginesim.KVRecomputed, recs[0].KV, "the decode engine computed the prompt itself")
}
