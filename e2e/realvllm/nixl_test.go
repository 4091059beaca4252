package realvllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/realvllm"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// requireHandedOff checks what the decode engine counted for a request
// through pdx: none of its prompt computed by itself (a NIXL hand-off
// that failed would make the decode compute it), some of it arrived by KV
// transfer.
func requireHandedOff(t *testing.T, d promptSources, what string) {
	t.Helper()
	require.Zero(t, d.local, "%s: the decode engine computed no prompt token itself (%+v)", what, d)
	require.Positive(t, d.external, "%s: the prompt's KV arrived by KV transfer (%+v)", what, d)
}

// TestNixlHandoff sends every request kind and stream shape through Envoy
// and pdx to the real NIXL engines: each answer is the decode engine's own
// computation of the prompt at temperature 0 (the same request sent to it
// directly), and the decode engine's prompt token sources show the prompt
// arrived by KV transfer and none of it was computed there.
func TestNixlHandoff(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	for _, tc := range []struct {
		name string
		call call
		// out is the answer's length in tokens.
		out int
	}{
		{"completions", completion(prompt("completions"), 8), 8},
		{"completions-stream", completion(prompt("completions streamed"), 8).streamed(), 8},
		{"chat", chat(prompt("chat"), 8), 8},
		{"chat-stream", chat(prompt("chat streamed"), 8).streamed(), 8},
		{"chat-max_completion_tokens", chat(prompt("chat with max_completion_tokens"), 0).with("max_tokens", nil, "max_completion_tokens", 6), 6},
		{"chat-stream-max_completion_tokens", chat(prompt("chat streamed with max_completion_tokens"), 0).with("max_tokens", nil, "max_completion_tokens", 5).streamed(), 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.call.body["max_tokens"] == nil {
				delete(tc.call.body, "max_tokens")
			}
			before := sourcesOf(t, s.decode)
			got := send(t, hc, st.URL(), tc.call)
			require.Equal(t, http.StatusOK, got.status, got.raw)
			d := sourcesOf(t, s.decode).minus(before)
			requireHandedOff(t, d, tc.name)
			want := reference(t, hc, s.decode, tc.call)
			require.Equal(t, want.text, got.text, "the answer through pdx is the decode engine's own")
			require.Equal(t, "length", got.finish)
			require.True(t, got.usage, "the answer carries usage (streams: include_usage)")
			require.Equal(t, want.promptTokens, got.promptTokens)
			require.Equal(t, tc.out, got.completionTokens)
			t.Logf("%d prompt tokens: %v by KV transfer, %v local cache hits, %v computed on the decode engine; %d cached per usage",
				got.promptTokens, d.external, d.cacheHit, d.local, got.cachedTokens)
		})
	}
}

