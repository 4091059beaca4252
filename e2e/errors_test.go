package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// errorCase is one way a client gets an error: how to cause it and what it
// must be answered with.
type errorCase struct {
	status int
	code   string
	msg    string // part of the message
	send   func(t *testing.T, env *errorEnv) answer
}

// errorEnv is the deployment every error case runs against: the stack's
// pool (demo-model, not the default) and one pool per faulty engine.
type errorEnv struct {
	st *stack.Stack
	hc *http.Client
}

func (e *errorEnv) post(t *testing.T, path, body string, headers ...string) answer {
	t.Helper()
	return post(t, e.hc, e.st.URL()+path, body, headers...)
}

// completion is a completion request for model.
func completion(model string) string {
	return `{"model":"` + model + `","prompt":"errors","max_tokens":2}`
}

// garbageEngine accepts connections and answers each request with bytes
// that are not HTTP: a decode engine whose answer cannot be read.
func garbageEngine(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = bufio.NewReader(c).ReadString('\n')
				_, _ = io.WriteString(c, "NOT HTTP AT ALL\r\n\r\n")
			}()
		}
	}()
	return ln.Addr().String()
}

// saturatedEngine is an engine whose metrics say its queue is full (vLLM's
// names); it serves nothing else.
func saturatedEngine(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"saturated\"} 9\n"+
			"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"saturated\"} 64\n")
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// faultyEngine starts a NIXL engine of role tuned by cfg.
func faultyEngine(t *testing.T, role enginesim.Role, cfg enginesim.Config) string {
	t.Helper()
	cfg.Role = role
	e, err := enginesim.Start(context.Background(), "127.0.0.1:0", cfg)
	require.NoError(t, err)
	t.Cleanup(func() { e.Close() })
	return e.Addr()
}

// startErrorEnv starts the deployment for the error cases, with Envoy in
// profile (envoy.Config.Profile).
func startErrorEnv(t *testing.T, profile string) *errorEnv {
	t.Helper()
	decode := faultyEngine(t, enginesim.RoleDecode, enginesim.Config{})
	slowDecode := faultyEngine(t, enginesim.RoleDecode, enginesim.Config{DecodeLatency: time.Minute})
	pools := []struct{ model, connector, prefill, decode, extra string }{
		{"rejects", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{FailStatus: 400}), decode, ""},
		{"overloaded", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{FailStatus: 429}), decode, ""},
		{"fails", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{FailStatus: 500}), decode, ""},
		{"tampered", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{TamperKVParams: []byte(`{"remote_host":"203.0.113.66"}`)}), decode, ""},
		{"unreachable", "nixl", loopback.FreeAddr(t), decode, ""},
		{"slow", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{PrefillLatency: time.Minute}), decode, "prefill_timeout: 300ms"},
		{"silent-router", "nixl", faultyEngine(t, enginesim.RolePrefill, enginesim.Config{PrefillLatency: time.Minute}), decode, "prefill_timeout: 1m"},
		{"garbage-decode", "none", "", garbageEngine(t), ""},
		{"down-decode", "none", "", loopback.FreeAddr(t), ""},
		{"slow-decode", "none", "", slowDecode, ""},
		{"saturated", "none", "", saturatedEngine(t), "saturation: {action: reject}"},
		{"sglang-pool", "sglang", loopback.FreeAddr(t), loopback.FreeAddr(t), ""},
	}
	var b strings.Builder
	for _, p := range pools {
		fmt.Fprintf(&b, "- name: %s\n  models: [%s]\n  connector: %s\n  prefill_attempts: 1\n", p.model, p.model, p.connector)
		if p.extra != "" {
			fmt.Fprintf(&b, "  %s\n", p.extra)
		}
		if p.prefill != "" {
			fmt.Fprintf(&b, "  prefill: [{address: %s}]\n", p.prefill)
		}
		fmt.Fprintf(&b, "  decode: [{address: %s}]\n", p.decode)
	}
	st := startStack(t, stack.Options{
		Prefill: 1, Decode: 1, NotDefault: true, MaxBodyBytes: 64 << 10, Profile: profile,
		ConfigYAML: "request_body_timeout: 1s", PoolsYAML: b.String(),
		Envoy: func(c *envoy.Config) {
			if profile != envoy.ProfileAIGateway { // whose streamed bodies have none
				c.MessageTimeout = time.Second // the silent router
			}
			c.StreamIdleTimeout = 2 * time.Second // the slow decode
		},
	})
	_, hc := newClient(t, st)
	return &errorEnv{st: st, hc: hc}
}

