package enginesim

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// postRanked is post with vLLM's X-data-parallel-rank header, when rank is
// not empty.
func postRanked(t *testing.T, s *Server, path, requestID, rank string, b any) reply {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+path, bytes.NewReader(marshal(t, b)))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", requestID)
	if rank != "" {
		req.Header.Set(HeaderDPRank, rank)
	}
	return do(t, req)
}

// TestDPRankNamed checks how engines read the rank a router names, and
// refuse one out of range as vLLM (InputProcessor.process_inputs) and
// SGLang (TokenizerManager) do; a request naming none is served, on a rank
// the engine picks.
func TestDPRankNamed(t *testing.T) {
	for _, tc := range []struct {
		name      string
		connector string
		dpSize    int
		header    string // vLLM
		field     any    // SGLang's routed_dp_rank
		wantRank  int
		wantNamed bool
		wantError string // 400
	}{
		{name: "vllm rank 3 of 4", connector: ConnectorNIXL, dpSize: 4, header: "3", wantRank: 3, wantNamed: true},
		{name: "vllm rank out of range", connector: ConnectorNIXL, dpSize: 4, header: "4", wantError: "data_parallel_rank 4 is out of range [0, 4)."},
		{name: "vllm negative rank", connector: ConnectorNIXL, dpSize: 4, header: "-1", wantError: "data_parallel_rank -1 is out of range [0, 4)."},
		{name: "vllm rank 1 of an engine without dp", connector: ConnectorNIXL, header: "1", wantError: "data_parallel_rank 1 is out of range [0, 1)."},
		{name: "vllm rank 0 of an engine without dp", connector: ConnectorNIXL, header: "0", wantRank: 0, wantNamed: true},
		{name: "vllm ignores a rank that is no integer", connector: ConnectorNIXL, dpSize: 4, header: "two", wantRank: 1},
		{name: "vllm without a rank", connector: ConnectorNIXL, dpSize: 4, wantRank: 1},
		{name: "sglang rank 1 of 2", connector: ConnectorSGLang, dpSize: 2, field: 1, wantRank: 1, wantNamed: true},
		{name: "sglang rank out of range", connector: ConnectorSGLang, dpSize: 2, field: 2, wantError: "routed_dp_rank=2 out of range [0, 2)"},
		{name: "sglang rank 0 without dp is ignored", connector: ConnectorSGLang, field: 0, wantRank: 0},
		{name: "sglang rank 1 without dp", connector: ConnectorSGLang, field: 1, wantError: "routed_dp_rank=1 out of range [0, 1)"},
		{name: "sglang without a rank", connector: ConnectorSGLang, dpSize: 2, wantRank: 1},
		{name: "trtllm takes no rank", connector: ConnectorTRTLLM, dpSize: 2, header: "7", field: 7, wantRank: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startSim(t, Config{Connector: tc.connector, DPSize: tc.dpSize})
			b := completionBody("hello")
			if tc.field != nil {
				b = b.with("routed_dp_rank", tc.field)
			}
			r := postRanked(t, s, "/v1/completions", "req-1", tc.header, b)
			rec := lastRecord(t, s)
			if tc.wantError != "" {
				require.Equal(t, tc.wantError, r.errorMessage(t, http.StatusBadRequest))
				require.Equal(t, KindRejected, rec.Kind)
				return
			}
			r.decode(t)
			require.Equal(t, KindPlain, rec.Kind)
			require.Equal(t, tc.wantRank, rec.DPRank)
			require.Equal(t, tc.wantNamed, rec.DPRankNamed)
		})
	}
}

// TestDPRankBalancedByTheEngine: requests that name no rank are spread
// over the engine's ranks (SGLang's deprecated data_parallel_rank is still
// read).
func TestDPRankBalancedByTheEngine(t *testing.T) {
	s := startSim(t, Config{Connector: ConnectorSGLang, DPSize: 3})
	var got []int
	for range 4 {
		post(t, s, "/v1/completions", "r", completionBody("x")).decode(t)
		got = append(got, lastRecord(t, s).DPRank)
	}
	require.Equal(t, []int{1, 2, 0, 1}, got)
	post(t, s, "/v1/completions", "r", completionBody("x").with("data_parallel_rank", 2)).decode(t)
	require.Equal(t, 2, lastRecord(t, s).DPRank)
}

