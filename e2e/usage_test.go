package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// engineUsage is the usage an answer reported, read by the client.
type engineUsage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// usageOfAnswer reads the usage of a JSON answer, or of the SSE chunk that
// carries one.
func usageOfAnswer(t *testing.T, stream bool, body string) (engineUsage, bool) {
	t.Helper()
	var doc struct {
		Usage *engineUsage `json:"usage"`
	}
	if !stream {
		require.NoError(t, json.Unmarshal([]byte(body), &doc), body)
		if doc.Usage == nil {
			return engineUsage{}, false
		}
		return *doc.Usage, true
	}
	var found *engineUsage
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		doc.Usage = nil
		require.NoError(t, json.Unmarshal([]byte(data), &doc), data)
		if doc.Usage != nil {
			found = doc.Usage
		}
	}
	if found == nil {
		return engineUsage{}, false
	}
	return *found, true
}

// TestUsage sends chat and completions requests, as JSON and as streams
// (with and without include_usage), through Envoy: the observability pass
// shows pdx the decode's answers, and pdx_tokens_total adds up the usage
// the engines reported, cached tokens included (the engines play vLLM 0.32
// with --enable-prompt-tokens-details, which reports 0 cached tokens for
// KV a decode pulled, and SGLang, all but the last prompt token). Every
// routed answer has its hand-off, TTFT and decode timed, whichever body
// mode pdx's routing filter has.
func TestUsage(t *testing.T) {
	for _, tc := range []struct{ name, connector, bodyMode, profile string }{
		{"nixl", "nixl", "", ""},
		{"sglang", "sglang", "", ""},
		{"nixl full duplex", "nixl", envoy.BodyFullDuplexStreamed, ""},
		// As an InferencePool's picker, pdx's routing stream gets the
		// response itself (FULL_DUPLEX_STREAMED) and reads it there.
		{"nixl endpoint picker", "nixl", "", envoy.ProfileAIGateway},
		{"sglang endpoint picker", "sglang", "", envoy.ProfileAIGateway},
	} {
		connector := tc.connector
		t.Run(tc.name, func(t *testing.T) {
			observer := tc.profile == ""
			st := startStack(t, stack.Options{Connector: connector, RequestBodyMode: tc.bodyMode, Profile: tc.profile, Engine: enginesim.Config{
				PromptTokensDetails: true, DecodeLatency: 5 * time.Millisecond, DecodePerToken: time.Millisecond,
			}, Envoy: func(c *envoy.Config) { c.Observer = observer }})
			_, hc := newClient(t, st)
			if observer {
				seeObserver(t, st, hc)
			}
			var want struct{ prompt, cached, completion int64 }
			requests := []struct {
				path, body string
				stream     bool
				usage      bool // the answer carries usage
			}{
				{"/v1/chat/completions", `{"model":"demo-model","messages":[{"role":"user","content":"usage chat ` + connector + `"}],"max_tokens":3}`, false, true},
				{"/v1/chat/completions", `{"model":"demo-model","messages":[{"role":"user","content":"usage chat stream ` + connector + `"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, true, true},
				{"/v1/completions", `{"model":"demo-model","prompt":"usage completion ` + connector + ` with a longer prompt","max_tokens":5}`, false, true},
				{"/v1/completions", `{"model":"demo-model","prompt":"usage completion stream ` + connector + `","max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}`, true, true},
				{"/v1/completions", `{"model":"demo-model","prompt":"usage stream without usage ` + connector + `","max_tokens":2,"stream":true}`, true, false},
			}
			for _, r := range requests {
				a := post(t, hc, st.URL()+r.path, r.body)
				require.Equal(t, http.StatusOK, a.status, a.body)
				u, ok := usageOfAnswer(t, r.stream, a.body)
				require.Equal(t, r.usage, ok, "usage in the answer to %s", r.body)
				if !ok {
					continue
				}
				require.NotNil(t, u.PromptTokensDetails, "the decode pulled the prompt's KV: %s", a.body)
				if connector == "sglang" {
					require.Equal(t, u.PromptTokens-1, u.PromptTokensDetails.CachedTokens, "all but the last prompt token came with the KV")
				} else {
					require.Zero(t, u.PromptTokensDetails.CachedTokens, "vLLM 0.32 counts no pulled KV as cached")
				}
				want.prompt += u.PromptTokens
				want.cached += u.PromptTokensDetails.CachedTokens
				want.completion += u.CompletionTokens
			}
			require.Positive(t, want.prompt)

			demo := map[string]string{"pool": "demo", "connector": connector}
			url := "http://" + st.Pdx.AdminAddr() + "/metrics"
			// The observability stream ends a moment after the client has
			// its answer.
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				fams := scrape(t, url)
				assert.Equal(c, float64(want.prompt), value(fams, "pdx_tokens_total", with(demo, "kind", "prompt")))
				assert.Equal(c, float64(want.cached), value(fams, "pdx_tokens_total", with(demo, "kind", "cached")))
				assert.Equal(c, float64(want.completion), value(fams, "pdx_tokens_total", with(demo, "kind", "completion")))
				for _, h := range []string{"pdx_handoff_duration_seconds", "pdx_ttft_seconds", "pdx_decode_duration_seconds"} {
					assert.Equal(c, uint64(len(requests)), count(fams, h, demo), h)
				}
			}, 10*time.Second, 50*time.Millisecond)
		})
	}
}

