package enginesim

import (
	"encoding/json"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// prefill runs a correct prefill of b on p and returns the kv_transfer_params
// it issued.
func prefill(t *testing.T, p *Server, requestID string, b body) map[string]any {
	t.Helper()
	resp := post(t, p, pathFor(b), requestID, b.asPrefill()).decode(t)
	var kv map[string]any
	require.NoError(t, json.Unmarshal(resp.KVTransferParams, &kv), "kv_transfer_params: %s", resp.KVTransferParams)
	require.NotNil(t, kv)
	return kv
}

func pathFor(b body) string {
	if _, ok := b["messages"]; ok {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

func TestNixlHandoff(t *testing.T) {
	tests := []struct {
		name       string
		body       body
		sameEngine bool // one engine in role both does prefill and decode
	}{
		{name: "chat", body: chatBody("Tell me about KV caches.")},
		{name: "completions", body: completionBody("Once upon a time")},
		{name: "chat on one engine in role both", body: chatBody("hello"), sameEngine: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, EngineID: "prefill-engine"})
			d := startSim(t, Config{Role: RoleDecode})
			if tt.sameEngine {
				p = startSim(t, Config{Role: RoleBoth, EngineID: "prefill-engine"})
				d = p
			}
			path := pathFor(tt.body)
			prompt := promptOf(t, tt.body)
			fp := Fingerprint(prompt)

			pr := post(t, p, path, "req-1", tt.body.asPrefill())
			require.Equal(t, p.Addr(), pr.header.Get(HeaderEngine))
			require.Empty(t, pr.header.Get(HeaderKV), "a prefill reports no KV source")
			presp := pr.decode(t)
			require.Equal(t, "pdx-sim:"+fp, presp.text())
			require.Equal(t, "length", presp.Choices[0].FinishReason)
			require.Equal(t, 1, presp.Usage.CompletionTokens)

			var kv map[string]any
			require.NoError(t, json.Unmarshal(presp.KVTransferParams, &kv))
			_, port, err := net.SplitHostPort(p.Addr())
			require.NoError(t, err)
			require.Equal(t, true, kv["do_remote_prefill"])
			require.Equal(t, false, kv["do_remote_decode"])
			require.Equal(t, "prefill-engine", kv["remote_engine_id"])
			require.Equal(t, "127.0.0.1", kv["remote_host"])
			require.Equal(t, port, strconv.Itoa(int(kv["remote_port"].(float64))))
			require.EqualValues(t, 1, kv["tp_size"])
			require.NotEmpty(t, kv["remote_request_id"])
			// vLLM 0.32's members (e2e/realvllm compares the two answers).
			require.ElementsMatch(t, []string{"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
				"remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
				"remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"}, slices.Collect(maps.Keys(kv)))
			require.EqualValues(t, presp.Usage.PromptTokens, kv["remote_num_tokens"])
			require.Equal(t, "pull", kv["transfer_mode"])
			require.Nil(t, kv["remote_blocks_expiry_time"])
			blocks := kv["remote_block_ids"].([]any)
			require.Len(t, blocks, 1)
			require.NotEmpty(t, blocks[0])

			dr := post(t, d, path, "req-1", tt.body.with("max_tokens", 3, "kv_transfer_params", kv))
			require.Equal(t, d.Addr(), dr.header.Get(HeaderEngine))
			require.Equal(t, KVPulled, dr.header.Get(HeaderKV))
			require.Equal(t, p.Addr(), dr.header.Get(HeaderKVSource))
			dresp := dr.decode(t)
			require.Equal(t, "pdx-sim:"+fp+" t1 t2", dresp.text())
			require.Equal(t, 3, dresp.Usage.CompletionTokens)

			wantPrefill := Record{RequestID: "req-1", Path: path, Kind: KindPrefill, Fingerprint: fp, Status: 200}
			wantDecode := Record{RequestID: "req-1", Path: path, Kind: KindDecode, Fingerprint: fp, Status: 200,
				KV: KVPulled, KVSource: p.Addr()}
			wantPull := Record{RequestID: "req-1", Path: "/sim/kv/pull", Kind: KindKVPull, Fingerprint: fp, Status: 200}
			if tt.sameEngine {
				requireRecords(t, p, wantPrefill, wantDecode, wantPull)
				return
			}
			requireRecords(t, p, wantPrefill, wantPull)
			requireRecords(t, d, wantDecode)
		})
	}
}

