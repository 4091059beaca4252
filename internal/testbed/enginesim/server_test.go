package enginesim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPlainRequest(t *testing.T) {
	tests := []struct {
		role   Role
		wantKV string
	}{
		{RoleDecode, KVRecomputed},
		{RoleBoth, KVRecomputed},
		{RolePrefill, ""},
	}
	for _, tt := range tests {
		t.Run(string(tt.role), func(t *testing.T) {
			s := startSim(t, Config{Role: tt.role})
			b := chatBody("plain").with("kv_transfer_params", nil)
			r := post(t, s, "/v1/chat/completions", "req-1", b)
			require.Equal(t, tt.wantKV, r.header.Get(HeaderKV))
			require.Empty(t, r.header.Get(HeaderKVSource))
			resp := r.decode(t)
			require.Equal(t, "chatcmpl-req-1", resp.ID)
			require.Equal(t, "assistant", resp.Choices[0].Message.Role)
			toks := outputTokens(Fingerprint("user: plain\n"), defaultMaxTokens)
			require.Equal(t, strings.Join(toks, ""), resp.text(), "16 tokens by default")
			require.True(t, strings.HasSuffix(resp.text(), " t15"))
			require.Equal(t, defaultMaxTokens, resp.Usage.CompletionTokens)
			require.Equal(t, resp.Usage.PromptTokens+resp.Usage.CompletionTokens, resp.Usage.TotalTokens)
			require.Nil(t, resp.KVTransferParams, "plain responses carry no kv_transfer_params")

			// Explicitly null params and params asking for no transfer are plain too.
			for _, kv := range []any{json.RawMessage("null"), map[string]any{"do_remote_decode": false, "do_remote_prefill": false}} {
				post(t, s, "/v1/chat/completions", "req-2", b.with("kv_transfer_params", kv)).decode(t)
			}
			recs := s.Records()
			require.Len(t, recs, 3)
			for _, rec := range recs {
				require.Equal(t, KindPlain, rec.Kind)
				require.Equal(t, tt.wantKV, rec.KV)
			}
		})
	}
}

func TestOutputLimits(t *testing.T) {
	tests := []struct {
		name string
		body body
		want int
	}{
		{"max_tokens", chatBody("x").with("max_tokens", 2), 2},
		{"max_completion_tokens wins", chatBody("x").with("max_tokens", 2, "max_completion_tokens", 3), 3},
		{"capped", chatBody("x").with("max_tokens", 100000), maxMaxTokens},
		{"completions ignore max_completion_tokens", completionBody("x").with("max_completion_tokens", 3), defaultMaxTokens},
		{"completions prompt array", completionBody("").with("prompt", []string{"a", "b"}, "max_tokens", 1), 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{})
			resp := post(t, s, pathFor(tt.body), "", tt.body).decode(t)
			require.Equal(t, tt.want, resp.Usage.CompletionTokens)
			require.True(t, strings.HasPrefix(resp.text(), "pdx-sim:"+Fingerprint(promptOf(t, tt.body))))
		})
	}
}

func TestPromptText(t *testing.T) {
	var msgs []Message
	require.NoError(t, json.Unmarshal([]byte(`[
		{"role":"system","content":"be brief"},
		{"role":"user","content":[{"type":"text","text":"look "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"here"}]},
		{"role":"assistant","content":null}
	]`), &msgs))
	require.Equal(t, "system: be brief\nuser: look here\nassistant: \n", ChatPromptText(msgs))
	require.Equal(t, "a\nb", promptOf(t, completionBody("").with("prompt", []string{"a", "b"})))
	require.Len(t, Fingerprint("x"), 12)
	require.Equal(t, "2d711642b726", Fingerprint("x"))
}

