package e2e

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// TestSessionAffinity: through the real Envoy and two pdx replicas, which
// Envoy spreads the requests over, the requests of a session reach one
// prefill and one decode engine; a session whose decode engine is
// saturated on both replicas moves to the same other engine through
// either, and returns once the engine has room; a session whose prefill
// engine goes down moves its prefills to the same other one.
func TestSessionAffinity(t *testing.T) {
	st := startStack(t, stack.Options{
		PdxReplicas: 2, Prefill: 3, Decode: 3,
		// Long answers hold their decode engine; one-token answers do not.
		Engine:           enginesim.Config{DecodePerToken: 100 * time.Millisecond},
		SubsetHintHeader: "x-test-subset",
		PoolYAML:         "session_affinity: {header: x-session-id}\nsaturation: {max_in_flight: 1}\nprefill_attempts: 3\neject_after_failures: 1",
	})
	_, hc := newClient(t, st)
	n := 0
	// chat sends a one-token request of session and returns the decode and
	// prefill engines that served it, by their records.
	chat := func(t *testing.T, session string) (decode, prefill int) {
		t.Helper()
		n++
		text := fmt.Sprintf("%s turn %d", session, n)
		a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(text), "x-session-id", session)
		require.Equal(t, http.StatusOK, a.status, a.body)
		return recordedOn(st.Decode, enginesim.KindDecode, text), prefilledOn(t, st, text)
	}
	// picks is pdx_session_picks_total of leg and outcome, by replica.
	picks := func(t *testing.T, leg, outcome string) []float64 {
		t.Helper()
		var out []float64
		for _, r := range st.Replicas {
			out = append(out, value(scrape(t, "http://"+r.AdminAddr()+"/metrics"), "pdx_session_picks_total",
				map[string]string{"pool": "demo", "leg": leg, "outcome": outcome}))
		}
		return out
	}
	sum := func(v []float64) float64 { return v[0] + v[1] }

	type engines struct{ decode, prefill int }
	home := map[string]engines{}
	sessions := []string{"alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"}
	t.Run("each session keeps its engines", func(t *testing.T) {
		decodes, prefills := map[int]bool{}, map[int]bool{}
		for _, s := range sessions {
			d, p := chat(t, s)
			require.GreaterOrEqual(t, d, 0)
			require.GreaterOrEqual(t, p, 0)
			for range 3 {
				d2, p2 := chat(t, s)
				require.Equal(t, d, d2, "session %s: its decode engine", s)
				require.Equal(t, p, p2, "session %s: its prefill engine", s)
			}
			home[s] = engines{d, p}
			decodes[d], prefills[p] = true, true
		}
		require.Greater(t, len(decodes), 1, "the sessions spread over the decode engines: %v", home)
		require.Greater(t, len(prefills), 1, "and over the prefill engines: %v", home)
		kept := picks(t, "decode", "kept")
		require.Equal(t, float64(4*len(sessions)), sum(kept))
		require.True(t, kept[0] > 0 && kept[1] > 0, "both replicas served sessions: %v", kept)
		require.Equal(t, float64(4*len(sessions)), sum(picks(t, "prefill", "kept")))
		require.Zero(t, sum(picks(t, "decode", "moved")))
		require.Zero(t, sum(picks(t, "prefill", "moved")))
	})
	if t.Failed() {
		return
	}

	session := sessions[0]
	t.Run("a session yields its saturated decode engine and returns", func(t *testing.T) {
		busy := st.Decode[home[session].decode].Addr()
		inFlight := func() []float64 {
			var out []float64
			for _, r := range st.Replicas {
				out = append(out, value(scrape(t, "http://"+r.AdminAddr()+"/metrics"), "pdx_endpoint_in_flight",
					map[string]string{"pool": "demo", "role": "decode", "endpoint": busy}))
			}
			return out
		}
		// Long requests pinned to the session's engine by the subset hint
		// until both replicas hold one there: max_in_flight 1 saturates it
		// for both. Which replica routes a request is Envoy's choice, so
		// each is sent once the one before it is counted.
		ctx, cancel := context.WithCancel(t.Context())
		var held sync.WaitGroup
		defer func() { cancel(); held.Wait() }()
		for sent := 0; ; sent++ {
			now := inFlight()
			if now[0] >= 1 && now[1] >= 1 {
				break
			}
			require.Less(t, sent, 12, "Envoy sent every long request to one replica: %v", now)
			held.Go(func() {
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.URL()+"/v1/chat/completions",
					strings.NewReader(`{"model":"`+stack.Model+`","messages":[{"role":"user","content":"hold `+fmt.Sprint(sent)+`"}],"max_tokens":600}`))
				if err != nil {
					return
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("x-test-subset", busy)
				if resp, err := hc.Do(req); err == nil {
					resp.Body.Close()
				}
			})
			total := now[0] + now[1]
			require.Eventually(t, func() bool { c := inFlight(); return c[0]+c[1] > total }, 10*time.Second, 10*time.Millisecond,
				"the long request is counted on %s", busy)
		}

		// Requests of the session until both replicas have moved some.
		before := picks(t, "decode", "moved")
		moved, sent := -1, 0
		for now := before; now[0] == before[0] || now[1] == before[1]; now = picks(t, "decode", "moved") {
			require.Less(t, sent, 20, "Envoy sent every request to one replica: %v", now)
			d, p := chat(t, session)
			sent++
			require.NotEqual(t, home[session].decode, d, "request %d: the session yields its saturated engine", sent)
			if moved < 0 {
				moved = d
			}
			require.Equal(t, moved, d, "request %d: to the same engine, through either replica", sent)
			require.Equal(t, home[session].prefill, p, "request %d: its prefill engine has room", sent)
		}
		require.Equal(t, sum(before)+float64(sent), sum(picks(t, "decode", "moved")), "every one counted as moved")

		cancel()
		held.Wait()
		require.Eventually(t, func() bool { c := inFlight(); return c[0] == 0 && c[1] == 0 }, 10*time.Second, 10*time.Millisecond)
		for i := range 4 {
			d, p := chat(t, session)
			require.Equal(t, home[session], engines{d, p}, "request %d: the session returns", i)
		}
	})
	if t.Failed() {
		return
	}

	t.Run("a session's prefills move off its engine when it is down", func(t *testing.T) {
		down := home[session].prefill
		require.NoError(t, st.Prefill[down].Close())
		before := sum(picks(t, "prefill", "moved"))
		moved := -1
		for i := range 6 {
			d, p := chat(t, session)
			require.Equal(t, home[session].decode, d, "request %d: its decode engine stays", i)
			require.NotEqual(t, down, p, "request %d", i)
			require.GreaterOrEqual(t, p, 0, "request %d", i)
			if moved < 0 {
				moved = p
			}
			require.Equal(t, moved, p, "request %d: to the same prefill engine, through either replica", i)
		}
		// A replica's first request after the engine went down tried it
		// (a kept pick that failed), the rest went to the next at once:
		// every request ended on one moved pick.
		require.Equal(t, before+6, sum(picks(t, "prefill", "moved")))
		for _, s := range sessions[1:] {
			if home[s].prefill != down {
				d, p := chat(t, s)
				require.Equal(t, home[s], engines{d, p}, "session %s did not use the engine that went down: it stays", s)
			}
		}
	})
}