// requireRecords compares records without their bodies.
func requireRecords(t *testing.T, s *Server, want ...Record) {
	t.Helper()
	got := s.Records()
	for i := range got {
		require.NotEmpty(t, got[i].Body)
		got[i].Body, got[i].Headers = nil, nil // the client's headers vary
	}
	require.Equal(t, want, got)
}

func promptOf(t *testing.T, b body) string {
	t.Helper()
	data, err := json.Marshal(b)
	require.NoError(t, err)
	a := apiCompletions
	if _, ok := b["messages"]; ok {
		a = apiChat
	}
	req, err := parseRequest(a, dialectVLLM, data)
	require.NoError(t, err)
	return req.prompt
}

func TestNixlDecodeRejections(t *testing.T) {
	const prompt = "What is disaggregated serving?"
	tests := []struct {
		name string
		// decode returns the request id and body of the decode, given the
		// kv_transfer_params of a prefill of prompt with request id "req-1".
		decode  func(t *testing.T, d *Server, kv map[string]any) (string, body)
		wantMsg string
	}{
		{
			name: "same KV pulled twice",
			decode: func(t *testing.T, d *Server, kv map[string]any) (string, body) {
				b := chatBody(prompt).with("kv_transfer_params", kv)
				post(t, d, "/v1/chat/completions", "req-1", b).decode(t)
				return "req-1", b
			},
			wantMsg: "failed with 409",
		},
		{
			name: "different prompt",
			decode: func(_ *testing.T, _ *Server, kv map[string]any) (string, body) {
				return "req-1", chatBody("another prompt").with("kv_transfer_params", kv)
			},
			wantMsg: "KV blocks hold a different prompt: pulled KV has prompt fingerprint " + Fingerprint(ChatPromptText([]Message{{Role: "user", Content: prompt}})),
		},
		{
			name: "wrong request id",
			decode: func(_ *testing.T, _ *Server, kv map[string]any) (string, body) {
				return "req-2", chatBody(prompt).with("kv_transfer_params", kv)
			},
			wantMsg: `prefilled for X-Request-Id "req-1", this decode is "req-2"`,
		},
		{
			name: "missing request id",
			decode: func(_ *testing.T, _ *Server, kv map[string]any) (string, body) {
				return "", chatBody(prompt).with("kv_transfer_params", kv)
			},
			wantMsg: "missing X-Request-Id",
		},
		{
			name:    "unknown blocks",
			decode:  withKV("remote_request_id", "no-such-request"),
			wantMsg: "failed with 404",
		},
		{
			name:    "tampered block ids",
			decode:  withKV("remote_block_ids", [][]int{{999}}),
			wantMsg: "remote_block_ids mismatch",
		},
		{
			name:    "flat block ids",
			decode:  withKV("remote_block_ids", []int{1}),
			wantMsg: "remote_block_ids mismatch",
		},
		{
			name:    "wrong engine id",
			decode:  withKV("remote_engine_id", "someone-else"),
			wantMsg: `remote_engine_id mismatch: KV was requested from engine "someone-else"`,
		},
		{
			name:    "missing remote host",
			decode:  withKV("remote_host", nil),
			wantMsg: "missing remote_host",
		},
		{
			name:    "source not listening",
			decode:  withKV("remote_port", closedPort(t)),
			wantMsg: "KV pull from 127.0.0.1:",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill})
			d := startSim(t, Config{Role: RoleDecode})
			kv := prefill(t, p, "req-1", chatBody(prompt))
			rid, b := tt.decode(t, d, kv)

			r := post(t, d, "/v1/chat/completions", rid, b)
			require.Contains(t, r.errorMessage(t, http.StatusBadRequest), tt.wantMsg)
			require.Empty(t, r.header.Get(HeaderKV))
			rec := lastRecord(t, d)
			require.Equal(t, KindRejected, rec.Kind)
			require.Equal(t, http.StatusBadRequest, rec.Status)
			require.Contains(t, rec.Error, tt.wantMsg)
			require.Empty(t, rec.KV)
		})
	}
}