func TestBadRequests(t *testing.T) {
	tests := []struct {
		name    string
		path    string
		body    any
		wantMsg string
	}{
		{"malformed json", "/v1/chat/completions", []byte(`{"model":`), "not a JSON object"},
		{"not an object", "/v1/chat/completions", []byte(`[1]`), "not a JSON object"},
		{"trailing data", "/v1/chat/completions", []byte(`{"model":"m"} {}`), "unexpected data"},
		{"missing model", "/v1/chat/completions", chatBody("x").with("model", nil), "model is required"},
		{"model not a string", "/v1/chat/completions", chatBody("x").with("model", 5), "invalid model"},
		{"no messages", "/v1/chat/completions", chatBody("x").with("messages", []any{}), "messages is required"},
		{"message without role", "/v1/chat/completions", chatBody("x").with("messages", []any{map[string]any{"content": "x"}}), "messages[0].role is required"},
		{"missing prompt", "/v1/completions", completionBody("x").with("prompt", nil), "prompt is required"},
		{"token prompt", "/v1/completions", completionBody("x").with("prompt", []int{1, 2}), "token-id prompts are not supported"},
		{"zero max_tokens", "/v1/chat/completions", chatBody("x").with("max_tokens", 0), "max_tokens must be at least 1"},
		// pydantic's lax int takes "5" (TestVLLMFieldRules), not "five".
		{"string max_tokens", "/v1/chat/completions", chatBody("x").with("max_tokens", "five"),
			"max_tokens: Input should be a valid integer, unable to parse string as an integer"},
		{"fractional max_tokens", "/v1/chat/completions", chatBody("x").with("max_tokens", 1.5),
			"max_tokens: Input should be a valid integer, got a number with a fractional part"},
		{"stream_options without stream", "/v1/chat/completions", chatBody("x").with("stream_options", map[string]any{"include_usage": true}),
			"Stream options can only be defined when `stream=True`."},
		{"stream_options with stream null", "/v1/chat/completions",
			chatBody("x").with("stream", json.RawMessage("null"), "stream_options", map[string]any{"include_usage": false}),
			"Stream options can only be defined when `stream=True`."},
		{"completions n null", "/v1/completions", completionBody("x").with("n", json.RawMessage("null")),
			"n: Input should be a valid integer, got null (vLLM's CompletionRequest.n: int = 1)"},
		{"kv params not an object", "/v1/chat/completions", chatBody("x").with("kv_transfer_params", "yes"), "kv_transfer_params: Input should be a valid dictionary"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{})
			r := post(t, s, tt.path, "req-1", tt.body)
			require.Contains(t, r.errorMessage(t, http.StatusBadRequest), tt.wantMsg)
			require.Equal(t, s.Addr(), r.header.Get(HeaderEngine))
			rec := lastRecord(t, s)
			require.Equal(t, KindRejected, rec.Kind)
			require.NotEmpty(t, rec.Body, "even a broken body is recorded")
			_, err := json.Marshal(rec)
			require.NoError(t, err)
		})
	}
}

// TestNulls: null is absent for Optional fields and refused for fields an
// engine declares with a default but not Optional, which differ by engine.
func TestNulls(t *testing.T) {
	null := json.RawMessage("null")
	tests := []struct {
		name      string
		connector string
		body      body
		wantMsg   string // "" when accepted
	}{
		{"vLLM chat nulls", ConnectorNIXL, chatBody("x").with("stream", null, "stream_options", null, "max_tokens", null,
			"max_completion_tokens", null, "n", null, "temperature", null), ""},
		{"vLLM completions nulls", ConnectorMooncake, completionBody("x").with("stream", null, "stream_options", null, "max_tokens", null), ""},
		{"vLLM completions n null", ConnectorHTTP, completionBody("x").with("n", null), "n: Input should be a valid integer, got null (vLLM's CompletionRequest.n: int = 1)"},
		// validate_stream_options refuses a truthy stream_options without stream.
		{"vLLM empty stream_options without stream", ConnectorNIXL, chatBody("x").with("stream_options", map[string]any{}), ""},
		{"vLLM stream_options with stream null", ConnectorMooncake, chatBody("x").with("stream", null, "stream_options", map[string]any{"include_usage": true}),
			"Stream options can only be defined when `stream=True`."},
		{"SGLang chat stream null", ConnectorSGLang, chatBody("x").with("stream", null), "stream must not be null (SGLang's ChatCompletionRequest.stream: bool = False is not Optional)"},
		{"SGLang completions stream null", ConnectorSGLang, completionBody("x").with("stream", null), "stream must not be null (SGLang's CompletionRequest.stream: bool = False"},
		{"SGLang completions max_tokens null", ConnectorSGLang, completionBody("x").with("max_tokens", null), "max_tokens must not be null (SGLang's CompletionRequest.max_tokens: int = 16"},
		{"SGLang chat max_tokens null", ConnectorSGLang, chatBody("x").with("max_tokens", null, "n", null), ""},
		{"SGLang completions n null", ConnectorSGLang, completionBody("x").with("n", null), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Connector: tt.connector, StoreAddr: "127.0.0.1:1"})
			r := post(t, s, pathFor(tt.body), "req-1", tt.body)
			if tt.wantMsg == "" {
				require.Equal(t, defaultMaxTokens, r.decode(t).Usage.CompletionTokens)
				return
			}
			requireRejected(t, s, r, http.StatusBadRequest, tt.wantMsg)
		})
	}
}

