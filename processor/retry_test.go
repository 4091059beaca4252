package processor

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// scripted returns an engine whose prefill endpoints answer as answers
// says, by address.
func scripted(answers map[string]fakeengine.Reply) *fakeengine.Engine {
	e := fakeengine.New()
	for address, r := range answers {
		e.On(http.MethodPost, address, "", r)
	}
	return e
}

// retryEngine returns an engine whose prefill endpoints .1, .2 and .3 of
// retryTable answer as a1, a2 and a3.
func retryEngine(a1, a2, a3 fakeengine.Reply) *fakeengine.Engine {
	return scripted(map[string]fakeengine.Reply{"127.0.0.1:1": a1, "127.0.0.1:2": a2, "127.0.0.1:3": a3})
}

// called returns the addresses e was called on, in order.
func called(e *fakeengine.Engine) []string {
	var out []string
	for _, c := range e.Calls() {
		out = append(out, c.Endpoint.Address)
	}
	return out
}

var (
	answerOK = fakeengine.Reply{Body: kvAnswer}
	answer   = func(status int) fakeengine.Reply {
		return fakeengine.Reply{Err: &engines.Error{Status: status, Message: fmt.Sprintf("status %d", status)}}
	}
	answerRefused = fakeengine.Reply{Err: &engines.Error{Err: errors.New("connection refused")}}
	// answerHang waits in an Fn rather than as a Block reply, which would
	// name the endpoint in its error and be recorded only when it ends:
	// called lists the attempts in the order they started.
	answerHang = fakeengine.Reply{Fn: func(ctx context.Context, _ fakeengine.Call) ([]byte, error) {
		<-ctx.Done()
		return nil, &engines.Error{Err: ctx.Err()}
	}}
	answerGarbage = fakeengine.Reply{Body: `<html>`}
)

// retryTable is a nixl pool over prefill endpoints .1, .2 and .3.
func retryTable(t *testing.T, extra string) *routing.Table {
	t.Helper()
	cfg, err := config.Parse([]byte(`
max_body_bytes: 4096
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:2}, {address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:9}]
  prefill_picker: {policy: round_robin} # the tests know which endpoint comes next
` + extra))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	return table
}

func runChat(t *testing.T, table *routing.Table, eng connectors.Engine) *extprocv3.ProcessingResponse {
	t.Helper()
	out := run(t, table, eng, headers("POST", "/v1/chat/completions", false), body(`{"model":"m","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"remote_host":"10.6.6.6"}}`, true))
	require.Len(t, out, 2)
	return out[1]
}