// withKV makes a decode of the prefilled prompt with one kv_transfer_params
// field changed (nil deletes it).
func withKV(key string, value any) func(*testing.T, *Server, map[string]any) (string, body) {
	return func(_ *testing.T, _ *Server, kv map[string]any) (string, body) {
		changed := body(kv).with(key, value)
		return "req-1", chatBody("What is disaggregated serving?").with("kv_transfer_params", map[string]any(changed))
	}
}

// closedPort is a loopback port nobody listens on (at least right now).
func closedPort(t *testing.T) int {
	t.Helper()
	return loopback.FreePort(t)
}

func TestNixlPrefillDerivationErrors(t *testing.T) {
	good := chatBody("hi").asPrefill()
	goodKV := good["kv_transfer_params"].(map[string]any)
	tests := []struct {
		name      string
		role      Role
		path      string
		requestID string
		body      body
		wantMsg   string
	}{
		// vLLM's own check (SamplingParams._verify_args), not a prefill rule.
		{name: "min_tokens above the limit", body: good.with("min_tokens", 2), wantMsg: "min_tokens must be less than or equal to max_tokens=1, got 2."},
		{name: "stream_options without stream", body: good.with("stream_options", map[string]any{"include_usage": true}),
			wantMsg: "Stream options can only be defined when `stream=True`."},
		{name: "missing request id", requestID: "-", body: good, wantMsg: "missing X-Request-Id"},
		{name: "remote fields set", body: good.with("kv_transfer_params", map[string]any(body(goodKV).with("remote_host", "127.0.0.1"))),
			wantMsg: "kv_transfer_params.remote_host must be null"},
		{name: "both directions", body: good.with("kv_transfer_params", map[string]any(body(goodKV).with("do_remote_prefill", true))),
			wantMsg: "sets both do_remote_decode and do_remote_prefill"},
		{name: "decode role", role: RoleDecode, body: good, wantMsg: "engine is a KV consumer"},
		{name: "prefill role gets decode", role: RolePrefill,
			body:    chatBody("hi").with("kv_transfer_params", map[string]any{"do_remote_prefill": true}),
			wantMsg: "engine is a KV producer"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			role, path, rid := tt.role, tt.path, tt.requestID
			if role == "" {
				role = RoleBoth
			}
			if path == "" {
				path = "/v1/chat/completions"
			}
			switch rid {
			case "":
				rid = "req-1"
			case "-":
				rid = ""
			}
			s := startSim(t, Config{Role: role})
			r := post(t, s, path, rid, tt.body)
			require.Contains(t, r.errorMessage(t, http.StatusBadRequest), tt.wantMsg)
			rec := lastRecord(t, s)
			require.Equal(t, KindRejected, rec.Kind)
			require.Contains(t, rec.Error, tt.wantMsg)
		})
	}
}