func TestRoutes(t *testing.T) {
	s := startSim(t, Config{})
	tests := []struct {
		method, path string
		status       int
	}{
		{http.MethodGet, "/health", http.StatusOK},
		{http.MethodGet, "/v1/models", http.StatusOK},
		{http.MethodGet, "/sim/requests", http.StatusOK},
		{http.MethodGet, "/sim/state", http.StatusOK},
		{http.MethodGet, "/sim/kv/release", http.StatusMethodNotAllowed},
		{http.MethodPost, "/abort_request", http.StatusNotFound}, // SGLang's, not vLLM's
		{http.MethodGet, "/v1/chat/completions", http.StatusMethodNotAllowed},
		{http.MethodGet, "/nope", http.StatusNotFound},
	}
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.path, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), tt.method, "http://"+s.Addr()+tt.path, nil)
			require.NoError(t, err)
			r := do(t, req)
			require.Equal(t, s.Addr(), r.header.Get(HeaderEngine), "every response names its engine")
			if tt.status != http.StatusOK {
				r.errorMessage(t, tt.status)
				return
			}
			require.Equal(t, tt.status, r.status)
		})
	}

	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	require.NoError(t, json.Unmarshal(get(t, s, "/v1/models").body, &models))
	require.Equal(t, "list", models.Object)
	require.Equal(t, ModelName, models.Data[0].ID)
	require.Empty(t, s.Records(), "only inference requests and pulls are recorded")
}

func TestRecords(t *testing.T) {
	s := startSim(t, Config{Role: RoleDecode})
	// The raw body keeps integers beyond float64 precision and unknown fields.
	raw := []byte(`{ "model": "m", "prompt": "p", "max_tokens": 2, "x_big": 18446744073709551615, "x_unknown": {"a": [1, 2]} }`)
	post(t, s, "/v1/completions", "req-1", raw).decode(t)
	post(t, s, "/v1/chat/completions", "req-2", chatBody("x").with("model", nil))

	want := []Record{
		{RequestID: "req-1", Path: "/v1/completions", Headers: []string{"accept-encoding", "content-length", "content-type", "user-agent", "x-request-id"}, Kind: KindPlain, Fingerprint: Fingerprint("p"), KV: KVRecomputed, Status: 200,
			Body: json.RawMessage(`{"model":"m","prompt":"p","max_tokens":2,"x_big":18446744073709551615,"x_unknown":{"a":[1,2]}}`)},
		{RequestID: "req-2", Path: "/v1/chat/completions", Headers: []string{"accept-encoding", "content-length", "content-type", "user-agent", "x-request-id"}, Kind: KindRejected, Status: 400, Error: "model is required",
			Body: json.RawMessage(`{"messages":[{"content":"x","role":"user"}]}`)},
	}
	require.Equal(t, want, s.Records())

	var served []Record
	require.NoError(t, json.Unmarshal(get(t, s, "/sim/requests").body, &served))
	require.Len(t, served, 2)
	require.Equal(t, want[0].Body, served[0].Body)

	recs := s.Records()
	recs[0].Body[0] = 'X'
	require.Equal(t, want, s.Records(), "Records returns a copy")

	s.Reset()
	require.Empty(t, s.Records())
	require.Equal(t, "[]\n", string(get(t, s, "/sim/requests").body))
	post(t, s, "/v1/completions", "req-3", raw).decode(t)
	require.Equal(t, "req-3", lastRecord(t, s).RequestID)
}

func TestRecordsKeepArrivalOrder(t *testing.T) {
	s := startSim(t, Config{DecodePerToken: 20 * time.Millisecond})
	// A streams slowly; its first chunk proves it arrived before B is sent.
	a, _ := openStream(t, s, "a", chatBody("a").with("stream", true, "max_tokens", 10))
	post(t, s, "/v1/chat/completions", "b", chatBody("b").with("max_tokens", 1)).decode(t)
	require.Equal(t, []string{"b"}, requestIDs(s.Records()), "A is not recorded before it is decided")
	for a.Scan() {
	}
	require.NoError(t, a.Err())
	require.Equal(t, []string{"a", "b"}, requestIDs(s.Records()))
}

func requestIDs(recs []Record) []string {
	ids := make([]string, len(recs))
	for i, r := range recs {
		ids[i] = r.RequestID
	}
	return ids
}

// openStream sends a streaming request and, once the first event has
// arrived, returns a scanner over its lines and a hang-up function.
func openStream(t *testing.T, s *Server, requestID string, b body) (*bufio.Scanner, func()) {
	t.Helper()
	data, err := json.Marshal(b)
	require.NoError(t, err)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+pathFor(b), strings.NewReader(string(data)))
	require.NoError(t, err)
	req.Header.Set("X-Request-Id", requestID)
	resp, err := testClient(t).Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { resp.Body.Close() })
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	sc := bufio.NewScanner(resp.Body)
	require.True(t, sc.Scan())
	require.True(t, strings.HasPrefix(sc.Text(), "data: {"), sc.Text())
	return sc, func() { resp.Body.Close() }
}