func TestPrefillRetries(t *testing.T) {
	tests := []struct {
		name    string
		extra   string
		answers [3]fakeengine.Reply
		// what the client gets: decode (routed) or an error status and code
		wantStatus int
		wantCode   string
		wantMsg    string
		wantCalls  []string
		wantPlain  bool // routed with the plain body (fallback)
	}{
		{name: "500 then success", answers: [3]fakeengine.Reply{answer(500), answerOK, answerOK},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}},
		{name: "refused, 503, then success", answers: [3]fakeengine.Reply{answerRefused, answer(503), answerOK},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}},
		{name: "garbage answer then success", answers: [3]fakeengine.Reply{answerGarbage, answerOK, answerOK},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}},
		{name: "429 then success", answers: [3]fakeengine.Reply{answer(429), answerOK, answerOK},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}},
		{name: "hanging endpoint: the attempt times out, the next succeeds", extra: "  prefill_timeout: 5s\n  prefill_attempt_timeout: 50ms\n",
			answers:   [3]fakeengine.Reply{answerHang, answerOK, answerOK},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}},
		{name: "the engine refuses the request: no retry", answers: [3]fakeengine.Reply{answer(400), answerOK, answerOK},
			wantStatus: 400, wantCode: "prefill_rejected", wantCalls: []string{"127.0.0.1:1"}},
		{name: "attempts are bounded", extra: "  prefill_attempts: 2\n", answers: [3]fakeengine.Reply{answer(500), answer(502), answerOK},
			wantStatus: 502, wantCode: "prefill_failed", wantMsg: "pool p: prefill engine 127.0.0.1:2 answered 502: status 502 (earlier attempts: pool p: prefill engine 127.0.0.1:1 answered 500: status 500)",
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}},
		{name: "all fail: the last failure decides the status", answers: [3]fakeengine.Reply{answer(500), answer(500), answerRefused},
			wantStatus: 503, wantCode: "prefill_unavailable", wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}},
		// How many attempts fit in the budget depends on the clock; that the
		// budget, not the attempts, ends the request does not.
		{name: "all hang: the budget ends it", extra: "  prefill_timeout: 150ms\n  prefill_attempt_timeout: 100ms\n",
			answers:    [3]fakeengine.Reply{answerHang, answerHang, answerHang},
			wantStatus: 504, wantCode: "prefill_timeout", wantMsg: "prefill timed out after 150ms"},
		// The budget runs out in the wait before the first pick (at
		// random up to 100ms; should the wait be shorter, in the attempt).
		{name: "the budget ends it before the pick", extra: "  prefill_timeout: 1ms\npeers: {addresses: [127.0.0.1:9003], pick_jitter: 100ms}\n",
			answers:    [3]fakeengine.Reply{answerHang, answerHang, answerHang},
			wantStatus: 504, wantCode: "prefill_timeout", wantMsg: "prefill timed out after 1ms"},
		{name: "all fail with fallback: decode without prefill", extra: "  on_prefill_failure: fallback\n",
			answers:   [3]fakeengine.Reply{answer(500), answerRefused, answerGarbage},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}, wantPlain: true},
		{name: "fallback is not for requests the engine refuses", extra: "  on_prefill_failure: fallback\n",
			answers:    [3]fakeengine.Reply{answer(422), answerOK, answerOK},
			wantStatus: 422, wantCode: "prefill_rejected", wantCalls: []string{"127.0.0.1:1"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := retryEngine(tc.answers[0], tc.answers[1], tc.answers[2])
			resp := runChat(t, retryTable(t, tc.extra), eng)
			if tc.wantCalls != nil {
				require.Equal(t, tc.wantCalls, called(eng))
			}
			if tc.wantStatus != 0 {
				status, b := immediateOf(t, resp)
				require.Equal(t, tc.wantStatus, status)
				require.Equal(t, tc.wantCode, b.Error.Code)
				require.Contains(t, b.Error.Message, tc.wantMsg)
				return
			}
			decode := string(resp.GetRequestBody().GetResponse().GetBodyMutation().GetBody())
			require.Equal(t, "127.0.0.1:9", setHeaders(resp.GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
			if tc.wantPlain {
				require.Equal(t, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, decode, "plain client body, client's kv_transfer_params gone")
				return
			}
			require.Contains(t, decode, `"remote_request_id":"r"`, "the decode carries the successful prefill's KV")
		})
	}
}

// An endpoint that keeps failing is left out of picking, so later requests
// stop paying for it; it is tried again after the cool-down.
func TestPassiveHealth(t *testing.T) {
	eng := retryEngine(answerRefused, answerOK, answerOK)
	table := retryTable(t, "  eject_after_failures: 2\n  eject_duration: 1h\n")
	for range 12 {
		resp := runChat(t, table, eng)
		require.Nil(t, resp.GetImmediateResponse(), "every request succeeds, retried where .1 failed")
	}
	calls := called(eng)
	require.Equal(t, 2, strings.Count(strings.Join(calls, " "), "127.0.0.1:1"), "ejected after 2 failures: %v", calls)
	pool, _ := table.Lookup("m")
	require.False(t, pool.Prefill.Set.Healthy(endpoint.Endpoint{Address: "127.0.0.1:1"}))
	require.True(t, pool.Prefill.Set.Healthy(endpoint.Endpoint{Address: "127.0.0.1:2"}))
}

// A request the engine refuses says nothing about the endpoint's health.
func TestClientErrorsDoNotEject(t *testing.T) {
	eng := retryEngine(answer(400), answer(400), answer(400))
	table := retryTable(t, "  eject_after_failures: 1\n")
	for range 6 {
		status, _ := immediateOf(t, runChat(t, table, eng))
		require.Equal(t, 400, status)
	}
	pool, _ := table.Lookup("m")
	for _, ep := range pool.Prefill.Set.Endpoints() {
		require.True(t, pool.Prefill.Set.Healthy(ep), ep.Address)
	}
}

func TestBodyLimit(t *testing.T) {
	big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 4096) + `"}]}`
	out := run(t, retryTable(t, ""), fakeengine.New(), headers("POST", "/v1/chat/completions", false), body(big, true))
	status, b := immediateOf(t, out[1])
	require.Equal(t, 413, status)
	require.Equal(t, "body_too_large", b.Error.Code)
	require.Contains(t, b.Error.Message, "over the limit of 4096")
}

// A 405 says which method works.
func TestMethodNotAllowedHeader(t *testing.T) {
	out := run(t, retryTable(t, ""), fakeengine.New(), headers("GET", "/v1/completions", true))
	require.Equal(t, "POST", setHeaders(out[0].GetImmediateResponse().GetHeaders())["allow"])
}