// seeObserver sends one request, whose observability stream shows pdx that
// Envoy has the pass (its routing answers carry the pass's metadata from
// then on; this one's did not), and waits until pdx has seen it.
func seeObserver(t *testing.T, st *stack.Stack, hc *http.Client) {
	t.Helper()
	a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"the first request","max_tokens":1}`)
	require.Equal(t, http.StatusOK, a.status, a.body)
	require.Eventually(t, func() bool { return strings.Contains(st.PdxLog(), "the observability pass is on") },
		10*time.Second, 10*time.Millisecond)
}

// sideProcessor is an ext_proc server standing in for the observability
// pass's: one that fails every stream, or one that never reads.
type sideProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	fail bool
}

func (p *sideProcessor) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	if p.fail {
		if _, err := stream.Recv(); err != nil {
			return err
		}
		return status.Error(codes.Internal, "the observer fails")
	}
	<-stream.Context().Done() // reads nothing, answers nothing
	return nil
}

// TestUsageNeverHoldsARequest: the observability pass is off the request's
// path: with an observer that fails its streams, or one that reads nothing
// for as long as the request lasts, requests succeed, and no slower.
func TestUsageNeverHoldsARequest(t *testing.T) {
	for _, tc := range []struct {
		name string
		fail bool
	}{{"failing", true}, {"silent", false}} {
		t.Run(tc.name, func(t *testing.T) {
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			gs := grpc.NewServer()
			extprocv3.RegisterExternalProcessorServer(gs, &sideProcessor{fail: tc.fail})
			go func() { _ = gs.Serve(lis) }()
			t.Cleanup(gs.Stop)

			st := startStack(t, stack.Options{
				Envoy: func(c *envoy.Config) { c.Observer, c.ObserverAddress = true, lis.Addr().String() },
			})
			_, hc := newClient(t, st)
			for i := range 3 {
				// Up to 4,000 tokens (the simulator's most): answers of up
				// to half a megabyte, far past the flow-control window of a
				// stream nobody reads.
				for _, tokens := range []int{64, 4000} {
					for _, stream := range []bool{false, true} {
						began := time.Now()
						prompt := fmt.Sprintf("never held %s %d %d %v", tc.name, i, tokens, stream)
						a := post(t, hc, st.URL()+"/v1/completions",
							fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":%d,"stream":%v}`, prompt, tokens, stream))
						require.Equal(t, http.StatusOK, a.status, a.body)
						require.True(t, strings.Contains(a.body, wantPrefix(prompt)) && strings.Contains(a.body, fmt.Sprintf(" t%d\"", tokens-1)),
							"the whole answer to %q: %d bytes", prompt, len(a.body))
						// Engines at zero latency: well under a second unless
						// something waits on the observer (Envoy's deferred
						// close is 5s).
						require.Less(t, time.Since(began), 2*time.Second)
					}
				}
			}
			fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
			require.NotContains(t, fams, "pdx_tokens_total", "pdx saw no observability stream")
		})
	}
}

// TestUsageAcrossReplicas: with two pdx replicas, Envoy places a request's
// routing stream and its observability stream independently; whichever
// replica gets the latter records it from the metadata the routing answer
// left, so the replicas' counts add up to the engines' usage.
func TestUsageAcrossReplicas(t *testing.T) {
	st := startStack(t, stack.Options{PdxReplicas: 2, Engine: enginesim.Config{PromptTokensDetails: true},
		Envoy: func(c *envoy.Config) { c.Observer = true }})
	_, hc := newClient(t, st)
	// Each replica turns the metadata on at its first observability stream.
	require.Eventually(t, func() bool {
		a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"warm-up","max_tokens":1}`)
		require.Equal(t, http.StatusOK, a.status, a.body)
		return strings.Count(st.PdxLog(), "the observability pass is on") == 2
	}, 20*time.Second, 20*time.Millisecond)
	demo := map[string]string{"pool": "demo", "connector": "nixl"}
	type totals struct {
		prompt, cached, completion float64
		handoffs                   uint64
	}
	read := func() totals {
		var t0 totals
		for _, r := range st.Replicas {
			fams := scrape(t, "http://"+r.AdminAddr()+"/metrics")
			t0.prompt += value(fams, "pdx_tokens_total", with(demo, "kind", "prompt"))
			t0.cached += value(fams, "pdx_tokens_total", with(demo, "kind", "cached"))
			t0.completion += value(fams, "pdx_tokens_total", with(demo, "kind", "completion"))
			t0.handoffs += count(fams, "pdx_handoff_duration_seconds", demo)
		}
		return t0
	}
	// Some warm-ups were recorded (those routed by a replica already on):
	// count from where they leave the totals.
	var base totals
	require.Eventually(t, func() bool {
		before := read()
		time.Sleep(200 * time.Millisecond)
		base = read()
		return base == before
	}, 10*time.Second, time.Millisecond)

	var want totals
	const n = 12
	for i := range n {
		a := post(t, hc, st.URL()+"/v1/completions", fmt.Sprintf(`{"model":"demo-model","prompt":"replicas %d","max_tokens":%d}`, i, 2+i%3))
		require.Equal(t, http.StatusOK, a.status, a.body)
		u, ok := usageOfAnswer(t, false, a.body)
		require.True(t, ok)
		want.prompt += float64(u.PromptTokens)
		want.cached += float64(u.PromptTokensDetails.CachedTokens)
		want.completion += float64(u.CompletionTokens)
	}
	want.handoffs = n
	require.Eventually(t, func() bool {
		got := read()
		return got == totals{base.prompt + want.prompt, base.cached + want.cached, base.completion + want.completion, base.handoffs + want.handoffs}
	}, 10*time.Second, 50*time.Millisecond, "the replicas' counts add up to the engines' usage: want %+v more than %+v, have %+v", want, base, read())
}
