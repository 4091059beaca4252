package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// servedTotal sums pdx_decode_served_total of the stack's pdx by the
// fallback label ("first" or "fallback").
func servedTotal(t *testing.T, st *stack.Stack, fallback string) int {
	t.Helper()
	resp, err := http.Get("http://" + st.Pdx.AdminAddr() + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	var b strings.Builder
	_, err = copyBody(&b, resp)
	require.NoError(t, err)
	n := 0
	for line := range strings.Lines(b.String()) {
		if !strings.HasPrefix(line, "pdx_decode_served_total{") || !strings.Contains(line, `fallback="`+fallback+`"`) {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		require.NoError(t, err)
		n += int(v)
	}
	return n
}

// With decode fallbacks, one of two decode engines going away under load
// costs no client an error: Envoy retries each decode that finds it gone on
// the endpoint pdx named next, which takes the KV the prefill left (NIXL)
// or finds it in the shared store (HTTP/LMCache).
func TestDecodeFallbackEngineKilledUnderLoad(t *testing.T) {
	for _, connector := range []string{"nixl", "http"} {
		t.Run(connector, func(t *testing.T) {
			st := startStack(t, stack.Options{
				Connector: connector, Prefill: 2, Decode: 2, DecodeFallbacks: 1,
				Engine: enginesim.Config{PrefillLatency: 2 * time.Millisecond, DecodePerToken: 2 * time.Millisecond},
				// The dead engine stays in the lists, first for half the
				// requests: every one of them needs the fallback.
				PoolYAML: "decode_picker: {policy: round_robin}\neject_after_failures: 1000000",
			})
			_, hc := newClient(t, st)
			ctx, cancel := context.WithTimeout(t.Context(), 4*time.Second)
			defer cancel()
			var (
				mu       sync.Mutex
				failures []string
				total    atomic.Int64
				after    atomic.Int64 // requests sent once the engine was gone
				killed   atomic.Bool
			)
			var wg sync.WaitGroup
			for w := range 32 {
				wg.Go(func() {
					for i := 0; ctx.Err() == nil; i++ {
						gone := killed.Load()
						text := fmt.Sprintf("fallback %s %d-%d", connector, w, i)
						var kind, got string
						var ok bool
						if i%3 == 2 {
							kind, got, ok = expect(t.Context(), hc, "completion", st.URL()+"/v1/completions",
								fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":3}`, text), 200, wantPrefix(text))
						} else {
							kind, got, ok = expect(t.Context(), hc, "chat", st.URL()+"/v1/chat/completions",
								fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":%q}],"max_tokens":3,"stream":%v}`, text, i%3 == 0),
								200, wantPrefix(chatPrompt(text)))
						}
						total.Add(1)
						if gone {
							after.Add(1)
						}
						if !ok {
							mu.Lock()
							failures = append(failures, kind+": "+got)
							mu.Unlock()
						}
					}
				})
			}
			time.Sleep(1500 * time.Millisecond)
			require.NoError(t, st.Decode[0].Close(), "the engine stops: in-flight requests finish, new connections are refused")
			killed.Store(true)
			wg.Wait()
			t.Logf("%d requests, %d sent after the engine went, %d served by a fallback", total.Load(), after.Load(), servedTotal(t, st, "fallback"))
			require.Empty(t, failures, "no client saw an error")
			require.Greater(t, after.Load(), int64(50), "load went on after the engine was gone")
			require.Greater(t, servedTotal(t, st, "fallback"), 0, "the served-decode metric counts the fallbacks")
			require.Positive(t, servedTotal(t, st, "first"))
		})
	}
}

// A decode engine answering 5xx before any byte of its answer has its
// requests answered by the next endpoint pdx named, with the KV of their
// prefill, whichever way Envoy sends pdx the body.
func TestDecodeFallback5xx(t *testing.T) {
	for _, mode := range []string{envoy.BodyBuffered, envoy.BodyFullDuplexStreamed} {
		t.Run(mode, func(t *testing.T) { decodeFallback5xx(t, mode) })
	}
}

func decodeFallback5xx(t *testing.T, mode string) {
	st := startStack(t, stack.Options{
		Prefill: 1, Decode: 2, DecodeFallbacks: 1, RequestBodyMode: mode,
		PoolYAML: "decode_picker: {policy: round_robin}\neject_after_failures: 1000000",
		Tune: func(role enginesim.Role, i int, c *enginesim.Config) {
			if role == enginesim.RoleDecode && i == 0 {
				c.FailStatus = 503
			}
		},
	})
	_, hc := newClient(t, st)
	for i := range 4 {
		text := fmt.Sprintf("5xx fallback %s %d", mode, i)
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`)
		require.Equal(t, http.StatusOK, a.status, a.body)
		require.Contains(t, a.body, wantPrefix(text))
		fp := enginesim.Fingerprint(text)
		recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
		require.Len(t, recs["prefill"], 1, "one prefill for %s", text)
		require.Len(t, recs["decode"], 1, "one decode answered %s", text)
		d := recs["decode"][0]
		require.Equal(t, st.Decode[1].Addr(), d.Engine, "the healthy engine decoded %s", text)
		require.Equal(t, "pulled", d.KV)
		require.Equal(t, recs["prefill"][0].Engine, d.KVSource)
	}
	require.NotEmpty(t, st.Decode[0].Records(), "the failing engine was tried first for some")
	require.Equal(t, len(st.Decode[0].Records()), servedTotal(t, st, "fallback"), "each retried request is counted as served by a fallback")
	require.Equal(t, 4-len(st.Decode[0].Records()), servedTotal(t, st, "first"))
}

// With the EDS profile, a destination a client names is never connected
// to: not a listening server that is no engine, nor a decode engine pdx did
// not pick; pdx's pick answers.
func TestEDSClientDestinationIgnored(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 2, EDS: true, PoolYAML: "decode_picker: {policy: round_robin}"})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var accepted atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	_, hc := newClient(t, st)
	for i, dest := range []string{ln.Addr().String(), st.Decode[1].Addr(), ln.Addr().String() + "," + st.Decode[1].Addr()} {
		for j := range 2 {
			text := fmt.Sprintf("client destination %d-%d", i, j)
			a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"`+text+`","max_tokens":2}`,
				"x-gateway-destination-endpoint", dest)
			require.Equal(t, http.StatusOK, a.status, a.body)
			require.Contains(t, a.body, wantPrefix(text))
			requireHandoff(t, st, text)
		}
	}
	require.Zero(t, accepted.Load(), "the client's destination was never connected to")
	require.Len(t, st.Decode[0].Records(), 3, "round robin, not the client, chose the decode engine")
	require.Len(t, st.Decode[1].Records(), 3)
}
