package e2e

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// A sick prefill endpoint costs its requests a retry, never their answer;
// when all are sick, the pool's policy decides, within the timeout. Behind
// pdx's own Envoy and behind one shaped as AI Gateway's InferencePool
// translation alike.
func TestPrefillFailover(t *testing.T) {
	for _, profile := range []string{envoy.ProfilePdx, envoy.ProfileAIGateway} {
		t.Run(profile, func(t *testing.T) { prefillFailover(t, profile) })
	}
}

func prefillFailover(t *testing.T, profile string) {
	sick := []struct {
		name string
		tune func(c *enginesim.Config)
		down bool
	}{
		{name: "down", down: true},
		{name: "answering 500", tune: func(c *enginesim.Config) { c.FailStatus = 500 }},
		{name: "hanging", tune: func(c *enginesim.Config) { c.PrefillLatency = time.Minute }},
	}
	for _, sc := range sick {
		t.Run("one prefill endpoint "+sc.name, func(t *testing.T) {
			st := startStack(t, stack.Options{
				Prefill: 3, Decode: 1, PrefillTimeout: 20 * time.Second, Profile: profile,
				// No ejection: every third request meets the sick endpoint.
				PoolYAML: "prefill_attempt_timeout: 500ms\neject_after_failures: 100",
				Tune: func(role enginesim.Role, i int, c *enginesim.Config) {
					if role == enginesim.RolePrefill && i == 0 && sc.tune != nil {
						sc.tune(c)
					}
				},
			})
			if sc.down {
				require.NoError(t, st.Prefill[0].Close())
			}
			_, hc := newClient(t, st)
			// Round robin sends some requests to the sick endpoint first.
			for i := range 6 {
				text := fmt.Sprintf("failover %s %d", sc.name, i)
				a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`)
				require.Equal(t, http.StatusOK, a.status, a.body)
				require.Contains(t, a.body, wantPrefix(text))
				requireHandoffAvoiding(t, st, text, st.Prefill[0].Addr())
			}
			if !sc.down {
				require.NotEmpty(t, st.Prefill[0].Records(), "the sick endpoint was tried, and its requests were still served")
			}
		})
	}

	allDown := func(t *testing.T, policy string) (*stack.Stack, answer, time.Duration) {
		st := startStack(t, stack.Options{Prefill: 2, Decode: 1, PrefillTimeout: 5 * time.Second, Profile: profile, PoolYAML: "on_prefill_failure: " + policy})
		for _, p := range st.Prefill {
			require.NoError(t, p.Close())
		}
		_, hc := newClient(t, st)
		start := time.Now()
		a := post(t, hc, st.URL()+"/v1/chat/completions", `{"model":"demo-model","messages":[{"role":"user","content":"all down"}],"max_tokens":2}`)
		return st, a, time.Since(start)
	}
	t.Run("all prefill endpoints down, policy fail", func(t *testing.T) {
		st, a, took := allDown(t, "fail")
		requireAPIError(t, a, 503, "prefill_unavailable", "earlier attempts")
		require.Less(t, took, 5*time.Second, "within the prefill timeout")
		require.Empty(t, st.Decode[0].Records(), "nothing reached decode")
	})
	t.Run("all prefill endpoints down, policy fallback", func(t *testing.T) {
		st, a, took := allDown(t, "fallback")
		require.Equal(t, http.StatusOK, a.status, a.body)
		require.Contains(t, a.body, wantPrefix(chatPrompt("all down")))
		require.Equal(t, enginesim.KVRecomputed, a.header.Get(enginesim.HeaderKV), "the decode engine computed the prompt itself")
		require.Less(t, took, 5*time.Second)
		recs := st.Decode[0].Records()
		require.Len(t, recs, 1)
		require.Equal(t, "plain", recs[0].Kind)
	})
}

// requireHandoffAvoiding checks that the decode of prompt got the KV of a
// successful prefill on another engine than sick.
func requireHandoffAvoiding(t *testing.T, st *stack.Stack, prompt, sick string) {
	t.Helper()
	fp := enginesim.Fingerprint(prompt)
	recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
	require.Len(t, recs["decode"], 1, "one decode: %v", recs)
	d := recs["decode"][0]
	require.Equal(t, "pulled", d.KV)
	require.NotEqual(t, sick, d.KVSource)
	var served int
	for _, p := range recs["prefill"] {
		if p.Engine == d.KVSource {
			require.Equal(t, http.StatusOK, p.Status)
			served++
		}
	}
	require.Equal(t, 1, served, "the decode's KV came from one successful prefill: %v", recs)
}