// errorCases are the rows of the error table of docs/errors.md, each
// caused through Envoy. router_unavailable is last: it stops pdx.
var errorCases = []errorCase{
	{400, "invalid_json", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", `{"model":`) }},
	{400, "duplicate_key", `"prompt"`, func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":"x","prompt":"y"}`)
	}},
	{400, "missing_body", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", ``) }},
	{400, "missing_model", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":null,"prompt":"x"}`)
	}},
	{400, "missing_messages", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/chat/completions", `{"model":"demo-model"}`)
	}},
	{400, "missing_prompt", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", `{"model":"demo-model"}`) }},
	{400, "empty_messages", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/chat/completions", `{"model":"demo-model","messages":[]}`)
	}},
	{400, "empty_prompt", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":[]}`)
	}},
	{400, "invalid_type", `"stream"`, func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":"x","stream":"yes"}`)
	}},
	{400, "invalid_value", "at least 1", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":"x","max_tokens":0}`)
	}},
	{400, "unsupported_value", `"n" is 2`, func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":"x","n":2}`)
	}},
	{400, "invalid_header", "x-llm-d-slo-ttft-ms", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", completion("demo-model"), "x-llm-d-slo-ttft-ms", "1.5")
	}},
	{400, "bad_request", "path_normalization_failed", func(t *testing.T, e *errorEnv) answer {
		return rawHTTP(t, e.st, "POST /v1%2Fcompletions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	}},
	{404, "model_not_found", `"gpt-9"`, func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("gpt-9")) }},
	{404, "not_found", "/v1/responses/resp_1", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/responses/resp_1", `{"model":"demo-model"}`)
	}},
	{400, "missing_input", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/responses", `{"model":"demo-model"}`) }},
	{400, "empty_input", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/responses", `{"model":"demo-model","input":[]}`)
	}},
	{400, "unsupported_value", "pdx stores none", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/responses", `{"model":"demo-model","input":"x","previous_response_id":"resp_1"}`)
	}},
	{400, "missing_max_tokens", `"max_tokens"`, func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/messages", `{"model":"demo-model","messages":[{"role":"user","content":"x"}]}`)
	}},
	{501, "unsupported_api", `connector "sglang"`, func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/responses", `{"model":"sglang-pool","input":"x"}`)
	}},
	{405, "method_not_allowed", "use POST", func(t *testing.T, e *errorEnv) answer {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, e.st.URL()+"/v1/chat/completions", nil)
		require.NoError(t, err)
		return do(t, e.hc, req)
	}},
	{408, "request_timeout", "within 1s", func(t *testing.T, e *errorEnv) answer {
		return rawHTTP(t, e.st, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
	}},
	{413, "body_too_large", "over the limit of 65536", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", `{"model":"demo-model","prompt":"`+strings.Repeat("x", 64<<10)+`"}`)
	}},
	{415, "unsupported_content_encoding", "gzip", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", completion("demo-model"), "Content-Encoding", "gzip")
	}},
	{426, "upgrade_required", "HTTP/1.0", func(t *testing.T, e *errorEnv) answer {
		return rawHTTP(t, e.st, "GET /v1/models HTTP/1.0\r\n\r\n")
	}},
	{431, "headers_too_large", "", func(t *testing.T, e *errorEnv) answer {
		var h []string
		for i := range 94 {
			h = append(h, fmt.Sprintf("X-Extra-%d", i), "v")
		}
		return e.post(t, "/v1/completions", completion("demo-model"), h...)
	}},
	{400, "prefill_rejected", "answered 400", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("rejects")) }},
	{429, "overloaded", "every decode engine of pool saturated is saturated", func(t *testing.T, e *errorEnv) answer {
		// Until pdx has scraped the engine it is not known to be saturated.
		var a answer
		require.Eventually(t, func() bool {
			a = e.post(t, "/v1/completions", completion("saturated"))
			return a.status == 429
		}, 5*time.Second, 20*time.Millisecond)
		return a
	}},
	{429, "prefill_overloaded", "answered 429", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("overloaded")) }},
	{502, "prefill_failed", "answered 500", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("fails")) }},
	{502, "bad_prefill_answer", "203.0.113.66", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("tampered")) }},
	{502, "engine_error", "", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", completion("garbage-decode"))
	}},
	{503, "prefill_unavailable", "connection refused", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", completion("unreachable"))
	}},
	{503, "engine_unavailable", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("down-decode")) }},
	{504, "prefill_timeout", "after 300ms", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("slow")) }},
	{504, "engine_timeout", "", func(t *testing.T, e *errorEnv) answer { return e.post(t, "/v1/completions", completion("slow-decode")) }},
	{504, "router_timeout", "message_timeout", func(t *testing.T, e *errorEnv) answer {
		return e.post(t, "/v1/completions", completion("silent-router"))
	}},
	{503, "router_unavailable", "", func(t *testing.T, e *errorEnv) answer {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		require.NoError(t, e.st.Pdx.Shutdown(ctx))
		return e.post(t, "/v1/completions", completion("demo-model"))
	}},
}