// TestNixlConcurrentPrompts sends distinct prompts all at once: each must
// get its own answer (a router that mixes up hand-offs under concurrency,
// as Kthena's did, gives one prompt another's KV), equal to the decode
// engine's own computation of it.
func TestNixlConcurrentPrompts(t *testing.T) {
	const n = 16
	s, st := sharedStack(t)
	hc := httpClient(t)
	calls := make([]call, n)
	for i := range calls {
		text := prompt(fmt.Sprintf("concurrent prompt %d", i))
		calls[i] = completion(text, 16)
		if i%2 == 1 {
			calls[i] = chat(text, 16)
		}
		if i%4 >= 2 {
			calls[i] = calls[i].streamed()
		}
	}
	before := sourcesOf(t, s.decode)
	got := make([]result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range calls {
		wg.Go(func() { got[i], errs[i] = trySend(t, hc, st.URL(), calls[i]) })
	}
	wg.Wait()
	for i := range calls {
		require.NoError(t, errs[i], "request %d", i)
		require.Equal(t, http.StatusOK, got[i].status, "request %d: %s", i, got[i].raw)
	}
	requireHandedOff(t, sourcesOf(t, s.decode).minus(before), "16 prompts at once")
	want := make([]result, n)
	texts := map[string]int{}
	for i := range calls {
		want[i] = reference(t, hc, s.decode, calls[i])
		texts[want[i].text]++
	}
	// A random model's answers to two prompts can coincide, and a swap of
	// those two would not show; the others' would.
	require.GreaterOrEqual(t, len(texts), n-2, "the prompts' own answers differ, so that one answered with another's KV would show: %v", texts)
	for i := range calls {
		require.Equal(t, want[i].text, got[i].text, "request %d got its own prompt's answer", i)
		require.Equal(t, want[i].promptTokens, got[i].promptTokens, "request %d", i)
	}
}

// TestNixlClientKVParamsStripped: a client's own kv_transfer_params (here
// naming blocks on a loopback port where no engine listens) never reach an
// engine: the prefill gets pdx's, the decode the prefill's.
func TestNixlClientKVParamsStripped(t *testing.T) {
	s, st := sharedStack(t)
	hc := httpClient(t)
	host, port, _ := strings.Cut(loopback.FreeAddr(t), ":")
	forged := map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "forged-engine",
		"remote_request_id": "forged", "remote_block_ids": [][]int{{1, 2, 3}}, "remote_host": host, "remote_port": port,
		"tp_size": 1}
	for _, c := range []call{
		completion(prompt("forged kv params, completions"), 6).with("kv_transfer_params", forged),
		chat(prompt("forged kv params, chat"), 6).with("kv_transfer_params", forged).streamed(),
	} {
		before := sourcesOf(t, s.decode)
		got := send(t, hc, st.URL(), c)
		require.Equal(t, http.StatusOK, got.status, got.raw)
		requireHandedOff(t, sourcesOf(t, s.decode).minus(before), c.path)
		require.Equal(t, reference(t, hc, s.decode, c).text, got.text)
	}
}

// TestNixlPrefillRefused: a prefill engine that refuses connections (one
// that died) fails the prefill leg; the pool's on_prefill_failure decides.
// With fallback the decode engine computes the prompt itself and the
// answer is still its own; with fail the client gets a clear error and the
// decode engine nothing.
func TestNixlPrefillRefused(t *testing.T) {
	s := engines.nixlEngines(t)
	hc := httpClient(t)
	// A dead engine: nothing listens at its address or its publisher's.
	dead := stack.Endpoint{Addr: loopback.FreeAddr(t), KVEventsPort: loopback.FreePort(t)}
	opts := func(pool string) stack.Options {
		o := s.options(pool)
		o.External.Prefill = []stack.Endpoint{dead}
		// Renders go to prefill-0, which serves them; only the prefill
		// leg's engine is gone.
		return o
	}
	t.Run("fallback", func(t *testing.T) {
		st := startStack(t, opts("on_prefill_failure: fallback\nprefill_attempts: 1"), s.decode)
		c := chat(prompt("prefill refused, fallback"), 6)
		before := sourcesOf(t, s.decode)
		got := send(t, hc, st.URL(), c)
		require.Equal(t, http.StatusOK, got.status, got.raw)
		d := sourcesOf(t, s.decode).minus(before)
		require.Zero(t, d.external, "no KV came from a prefill engine")
		require.Equal(t, float64(got.promptTokens), d.local+d.cacheHit, "the decode engine computed the prompt")
		require.Equal(t, reference(t, hc, s.decode, c).text, got.text)
		fams := pdxMetrics(t, st)
		require.Positive(t, value(fams, "pdx_prefill_attempts_total", map[string]string{"endpoint": dead.Addr}), "pdx tried the prefill engine")
		require.Zero(t, value(fams, "pdx_prefill_attempts_total", map[string]string{"endpoint": dead.Addr, "result": "ok"}))
		require.Equal(t, 1.0, value(fams, "pdx_requests_total", map[string]string{"outcome": "fallback"}))
	})
	t.Run("fail", func(t *testing.T) {
		st := startStack(t, opts("on_prefill_failure: fail\nprefill_attempts: 1"), s.decode)
		before := successes(t, s.decode)
		got := send(t, hc, st.URL(), chat(prompt("prefill refused, fail"), 6))
		require.GreaterOrEqual(t, got.status, 500, got.raw)
		var e struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
			} `json:"error"`
		}
		require.NoError(t, json.Unmarshal([]byte(got.raw), &e), got.raw)
		require.NotEmpty(t, e.Error.Message, got.raw)
		require.Equal(t, before, successes(t, s.decode), "the decode engine was sent nothing")
	})
}