// TestNIXLRankEngineID: a prefill on DP rank r names engine
// "<engine id>_dp<r>", as vLLM's data-parallel engine cores do; a decode
// pulls from that rank's engine only.
func TestNIXLRankEngineID(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, EngineID: "pe", DPSize: 2})
	d := startSim(t, Config{Role: RoleDecode})
	client := completionBody("ranked prompt").with("max_tokens", 3)
	for _, tc := range []struct {
		name      string
		engineID  func(issued string) string
		wantError string
	}{
		{name: "the rank's engine", engineID: func(issued string) string { return issued }},
		{name: "another rank's engine", engineID: func(string) string { return "pe_dp0" },
			wantError: `KV pull from ` + p.Addr() + ` failed with 404: no KV for remote_request_id`},
		{name: "a rank the engine lacks", engineID: func(string) string { return "pe_dp2" },
			wantError: `KV pull from ` + p.Addr() + ` failed with 400: remote_engine_id mismatch: KV was requested from engine "pe_dp2" but this engine is "pe_dp0" to "pe_dp1"`},
		{name: "the engine without a rank", engineID: func(string) string { return "pe" },
			wantError: `remote_engine_id mismatch: KV was requested from engine "pe"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pr := postRanked(t, p, "/v1/completions", "req-"+tc.name, "1", client.asPrefill()).decode(t)
			require.Equal(t, 1, lastRecord(t, p).DPRank)
			var params map[string]any
			require.NoError(t, json.Unmarshal(pr.KVTransferParams, &params))
			require.Equal(t, "pe_dp1", params["remote_engine_id"])
			params["remote_engine_id"] = tc.engineID("pe_dp1")
			r := post(t, d, "/v1/completions", "req-"+tc.name, client.with("kv_transfer_params", params))
			if tc.wantError != "" {
				require.Contains(t, r.errorMessage(t, http.StatusBadRequest), tc.wantError)
				return
			}
			r.decode(t)
			rec := lastKind(t, d, KindDecode)
			require.Equal(t, KVPulled, rec.KV)
			require.Equal(t, 1, rec.KVSourceRank)
		})
	}
}

// TestSGLangPrefillRank: a decode told the prefill's DP rank
// (disagg_prefill_dp_rank) takes the room's KV from that rank's bootstrap
// registration; told another, it waits there for KV that never comes and
// fails like SGLang's receiver; told none, it asks which rank has the room.
func TestSGLangPrefillRank(t *testing.T) {
	for _, tc := range []struct {
		name     string
		told     any // disagg_prefill_dp_rank; nil: absent
		wantFail bool
	}{
		{name: "the prefill's rank", told: 1},
		{name: "another rank", told: 0, wantFail: true},
		{name: "a rank the prefill lacks", told: 5, wantFail: true},
		{name: "none", told: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang, DPSize: 2})
			d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorSGLang, DPSize: 2, KVWaitTimeout: 200 * time.Millisecond})
			b := withRoom(completionBody("ranked room").with("max_tokens", 3), p, 42)
			pc := goPost(t, p, "/v1/completions", "req-1", b.with("routed_dp_rank", 1))
			decode := b.with("routed_dp_rank", 0)
			if tc.told != nil {
				decode = decode.with("disagg_prefill_dp_rank", tc.told)
			}
			dr := post(t, d, "/v1/completions", "req-1", decode)
			await(t, pc).decode(t)
			require.Equal(t, 1, lastKind(t, p, KindPrefill).DPRank)
			if tc.wantFail {
				msg := dr.errorMessage(t, http.StatusInternalServerError)
				require.Contains(t, msg, "timed out after 0.2s in KVPoll.WaitingForInput")
				require.Contains(t, msg, "for prefill DP rank "+strconv.Itoa(tc.told.(int)))
				return
			}
			dr.decode(t)
			rec := lastKind(t, d, KindDecode)
			require.Equal(t, KVPulled, rec.KV)
			require.Equal(t, 0, rec.DPRank, "the decode's own rank")
			require.Equal(t, 1, rec.KVSourceRank, "the prefill's rank")
		})
	}
}

// TestMooncakeRankEngines: upstream Mooncake's bootstrap server lists an
// engine per DP rank; a decode gets the transfer only from the engine of
// the rank its prefill ran on, and waits in vain at another.
func TestMooncakeRankEngines(t *testing.T) {
	for _, tc := range []struct {
		name     string
		engine   string
		wantFail string
	}{
		{name: "the prefill rank's engine", engine: "mc-prefill_dp1"},
		{name: "another rank's engine", engine: "mc-prefill_dp0", wantFail: "no prefill registered KV"},
		{name: "an engine the server does not list", engine: "mc-prefill", wantFail: "remote_engine_id mismatch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, d := mooncakePair(t, Config{DPSize: 2}, 200*time.Millisecond)
			req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://127.0.0.1:"+strconv.Itoa(p.BootstrapPort())+"/query", nil)
			require.NoError(t, err)
			var engines map[string]mooncakeEngine
			require.NoError(t, json.Unmarshal(do(t, req).body, &engines))
			require.Equal(t, "mc-prefill_dp0", engines["0"].EngineID)
			require.Equal(t, "mc-prefill_dp1", engines["1"].EngineID)

			client := completionBody("mooncake ranks").with("max_tokens", 3)
			postRanked(t, p, "/v1/completions", "req-1", "1", mooncakePrefill(client, "req-1")).decode(t)
			r := post(t, d, "/v1/completions", "req-1", mooncakeDecodeWith(client, p, "req-1", "remote_engine_id", tc.engine))
			if tc.wantFail != "" {
				require.GreaterOrEqual(t, r.status, 400, "body: %s", r.body)
				require.Contains(t, string(r.body), tc.wantFail)
				return
			}
			r.decode(t)
			rec := lastKind(t, d, KindDecode)
			require.Equal(t, KVPulled, rec.KV)
			require.Equal(t, 1, rec.KVSourceRank)
		})
	}
}
