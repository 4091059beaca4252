package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// flowStack is one prefill and one decode engine, in a pool that holds one request at a time (max_in_flight: 1):
// every request after the first waits in pdx's flow control, in its turn.
func flowStack(t *testing.T, flowControl string) *stack.Stack {
	return startStack(t, stack.Options{
		Prefill: 1, Decode: 1,
		// A request of the test's decodes in about 0.1 s, the first in
		// 3 s (max_tokens): it holds the pool while the others queue.
		Engine:   enginesim.Config{DecodeLatency: 100 * time.Millisecond, DecodePerToken: 5 * time.Millisecond},
		PoolYAML: "saturation: {max_in_flight: 1, max_queue_time: 30s}\nflow_control: " + flowControl + "\n",
	})
}

// flowClient sends chat requests through Envoy, each with its headers,
// and waits until pdx counts it queued before the next starts: the order
// of arrival is the order of the calls.
type flowClient struct {
	t     *testing.T
	st    *stack.Stack
	hc    *http.Client
	wg    sync.WaitGroup
	mu    sync.Mutex
	got   map[string]answer
	sent  int
	queue int // requests pdx has waiting, as far as this client knows
}

func newFlowClient(t *testing.T, st *stack.Stack) *flowClient {
	hc := &http.Client{Timeout: 60 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	return &flowClient{t: t, st: st, hc: hc, got: map[string]answer{}}
}

// flowText is request name's prompt: a long one (about 900 tokens) for
// names that start with "big".
func flowText(name string) string {
	text := "request " + name + " of the flow-control test"
	if strings.HasPrefix(name, "big") {
		text += strings.Repeat(" a long prompt", 250)
	}
	return text
}

// send sends request name with headers (name, value, ...) on ctx. A
// request that is to wait (queued) is sent once pdx counts it waiting.
func (c *flowClient) send(ctx context.Context, name string, queued bool, headers ...string) {
	c.t.Helper()
	maxTokens := 2
	if !queued {
		maxTokens = 600
	}
	c.wg.Go(func() {
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":%d}`, stack.Model, flowText(name), maxTokens)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.st.URL()+"/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			panic(err)
		}
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		var a answer
		if resp, err := c.hc.Do(req); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			a = answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
		}
		c.mu.Lock()
		c.got[name] = a
		c.mu.Unlock()
	})
	if queued {
		c.queue++
		c.waitQueued(c.queue)
	} else {
		// The first holds the decode engine before the next is sent.
		require.Eventually(c.t, func() bool {
			return value(scrape(c.t, "http://"+c.st.Pdx.AdminAddr()+"/metrics"), "pdx_endpoint_in_flight", map[string]string{"role": "decode"}) >= 1
		}, 10*time.Second, 5*time.Millisecond)
	}
}

// waitQueued waits until pdx has n requests waiting.
func (c *flowClient) waitQueued(n int) {
	c.t.Helper()
	require.Eventually(c.t, func() bool {
		return value(scrape(c.t, "http://"+c.st.Pdx.AdminAddr()+"/metrics"), "pdx_flow_control_waiting", nil) == float64(n)
	}, 10*time.Second, 5*time.Millisecond, "%d requests waiting", n)
}

// served waits for every request and returns the order the prefill engine
// saw them in: the order pdx admitted them.
func (c *flowClient) served(names ...string) []string {
	c.t.Helper()
	c.wg.Wait()
	byPrint := map[string]string{}
	for _, n := range names {
		byPrint[enginesim.Fingerprint(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: flowText(n)}}))] = n
	}
	var order []string
	for _, r := range c.st.Prefill[0].Records() {
		if n, ok := byPrint[r.Fingerprint]; ok && r.Kind == enginesim.KindPrefill {
			order = append(order, n)
		}
	}
	return order
}

func (c *flowClient) answer(name string) answer {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.got[name]
}