// TestNixlPrefillAsVLLM: what a router's prefill-only edits leave out
// (stream false, the limit 1) vLLM does not refuse. A prefill generates up
// to its limit and, finished by length, hands off its KV
// (NixlConnectorScheduler.request_finished checks only
// FINISHED_LENGTH_CAPPED); a streamed one streams, and its chunks carry no
// kv_transfer_params (chat_completion_stream_generator), so its KV stays
// held until KVTTL. The engine counts both (Tally, State).
func TestNixlPrefillAsVLLM(t *testing.T) {
	good := chatBody("hi").asPrefill()
	tests := []struct {
		name   string
		body   body
		tokens int
		stream bool // else the answer carries kv_transfer_params
	}{
		{name: "limit 7", body: good.with("max_tokens", 7), tokens: 7},
		{name: "limit missing: the simulator's chat default", body: good.with("max_tokens", nil), tokens: defaultMaxTokens},
		{name: "max_completion_tokens read before max_tokens", body: good.with("max_completion_tokens", 5), tokens: 5},
		{name: "completions read only max_tokens", body: completionBody("hi").asPrefill().with("max_tokens", nil, "max_completion_tokens", 1),
			tokens: 16},
		{name: "min_completion_tokens is not vLLM's", body: good.with("min_completion_tokens", 3), tokens: 1},
		{name: "streamed", body: good.with("stream", true), tokens: 1, stream: true},
		{name: "streamed with usage, limit 3", body: good.with("stream", true, "stream_options", map[string]any{"include_usage": true}, "max_tokens", 3),
			tokens: 3, stream: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill})
			d := startSim(t, Config{Role: RoleDecode})
			r := post(t, p, pathFor(tt.body), "req-1", tt.body)
			want := outputTokens(Fingerprint(promptOf(t, tt.body)), tt.tokens)
			rec := lastRecord(t, p)
			require.Equal(t, KindPrefill, rec.Kind)
			require.Equal(t, http.StatusOK, rec.Status)
			require.Equal(t, Tally{LongPrefill: b2i(tt.tokens > 1), StreamedPrefill: b2i(tt.stream)}, p.Tally())
			st := p.State()
			require.Equal(t, b2i(tt.tokens > 1), st.LongPrefills)
			require.Equal(t, b2i(tt.stream), st.StreamedPrefills)
			require.Equal(t, 1, st.HeldKV, "length capped: the blocks are held for a decode")
			if tt.stream {
				text, finish := sseText(t, r)
				require.Equal(t, strings.Join(want, ""), text)
				require.Equal(t, "length", finish)
				require.NotContains(t, string(r.body), "kv_transfer_params", "vLLM's chunks have no kv_transfer_params")
				return
			}
			resp := r.decode(t)
			require.Equal(t, strings.Join(want, ""), resp.text())
			require.Equal(t, "length", resp.Choices[0].FinishReason)
			require.Equal(t, tt.tokens, resp.Usage.CompletionTokens)
			var kv map[string]any
			require.NoError(t, json.Unmarshal(resp.KVTransferParams, &kv))
			require.Equal(t, true, kv["do_remote_prefill"])
			// The KV is the prompt's: the decode of the client's body pulls it.
			client := tt.body.with("kv_transfer_params", kv, "max_tokens", 2, "max_completion_tokens", nil, "stream", nil)
			requireDecodePulled(t, d, p, post(t, d, pathFor(client), "req-1", client), client, false,
				strings.Join(want[:1], "")+" t1")
		})
	}
	t.Run("streamed prefill's KV expires unpulled; the decode recomputes", func(t *testing.T) {
		p := startSim(t, Config{Role: RolePrefill, KVTTL: 20 * time.Millisecond})
		d := startSim(t, Config{Role: RoleDecode})
		sseText(t, post(t, p, "/v1/chat/completions", "req-1", good.with("stream", true)))
		// A router left with no params sends the decode none.
		r := post(t, d, "/v1/chat/completions", "req-1", chatBody("hi").with("max_tokens", 2))
		require.Equal(t, KVRecomputed, r.header.Get(HeaderKV))
		require.Equal(t, KindPlain, lastRecord(t, d).Kind)
		require.Eventually(t, func() bool { return p.State().KVExpired == 1 }, 5*time.Second, 5*time.Millisecond)
		require.Zero(t, p.State().HeldKV)
	})
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestNixlPrefillFinishedOnEOS: a prefill whose model emits EOS finishes
// with "stop", and request_finished hands nothing off: kv_transfer_params
// is null. EOS comes at the first position min_tokens allows, and never
// with ignore_eos, so vllm-router's min_tokens 1 with max_tokens 1 always
// ends by length and hands off.
func TestNixlPrefillFinishedOnEOS(t *testing.T) {
	tests := []struct {
		name   string
		body   body
		tokens int
		finish string
	}{
		{name: "chat", body: chatBody("say nothing [sim:eos]").asPrefill(), tokens: 1, finish: "stop"},
		{name: "completions", body: completionBody("[sim:eos]").asPrefill(), tokens: 1, finish: "stop"},
		{name: "min_tokens 1 holds EOS back past the limit", body: chatBody("[sim:eos]").asPrefill().with("min_tokens", 1), tokens: 1, finish: "length"},
		{name: "min_tokens 1, limit 3: EOS second", body: chatBody("[sim:eos]").asPrefill().with("min_tokens", 1, "max_tokens", 3), tokens: 2, finish: "stop"},
		{name: "ignore_eos", body: chatBody("[sim:eos]").asPrefill().with("ignore_eos", true, "max_tokens", 3), tokens: 3, finish: "length"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := startSim(t, Config{Role: RolePrefill})
			resp := post(t, s, pathFor(tt.body), "req-1", tt.body).decode(t)
			require.Equal(t, tt.finish, resp.Choices[0].FinishReason)
			require.Equal(t, tt.tokens, resp.Usage.CompletionTokens)
			require.Equal(t, strings.Join(outputTokens(Fingerprint(promptOf(t, tt.body)), tt.tokens), ""), resp.text())
			require.Equal(t, KindPrefill, lastRecord(t, s).Kind)
			if tt.finish == "stop" {
				require.Equal(t, "null", string(resp.KVTransferParams), "kv_transfer_params must be present and null")
				require.Zero(t, s.HeldKV())
				return
			}
			require.NotEqual(t, "null", string(resp.KVTransferParams))
			require.Equal(t, 1, s.HeldKV())
		})
	}
}