// TestNixlClientGoneMidPrefill: a client that gives up while its prefill
// waits in a busy prefill engine's queue must not leave that engine
// working, or holding KV, for nobody: pdx cancels its prefill call, so
// that vLLM never completes that prefill (a completed one would hold its
// KV for a decode that never comes, until VLLM_NIXL_ABORT_REQUEST_TIMEOUT),
// and no decode is sent.
func TestNixlClientGoneMidPrefill(t *testing.T) {
	// Some 1,500 tokens each (the engines' max-model-len is 2048), 90k in
	// all: the engine takes them all into its batch (its 64 MiB cache holds
	// 131k tokens) and computes them in chunks, seconds of work that the
	// prefill below must share.
	const busyRequests = 60
	s := engines.nixlEngines(t)
	p := s.prefill[1]
	// Saturation off: pdx would otherwise hold the prefill back from the
	// busy engine (in its flow control) instead of sending it to wait there.
	st := startStack(t, s.options("saturation: {disabled: true}", p), p, s.decode)
	hc := httpClient(t)
	usage := func() float64 { return value(engineMetrics(t, p), "vllm:kv_cache_usage_perc", nil) }
	finished := func(reason string) float64 {
		return value(engineMetrics(t, p), "vllm:request_success_total", map[string]string{"finished_reason": reason})
	}
	usageBefore, completedBefore, abortsBefore, decodeBefore := usage(), finished("length"), finished("abort"), successes(t, s.decode)

	// Keep the prefill engine busy: long prompts sent to it directly, each
	// finishing after its one token.
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := range busyRequests {
		wg.Go(func() {
			body := completion(strings.Repeat(prompt(fmt.Sprintf("busy %d", i)), 3), 1)
			payload, _ := json.Marshal(body.body)
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, p.URL()+completionsPath, strings.NewReader(string(payload)))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := hc.Do(req); err == nil {
				resp.Body.Close()
			}
		})
	}
	require.Eventually(t, func() bool {
		fams := engineMetrics(t, p)
		return value(fams, "vllm:num_requests_running", nil)+value(fams, "vllm:num_requests_waiting", nil) > 0
	}, time.Minute, 20*time.Millisecond, "the prefill engine is busy")

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body, _ := json.Marshal(chat(prompt("a client that walks away"), 6).body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.URL()+chatPath, strings.NewReader(string(body)))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	type answer struct {
		resp *http.Response
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		resp, err := hc.Do(req)
		answered <- answer{resp, err}
	}()
	// Give up once pdx's prefill call is in the engine's queue, not on a
	// timer: on a loaded machine the render before it can take longer.
	require.Eventually(t, func() bool {
		return value(pdxMetrics(t, st), "pdx_endpoint_in_flight", map[string]string{"role": "prefill", "endpoint": p.Addr()}) >= 1
	}, time.Minute, 10*time.Millisecond, "pdx called the prefill engine")
	time.Sleep(200 * time.Millisecond) // the call reaches vLLM
	cancel()
	got := <-answered
	if got.err == nil {
		got.resp.Body.Close()
		t.Fatalf("the client got an answer (%d) before it gave up: the prefill engine was not busy enough", got.resp.StatusCode)
	}
	require.ErrorIs(t, got.err, context.Canceled)

	wg.Wait()
	require.Eventually(t, func() bool {
		fams := engineMetrics(t, p)
		return value(fams, "vllm:num_requests_running", nil)+value(fams, "vllm:num_requests_waiting", nil) == 0
	}, 2*time.Minute, 100*time.Millisecond, "the prefill engine is idle again")
	require.Equal(t, completedBefore+busyRequests, finished("length"),
		"the prefill engine completed the busy requests, not the prefill of the client that left")
	t.Logf("vLLM counted %v aborted requests (an abort is counted once the request reached the engine core)", finished("abort")-abortsBefore)
	require.LessOrEqual(t, usage(), usageBefore, "the prefill engine holds no KV for the request that was given up")
	require.Equal(t, decodeBefore, successes(t, s.decode), "no decode was sent for it")
	fams := pdxMetrics(t, st)
	require.Equal(t, 1.0, value(fams, "pdx_prefill_attempts_total", map[string]string{"endpoint": p.Addr(), "result": "cancelled"}),
		"pdx cancelled its prefill call")
}