// Requests that wait for a saturated pool are admitted by band, higher
// first and sheddable last, and within a band flows take turns, through
// the real Envoy; both spellings of the headers count, and none reaches
// an engine.
func TestFlowControlOrder(t *testing.T) {
	t.Run("bands", func(t *testing.T) {
		st := flowStack(t, "{objectives: [{name: critical, priority: 10}, {name: batch, priority: -1}]}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		c.send(t.Context(), "batch", true, "x-llm-d-inference-objective", "batch")
		c.send(t.Context(), "plain", true)
		c.send(t.Context(), "unknown", true, "x-llm-d-inference-objective", "nobody-listed-it")
		c.send(t.Context(), "critical", true, "x-gateway-inference-objective", "critical")
		require.Equal(t, []string{"first", "critical", "plain", "unknown", "batch"},
			c.served("first", "batch", "plain", "unknown", "critical"))
		for _, n := range []string{"first", "batch", "plain", "unknown", "critical"} {
			require.Equal(t, 200, c.answer(n).status, n)
		}
		fams := scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics")
		require.Equal(t, uint64(1), count(fams, "pdx_flow_control_wait_seconds", map[string]string{"band": "10", "outcome": "admitted"}))
		require.Equal(t, uint64(1), count(fams, "pdx_flow_control_wait_seconds", map[string]string{"band": "-1", "outcome": "admitted"}))
		require.Equal(t, uint64(2), count(fams, "pdx_flow_control_wait_seconds", map[string]string{"band": "0", "outcome": "admitted"}))
	})
	t.Run("flows take turns", func(t *testing.T) {
		st := flowStack(t, "{}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		for i := range 4 {
			c.send(t.Context(), fmt.Sprintf("a%d", i), true, "x-llm-d-inference-fairness-id", "tenant-a")
		}
		for i := range 2 {
			c.send(t.Context(), fmt.Sprintf("b%d", i), true, "x-gateway-inference-fairness-id", "tenant-b")
		}
		require.Equal(t, []string{"first", "a0", "b0", "a1", "b1", "a2", "a3"},
			c.served("first", "a0", "a1", "a2", "a3", "b0", "b1"))
	})
	t.Run("token usage: the flow served fewest tokens first", func(t *testing.T) {
		st := flowStack(t, "{fairness: token_usage}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		for _, n := range []string{"big0", "big1", "small0", "small1", "small2"} {
			c.send(t.Context(), n, true, "x-llm-d-inference-fairness-id", strings.TrimRight(n, "0123456789"))
		}
		// big0 is served first (the flows are level), and its ~900
		// tokens let small's three go before big1.
		require.Equal(t, []string{"first", "big0", "small0", "small1", "small2", "big1"},
			c.served("first", "big0", "big1", "small0", "small1", "small2"))
	})
	t.Run("edf: the earliest deadline first", func(t *testing.T) {
		st := flowStack(t, "{ordering: edf}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		c.send(t.Context(), "none", true)
		c.send(t.Context(), "late", true, "x-llm-d-slo-ttft-ms", "60000")
		c.send(t.Context(), "soon", true, "x-llm-d-slo-ttft-ms", "20000")
		require.Equal(t, []string{"first", "soon", "late", "none"}, c.served("first", "none", "late", "soon"))
	})
	t.Run("the headers reach no engine", func(t *testing.T) {
		st := flowStack(t, "{}")
		hc := &http.Client{Timeout: 30 * time.Second}
		t.Cleanup(hc.CloseIdleConnections)
		a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody("who sees my objective?"),
			"x-llm-d-inference-objective", "critical", "x-gateway-inference-objective", "critical",
			"x-llm-d-inference-fairness-id", "me", "x-gateway-inference-fairness-id", "me", "x-llm-d-slo-ttft-ms", "500")
		require.Equal(t, 200, a.status, a.body)
		seen := 0
		for _, e := range st.Engines() {
			for _, r := range e.Records() {
				if r.Path != "/v1/chat/completions" {
					continue // the decode's KV pull
				}
				seen++
				require.Contains(t, r.Headers, "x-request-id", "the engine's headers are recorded")
				for _, h := range r.Headers {
					require.NotContains(t, h, "inference-objective", e.Addr())
					require.NotContains(t, h, "fairness-id", e.Addr())
					require.NotContains(t, h, "slo-ttft", e.Addr())
				}
			}
		}
		require.Equal(t, 2, seen, "a prefill and a decode")
		a = post(t, hc, st.URL()+"/v1/chat/completions", chatBody("a bad SLO"), "x-llm-d-slo-ttft-ms", "soon")
		requireAPIError(t, a, 400, "invalid_header", "x-llm-d-slo-ttft-ms")
	})
}

// A request waits at most its band's longest wait, a client that goes
// away leaves the queue at once, and a full queue sheds the lowest band
// first: a sheddable request never costs a critical one its place.
func TestFlowControlShedding(t *testing.T) {
	t.Run("band's longest wait", func(t *testing.T) {
		st := flowStack(t, "{objectives: [{name: batch, priority: -1}], bands: [{priority: -1, max_queue_time: 200ms}]}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		c.send(t.Context(), "batch", true, "x-llm-d-inference-objective", "batch")
		c.served("first", "batch")
		a := c.answer("batch")
		requireAPIError(t, a, 429, "overloaded", "none had room within 200ms")
		require.Equal(t, "1", a.header.Get("retry-after"))
		require.Contains(t, a.body, `objective \"batch\", priority -1`)
	})
	t.Run("a client that goes away", func(t *testing.T) {
		st := flowStack(t, "{}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		ctx, cancel := context.WithCancel(t.Context())
		c.send(ctx, "gone", true)
		c.send(t.Context(), "stays", true)
		cancel()
		c.queue--
		c.waitQueued(1)
		require.Equal(t, []string{"first", "stays"}, c.served("first", "gone", "stays"))
		require.Eventually(t, func() bool {
			return count(scrape(t, "http://"+st.Pdx.AdminAddr()+"/metrics"), "pdx_flow_control_wait_seconds", map[string]string{"outcome": "cancelled"}) == 1
		}, 10*time.Second, 10*time.Millisecond)
	})
	t.Run("a full queue sheds the lowest band", func(t *testing.T) {
		st := flowStack(t, "{max_requests: 2, objectives: [{name: critical, priority: 10}, {name: batch, priority: -1}]}")
		c := newFlowClient(t, st)
		c.send(t.Context(), "first", false)
		c.send(t.Context(), "batch-1", true, "x-llm-d-inference-objective", "batch")
		c.send(t.Context(), "batch-2", true, "x-llm-d-inference-objective", "batch")
		// Each critical request takes a batch request's place.
		for i, displaced := range []string{"batch-2", "batch-1"} {
			name := fmt.Sprintf("critical-%d", i)
			c.queue--
			c.send(t.Context(), name, true, "x-llm-d-inference-objective", "critical")
			require.Eventually(t, func() bool { return c.answer(displaced).status != 0 }, 10*time.Second, 5*time.Millisecond)
			requireAPIError(t, c.answer(displaced), 429, "overloaded", "a request of a higher priority took this one's place")
		}
		// Full of critical requests: a batch request is refused, and
		// displaces none.
		c.queue--
		c.send(t.Context(), "batch-3", true, "x-llm-d-inference-objective", "batch")
		require.Equal(t, []string{"first", "critical-0", "critical-1"},
			c.served("first", "batch-1", "batch-2", "batch-3", "critical-0", "critical-1"))
		requireAPIError(t, c.answer("batch-3"), 429, "overloaded", "its queue is full")
		for _, n := range []string{"first", "critical-0", "critical-1"} {
			require.Equal(t, 200, c.answer(n).status, n)
		}
	})
}

// With when_prefill_saturated by band (prefill_saturated_min_priority), a
// critical request goes to its decode engine alone while batch requests
// hold and wait for the one prefill slot (prefill_max_in_flight), through
// the real Envoy: the decode engine computes its prompt, and the batch
// requests are prefilled in their turn.
func TestFlowControlLocalPrefillByBand(t *testing.T) {
	st := startStack(t, stack.Options{
		Prefill: 1, Decode: 1,
		// Each prefill holds the prefill engine for 3 s; a prompt the
		// decode engine computes itself takes no time.
		Tune: func(role enginesim.Role, _ int, c *enginesim.Config) {
			if role == enginesim.RolePrefill {
				c.PrefillLatency = 3 * time.Second
			}
		},
		PoolYAML: "saturation: {prefill_max_in_flight: 1, max_queue_time: 30s}\n" +
			"flow_control: {objectives: [{name: chat, priority: 10}, {name: batch, priority: -1}]}\n" +
			"disaggregation: {when_prefill_saturated: true, prefill_saturated_min_priority: 1}\n",
	})
	admin := "http://" + st.Pdx.AdminAddr() + "/metrics"
	c := newFlowClient(t, st)
	c.send(t.Context(), "first", false, "x-llm-d-inference-objective", "batch")
	require.Eventually(t, func() bool {
		return value(scrape(t, admin), "pdx_endpoint_in_flight", map[string]string{"role": "prefill"}) >= 1
	}, 10*time.Second, 5*time.Millisecond, "the first request holds the prefill engine")
	c.send(t.Context(), "batch", true, "x-llm-d-inference-objective", "batch")

	hc := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(flowText("chat")), "x-llm-d-inference-objective", "chat")
	require.Equal(t, 200, a.status, a.body)
	require.Equal(t, float64(1), value(scrape(t, admin), "pdx_flow_control_waiting", nil),
		"the chat request was served while the batch one still waited")

	require.Equal(t, []string{"first", "batch"}, c.served("first", "batch", "chat"), "the prefill engine saw the batch requests alone")
	for _, n := range []string{"first", "batch"} {
		require.Equal(t, 200, c.answer(n).status, n)
	}
	chat := enginesim.Fingerprint(enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: flowText("chat")}}))
	var kinds []string
	for _, r := range st.Decode[0].Records() {
		if r.Fingerprint == chat {
			kinds = append(kinds, r.Kind)
		}
	}
	require.Equal(t, []string{enginesim.KindPlain}, kinds, "the decode engine computed the chat prompt itself")
	require.Equal(t, float64(1), value(scrape(t, admin), "pdx_disaggregation_decisions_total", map[string]string{"decision": "prefill_saturated"}))
}