func TestClientGoesAway(t *testing.T) {
	t.Run("during prefill", func(t *testing.T) {
		s := startSim(t, Config{PrefillLatency: time.Minute})
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		data, err := json.Marshal(chatBody("x").asPrefill())
		require.NoError(t, err)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+s.Addr()+"/v1/chat/completions", strings.NewReader(string(data)))
		require.NoError(t, err)
		req.Header.Set("X-Request-Id", "gone")
		_, err = testClient(t).Do(req)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		requireAbandoned(t, s, KindPrefill)
	})
	t.Run("mid-stream", func(t *testing.T) {
		s := startSim(t, Config{DecodePerToken: 10 * time.Millisecond})
		_, hangUp := openStream(t, s, "gone", chatBody("x").with("stream", true, "max_tokens", 1000))
		hangUp()
		requireAbandoned(t, s, KindPlain)
	})
}

func requireAbandoned(t *testing.T, s *Server, kind string) {
	t.Helper()
	require.Eventually(t, func() bool { return len(s.Records()) == 1 }, 5*time.Second, 5*time.Millisecond)
	rec := s.Records()[0]
	require.Equal(t, kind, rec.Kind)
	require.Equal(t, statusClientGone, rec.Status)
	require.Contains(t, rec.Error, "client went away")
}

func TestLatencies(t *testing.T) {
	s := startSim(t, Config{
		PrefillLatency: 40 * time.Millisecond, PrefillPerToken: time.Millisecond,
		DecodeLatency: 30 * time.Millisecond, DecodePerToken: 10 * time.Millisecond,
	})
	prompt := strings.Repeat("x", 40) // 10 tokens
	tests := []struct {
		name string
		rid  string
		body body
		min  time.Duration
	}{
		{"prefill", "p", completionBody(prompt).asPrefill(), 50 * time.Millisecond},
		{"plain", "", completionBody(prompt).with("max_tokens", 3), 50*time.Millisecond + 30*time.Millisecond + 20*time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			start := time.Now()
			post(t, s, "/v1/completions", tt.rid, tt.body).decode(t)
			require.GreaterOrEqual(t, time.Since(start), tt.min)
		})
	}
}

func TestStartConfig(t *testing.T) {
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"unknown role", Config{Role: "router"}, "unknown role"},
		{"negative latency", Config{DecodeLatency: -time.Second}, "DecodeLatency must not be negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Start(t.Context(), "127.0.0.1:0", tt.cfg)
			require.ErrorContains(t, err, tt.wantErr)
		})
	}
	_, err := Start(t.Context(), "127.0.0.1:bad", Config{})
	require.ErrorContains(t, err, "listen")

	s := startSim(t, Config{})
	require.Equal(t, RoleBoth, s.cfg.Role)
	require.Len(t, s.cfg.EngineID, 16)
	require.Equal(t, defaultKVTTL, s.cfg.KVTTL)
}

func TestStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	s, err := Start(ctx, "127.0.0.1:0", Config{})
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, get(t, s, "/health").status)
	cancel()
	require.Eventually(t, func() bool {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+s.Addr()+"/health", nil)
		require.NoError(t, err)
		resp, err := testClient(t).Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return err != nil
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, s.Close(), "Close after the context stopped the server is fine")
}

func TestFailStatus(t *testing.T) {
	s, err := Start(t.Context(), "127.0.0.1:0", Config{Role: RolePrefill, FailStatus: 503})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	resp, err := http.Post("http://"+s.Addr()+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"p"}`))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, 503, resp.StatusCode)
	recs := s.Records()
	require.Len(t, recs, 1)
	require.Equal(t, KindRejected, recs[0].Kind)
}

// TestKeepAlive: like uvicorn, the engine closes a connection that stays
// idle past its keep-alive, and keeps one whose next request comes in time.
func TestKeepAlive(t *testing.T) {
	const keepAlive = 300 * time.Millisecond
	s := startSim(t, Config{KeepAlive: keepAlive})
	conn, err := net.Dial("tcp", s.Addr())
	require.NoError(t, err)
	defer conn.Close()
	r := bufio.NewReader(conn)
	get := func() {
		t.Helper()
		_, err := fmt.Fprintf(conn, "GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
		require.NoError(t, err)
		resp, err := http.ReadResponse(r, nil)
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		require.Equal(t, http.StatusOK, resp.StatusCode)
	}
	get()
	time.Sleep(keepAlive / 3)
	get() // within the keep-alive: the same connection serves it

	start := time.Now()
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*keepAlive)))
	_, err = r.ReadByte()
	require.ErrorIs(t, err, io.EOF, "the engine closes the idle connection")
	require.GreaterOrEqual(t, time.Since(start), keepAlive*9/10, "not before its keep-alive")
}