// jsonKind is the JSON type of a decoded value.
func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "bool"
	case float64:
		return "number"
	case string:
		return "string"
	case []any:
		return "array"
	default:
		return "object"
	}
}

// TestNixlPrefillAnswerMatchesSimulator sends the prefill leg pdx sends to
// a real NIXL producer and to pdx's engine simulator: the simulator's
// kv_transfer_params must have the real engine's members, of the same
// JSON types, and the same values where they are not the engine's own
// (ids, host, port, block ids).
func TestNixlPrefillAnswerMatchesSimulator(t *testing.T) {
	s := engines.nixlEngines(t)
	sim, err := enginesim.Start(t.Context(), "127.0.0.1:0", enginesim.Config{Role: enginesim.RolePrefill, Connector: "nixl"})
	require.NoError(t, err)
	defer sim.Close()
	hc := httpClient(t)
	kvParams := func(base string, c call) (map[string]any, result) {
		t.Helper()
		r := send(t, hc, base, c, "X-Request-Id", "prefill-shape-"+base)
		require.Equal(t, http.StatusOK, r.status, r.raw)
		var kv map[string]any
		require.NoError(t, json.Unmarshal(r.kvParams, &kv), r.raw)
		return kv, r
	}
	c := completion(prompt("the prefill's answer"), 1).with("stream", false,
		"kv_transfer_params", map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
			"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil})
	real, realAnswer := kvParams(s.prefill[0].URL(), c)
	simulated, simAnswer := kvParams("http://"+sim.Addr(), c)
	t.Logf("vLLM %s: %v", realvllm.Version, real)
	for k, v := range real {
		require.Contains(t, simulated, k, "the simulator's kv_transfer_params lack vLLM's %s", k)
		require.Equal(t, jsonKind(v), jsonKind(simulated[k]), "%s: %v (vLLM) and %v (simulator)", k, v, simulated[k])
	}
	for k := range simulated {
		require.Contains(t, real, k, "the simulator sends %s, which vLLM does not", k)
	}
	for _, k := range []string{"do_remote_prefill", "do_remote_decode", "tp_size", "dcp_size", "pp_size", "transfer_mode", "remote_blocks_expiry_time"} {
		require.Equal(t, real[k], simulated[k], k)
	}
	require.EqualValues(t, realAnswer.promptTokens, real["remote_num_tokens"], "vLLM: remote_num_tokens is the prompt's length")
	require.EqualValues(t, simAnswer.promptTokens, simulated["remote_num_tokens"], "simulator: remote_num_tokens is the prompt's length")
	blocks := real["remote_block_ids"].([]any)
	require.Len(t, blocks, 1, "one KV cache group")
	require.Len(t, blocks[0], (realAnswer.promptTokens+realvllm.BlockSize-1)/realvllm.BlockSize, "a block id per %d tokens, the last one partial", realvllm.BlockSize)
	require.Equal(t, "127.0.0.1", real["remote_host"])
	require.Equal(t, s.prefill[0].SideChannel(), fmt.Sprintf("%s:%v", real["remote_host"], real["remote_port"]), "the NIXL side channel")
}