// Every error a client can get through the Envoy config pdx ships is
// OpenAI-style JSON with the status and code the error table of
// docs/errors.md gives it, and the client's request id. Behind an Envoy
// shaped as AI Gateway's InferencePool translation the same holds, but for
// what that translation configures differently (aiGatewayStatus).
func TestErrorTable(t *testing.T) {
	for _, profile := range []string{envoy.ProfilePdx, envoy.ProfileAIGateway} {
		t.Run(profile, func(t *testing.T) {
			env := startErrorEnv(t, profile)
			for _, c := range errorCases {
				status := c.status
				if profile == envoy.ProfileAIGateway {
					s, ok := aiGatewayStatus[c.code]
					if ok && s == 0 {
						continue
					}
					if ok {
						status = s
					}
				}
				t.Run(fmt.Sprintf("%d %s", status, c.code), func(t *testing.T) {
					a := c.send(t, env)
					if typ, ok := anthropicErrors[c.code]; ok {
						requireAnthropicError(t, a, status, typ, c.msg)
						return
					}
					requireAPIError(t, a, status, c.code, c.msg)
				})
			}
			t.Run("the client's request id comes back", func(t *testing.T) {
				env := startErrorEnv(t, profile)
				a := env.post(t, "/v1/completions", completion("fails"), "X-Request-Id", "mine-502")
				require.Equal(t, "mine-502", a.header.Get("X-Request-Id"))
				a = env.post(t, "/v1/completions", completion("down-decode"), "X-Request-Id", "mine-503")
				requireAPIError(t, a, 503, "engine_unavailable", "")
				require.Equal(t, "mine-503", a.header.Get("X-Request-Id"), "also on Envoy's own answers once pdx routed")
			})
		})
	}
}

// anthropicErrors are the codes of errorCases caused on the Messages API,
// which answers in Anthropic's shape (its error type by status, no code),
// with their type.
var anthropicErrors = map[string]string{"missing_max_tokens": "invalid_request_error"}

// aiGatewayStatus is how the AI Gateway profile answers what its filter
// configures differently from pdx's own, by code; 0: the case cannot
// happen there.
var aiGatewayStatus = map[string]int{
	// No status_on_error: Envoy's default for a failed ext_proc, 500.
	"router_unavailable": 500,
	// FULL_DUPLEX_STREAMED applies no message_timeout: pdx's
	// prefill_timeout bounds the wait (prefill_timeout's row).
	"router_timeout": 0,
	// Envoy refuses HTTP/1.0 in its codec; with this filter the client
	// sees the connection close without the 426 (Envoy 1.40).
	"upgrade_required": 0,
}

// The error table of docs/errors.md lists exactly the codes TestErrorTable
// causes, and the ones checked without Envoy (which its rows say).
func TestErrorTableMatchesDocs(t *testing.T) {
	doc, err := os.ReadFile("../docs/errors.md")
	require.NoError(t, err)
	_, table, ok := strings.Cut(string(doc), "| status | code | when | answered by |")
	require.True(t, ok, "docs/errors.md has the error table")
	row := regexp.MustCompile("(?m)^\\| ([0-9/]+) \\| ((?:`[a-z_]+`(?:, )?)+) \\|(.*)\\|$")
	documented := map[string]string{}
	for _, m := range row.FindAllStringSubmatch(strings.SplitN(table, "\n\n", 2)[0], -1) {
		for _, code := range regexp.MustCompile("`([a-z_]+)`").FindAllStringSubmatch(m[2], -1) {
			documented[code[1]] = m[1]
			if strings.Contains(m[3], "checked without Envoy") {
				documented[code[1]] = "without Envoy"
			}
		}
	}
	require.NotEmpty(t, documented)
	tested := map[string]bool{}
	for _, c := range errorCases {
		status, ok := documented[c.code]
		require.True(t, ok, "TestErrorTable checks %s, which docs/errors.md does not list", c.code)
		require.True(t, slices.Contains(strings.Split(status, "/"), fmt.Sprint(c.status)), "%s: docs/errors.md says %s, the test %d", c.code, status, c.status)
		tested[c.code] = true
	}
	for code, status := range documented {
		require.True(t, tested[code] || status == "without Envoy", "docs/errors.md lists %s, which TestErrorTable does not check", code)
	}
}

// TestMessagesLocalReplies: Envoy's own answers on Anthropic's Messages
// API (an engine that cannot be reached, a body over Envoy's limit) are
// Anthropic's error body, as pdx's own are there; on the other paths they
// stay OpenAI's.
func TestMessagesLocalReplies(t *testing.T) {
	env := startErrorEnv(t, envoy.ProfilePdx)
	messages := func(model, content string) string {
		b, err := json.Marshal(map[string]any{"model": model, "max_tokens": 4,
			"messages": []map[string]string{{"role": "user", "content": content}}})
		require.NoError(t, err)
		return string(b)
	}
	requireAnthropicError(t, env.post(t, "/v1/messages", messages("down-decode", "hi")), 503, "api_error", "the inference engine could not be reached")
	requireAnthropicError(t, env.post(t, "/v1/messages", messages("demo-model", strings.Repeat("x", 64<<10))), 413, "request_too_large", "over the limit of 65536")
	requireAPIError(t, env.post(t, "/v1/completions", completion("down-decode")), 503, "engine_unavailable", "")
}
