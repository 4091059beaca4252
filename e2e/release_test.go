package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// releaseBound is how soon after a request died the engines must have let
// go of what they held for it.
const releaseBound = time.Second

// startRequest sends a completion that the test will abandon (cancel) and
// returns its cancel and a channel with its answer (nil on error).
func startRequest(t *testing.T, hc *http.Client, url, body string) (context.CancelFunc, <-chan *answer) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	out := make(chan *answer, 1)
	go func() {
		resp, err := hc.Do(req)
		if err != nil {
			out <- nil
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		out <- &answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
	}()
	return cancel, out
}

// requireSoon waits for cond, which must hold within releaseBound of since.
func requireSoon(t *testing.T, since time.Time, cond func() bool, what string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, 10*time.Second, 5*time.Millisecond, append([]any{what}, args...)...)
	took := time.Since(since)
	require.Less(t, took, releaseBound, "%s took %v", fmt.Sprintf(what, args...), took)
}

// When a request dies the engines let go of what they held for it, within
// a second, through what their protocol offers.
func TestKVReleased(t *testing.T) {
	// NIXL: the client goes away after its prefill, while the decode waits
	// in the decode engine's queue. Envoy resets the decode; vLLM aborts it
	// before its pull, and the decode engine tells the prefill engine to
	// free the blocks (vLLM PR #19223). Without that the blocks would stay
	// until VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).
	t.Run("nixl: client gone after the prefill", func(t *testing.T) {
		st := startStack(t, stack.Options{Prefill: 1, Decode: 1,
			Tune: func(role enginesim.Role, _ int, c *enginesim.Config) {
				if role == enginesim.RoleDecode {
					c.DecodeQueueLatency = time.Minute
				}
			}})
		_, hc := newClient(t, st)
		cancel, done := startRequest(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"left after the prefill","max_tokens":4}`)
		require.Eventually(t, func() bool { return st.Decode[0].State().Waiting == 1 }, 10*time.Second, 5*time.Millisecond, "the decode is queued")
		require.Equal(t, 1, st.Prefill[0].HeldKV(), "the prefill engine holds the blocks")
		gone := time.Now()
		cancel()
		require.Nil(t, <-done)
		requireSoon(t, gone, func() bool { return st.Prefill[0].HeldKV() == 0 }, "the prefill's blocks freed")
		require.Equal(t, 1, st.Prefill[0].State().KVReleased)
	})

	// SGLang: the prefill fails after the decode started (it times out here,
	// while the decode waits on its bootstrap room holding KV pages). pdx
	// answers the client, Envoy resets the decode, and pdx aborts the
	// request by its rid on both engines: SGLang would notice the reset only
	// at its next 4-second check, and an unnoticed decode waits out
	// SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s).
	t.Run("sglang: prefill failed after the decode started", func(t *testing.T) {
		st := startStack(t, stack.Options{Connector: "sglang", Prefill: 1, Decode: 1, PrefillTimeout: 700 * time.Millisecond,
			Engine: enginesim.Config{PrefillLatency: time.Minute}})
		_, hc := newClient(t, st)
		_, done := startRequest(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"prefill too slow","max_tokens":4}`)
		require.Eventually(t, func() bool { return st.Decode[0].HeldSlots() == 1 }, 10*time.Second, 5*time.Millisecond, "the decode holds its slot")
		a := <-done
		answered := time.Now()
		require.NotNil(t, a)
		requireAPIError(t, *a, 504, "prefill_timeout", "")
		requireSoon(t, answered, func() bool { return st.Decode[0].HeldSlots() == 0 }, "the decode's slot freed")
		requireSoon(t, answered, func() bool { return st.Decode[0].State().Aborted == 1 }, "the decode aborted by its rid")
		requireSoon(t, answered, func() bool { return st.Prefill[0].State().Aborted == 1 }, "the prefill aborted by its rid")
	})

	// SGLang: the client goes away while the prefill runs. pdx cancels its
	// prefill call and aborts both legs.
	t.Run("sglang: client gone during the prefill", func(t *testing.T) {
		st := startStack(t, stack.Options{Connector: "sglang", Prefill: 1, Decode: 1, Engine: enginesim.Config{PrefillLatency: time.Minute}})
		_, hc := newClient(t, st)
		cancel, done := startRequest(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"left during the prefill","max_tokens":4}`)
		require.Eventually(t, func() bool { return st.Decode[0].HeldSlots() == 1 }, 10*time.Second, 5*time.Millisecond, "the decode holds its slot")
		gone := time.Now()
		cancel()
		require.Nil(t, <-done)
		requireSoon(t, gone, func() bool { return st.Decode[0].HeldSlots() == 0 }, "the decode's slot freed")
		requireSoon(t, gone, func() bool { return st.Prefill[0].State().Aborted == 1 }, "the prefill aborted")
	})

	// Mooncake (upstream vLLM): the prefill fails after the decode started;
	// Envoy's reset aborts the vLLM decode at once, which frees its slot.
	// vLLM has no abort call to add.
	t.Run("mooncake-vllm: prefill failed after the decode started", func(t *testing.T) {
		st := startStack(t, stack.Options{Connector: "mooncake", MooncakeProtocol: "vllm", Prefill: 1, Decode: 1,
			PrefillTimeout: 700 * time.Millisecond, Engine: enginesim.Config{PrefillLatency: time.Minute}})
		_, hc := newClient(t, st)
		_, done := startRequest(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"mooncake too slow","max_tokens":4}`)
		require.Eventually(t, func() bool { return st.Decode[0].HeldSlots() == 1 }, 10*time.Second, 5*time.Millisecond, "the decode holds its slot")
		a := <-done
		answered := time.Now()
		require.NotNil(t, a)
		requireAPIError(t, *a, 504, "prefill_timeout", "")
		requireSoon(t, answered, func() bool { return st.Decode[0].HeldSlots() == 0 }, "the decode's slot freed")
	})
}