func TestNixlExpiredKV(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, KVTTL: 20 * time.Millisecond})
	d := startSim(t, Config{Role: RoleDecode})
	kv := prefill(t, p, "req-1", chatBody("hi"))
	time.Sleep(50 * time.Millisecond)
	r := post(t, d, "/v1/chat/completions", "req-1", chatBody("hi").with("kv_transfer_params", kv))
	require.Contains(t, r.errorMessage(t, http.StatusBadRequest), "unknown or expired")
}

func TestKVStoreSweepsOnAllocate(t *testing.T) {
	k := newKVStore(time.Minute)
	now := time.Now()
	id1, b1 := k.allocate("fp1", "r1", 0, 40, now)
	id2, b2 := k.allocate("fp2", "r2", 0, 1, now.Add(30*time.Second))
	require.NotEqual(t, id1, id2)
	require.Equal(t, [][]int{{1, 2, 3}}, b1, "40 tokens fill three 16-token blocks")
	require.Equal(t, [][]int{{4}}, b2, "block ids are never reused")
	k.allocate("fp3", "r3", 0, 1, now.Add(90*time.Second))
	require.Len(t, k.entries, 2, "the first entry expired and was swept")
	require.NotContains(t, k.entries, id1)
}

func TestLoopbackOnly(t *testing.T) {
	tests := []struct {
		addr string
		ok   bool
	}{
		{"127.0.0.1:8000", true},
		{"127.1.2.3:8000", true},
		{"[::1]:8000", true},
		{"10.0.0.1:8000", false},
		{"[2001:db8::1]:8000", false},
	}
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			err := loopbackOnly("tcp", tt.addr, nil)
			if tt.ok {
				require.NoError(t, err)
			} else {
				require.ErrorContains(t, err, "non-loopback")
			}
		})
	}
}

func TestTallyOnly(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, TallyOnly: true})
	d := startSim(t, Config{Role: RoleDecode, TallyOnly: true})
	b := completionBody("Once upon a time")
	var kv map[string]any
	require.NoError(t, json.Unmarshal(post(t, p, "/v1/completions", "req-1", b.asPrefill()).decode(t).KVTransferParams, &kv))
	require.Equal(t, KVPulled, post(t, d, "/v1/completions", "req-1", b.with("kv_transfer_params", kv)).header.Get(HeaderKV))
	post(t, d, "/v1/completions", "req-2", b)
	post(t, d, "/v1/completions", "req-3", b.with("kv_transfer_params", kv)) // pulled already: refused

	require.Empty(t, p.Records())
	require.Empty(t, d.Records())
	require.Equal(t, Tally{Prefill: 1, KVPull: 2, Rejected: 1}, p.Tally())
	require.Equal(t, Tally{Decode: 1, Plain: 1, Pulled: 1, Rejected: 1}, d.Tally())
}
