package connectors

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// rankedAnswer is answerFor from a vLLM prefill on the DP rank the call
// named: its NIXL side channel is the configured port plus the rank.
func rankedAnswer(ctx context.Context, c fakeengine.Call) ([]byte, error) {
	out, err := answerFor(ctx, c)
	if r, ok := c.Rank.Get(); ok && err == nil {
		out = []byte(strings.Replace(string(out), `"remote_port":21001`, fmt.Sprintf(`"remote_port":%d`, 21001+r), 1))
	}
	return out, err
}

func rankOf(r endpoint.Rank) int {
	n, ok := r.Get()
	if !ok {
		return -1
	}
	return n
}

// TestDPRanks checks what each connector tells the engines of the DP ranks
// pdx picked: vLLM's engines the X-data-parallel-rank header on pdx's
// prefill call and on the decode Envoy sends, SGLang's routed_dp_rank (and
// on the decode disagg_prefill_dp_rank) in the body; nothing without ranks,
// nothing to TensorRT-LLM; and never the client's own rank fields.
func TestDPRanks(t *testing.T) {
	// The rank fields a client might send: none may reach an engine.
	const client = `{"model":"m","prompt":"p","routed_dp_rank":3,"disagg_prefill_dp_rank":3,"data_parallel_rank":3}`
	type want struct {
		prefillHeader, decodeHeader int // -1: no header
		// SGLang body fields, -1: absent.
		prefillRouted, decodeRouted, decodePrefill int
	}
	header := want{prefillHeader: 1, decodeHeader: 2, prefillRouted: -1, decodeRouted: -1, decodePrefill: -1}
	nothing := want{-1, -1, -1, -1, -1}
	type row struct {
		connector string
		ranked    want // with ranks 1 (prefill) and 2 (decode)
	}
	cases := []row{
		{"nixl", header},
		{"mooncake", header},
		{"mooncake/nixl", header},
		{"mooncake/vllm", header},
		{"http", header},
		{"lmcache", header},
		{"p2p-nccl", nothing}, // config refuses dp_size there
		{"none", want{prefillHeader: -1, decodeHeader: 2, prefillRouted: -1, decodeRouted: -1, decodePrefill: -1}},
		{"sglang", want{prefillHeader: -1, decodeHeader: -1, prefillRouted: 1, decodeRouted: 2, decodePrefill: 1}},
		{"trtllm", nothing},
		{"trtllm/legacy", nothing},
	}
	for name := range variants() {
		require.True(t, slices.ContainsFunc(cases, func(r row) bool { return r.connector == name }), "TestDPRanks has no row for connector %s", name)
	}
	for _, tc := range cases {
		for _, ranked := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/ranked=%v", tc.connector, ranked), func(t *testing.T) {
				c := registered(t)[tc.connector]
				req := newRequest(t, client)
				req.Path = "/v1/completions"
				w := nothing
				if ranked {
					req.Prefill.DPSize, req.Decode.DPSize = 4, 4
					req.PrefillRank, req.DecodeRank = endpoint.RankOf(1), endpoint.RankOf(2)
					w = tc.ranked
				}
				// The Mooncake bootstrap server lists an engine per rank.
				query := `{"0":{"engine_id":"e-dp0","worker_addr":{}},"1":{"engine_id":"e-dp1","worker_addr":{}}}`
				eng := fakeengine.New().
					On(http.MethodPost, req.Prefill.Address, "/v1/completions", fakeengine.Reply{Fn: rankedAnswer}).
					On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: query})
				d, err := c.Prepare(t.Context(), Env{Engine: eng}, req)
				require.NoError(t, err)
				if d.Prefill != nil {
					require.NoError(t, prefillOutcome(t, d.Prefill))
				}
				require.Equal(t, w.decodeHeader, rankOf(d.Decode.Rank), "the decode's X-data-parallel-rank")
				var prefill *fakeengine.Call
				for _, call := range eng.Calls() {
					if call.Method == http.MethodPost {
						prefill = &call
					}
				}
				legs := []string{string(d.Decode.Body)}
				if prefill != nil {
					require.Equal(t, w.prefillHeader, rankOf(prefill.Rank), "the prefill's X-data-parallel-rank")
					legs = append(legs, prefill.Body)
				}
				field := func(body, key string) int {
					obj, err := jsonedit.Parse([]byte(body))
					require.NoError(t, err)
					raw, ok := obj.Raw(key)
					if !ok {
						return -1
					}
					var n int
					_, err = fmt.Sscan(string(raw), &n)
					require.NoError(t, err, "%s is %s", key, raw)
					return n
				}
				for _, leg := range legs {
					require.Equal(t, -1, field(leg, "data_parallel_rank"), "the client's data_parallel_rank")
				}
				require.Equal(t, w.decodeRouted, field(string(d.Decode.Body), "routed_dp_rank"))
				require.Equal(t, w.decodePrefill, field(string(d.Decode.Body), "disagg_prefill_dp_rank"))
				if prefill != nil {
					require.Equal(t, w.prefillRouted, field(prefill.Body, "routed_dp_rank"))
					require.Equal(t, -1, field(prefill.Body, "disagg_prefill_dp_rank"))
				}
				if tc.connector == "mooncake/vllm" {
					want := `"remote_engine_id":"e-dp0"`
					if ranked {
						want = `"remote_engine_id":"e-dp1"`
					}
					require.Contains(t, string(d.Decode.Body), want, "the decode pulls from the prefill rank's engine")
				}
				if tc.connector == "sglang" && ranked {
					room := field(string(d.Decode.Body), "bootstrap_room")
					require.Equal(t, 1, room%4, "the room is aligned on the prefill's rank")
				}
			})
		}
	}
}

func TestAlignRoom(t *testing.T) {
	const maxRoom = 1<<63 - 1
	for _, tc := range []struct {
		name       string
		room       uint64
		size, rank int
		want       uint64
	}{
		{"no rank", 12345, 4, -1, 12345},
		{"no dp", 12345, 1, 0, 12345},
		{"down to the rank", 12347, 4, 1, 12345},
		{"up to the rank", 12344, 4, 3, 12347},
		{"already aligned", 12346, 4, 2, 12346},
		{"zero", 0, 8, 7, 7},
		// 2^63-1 is 3 mod 4: rank 3 keeps it.
		{"top, aligned", maxRoom, 4, 3, maxRoom},
		// 2^63-1 (…807) is 7 mod 10: rank 9 of its block would be …809,
		// over the range, so it is taken from the block before.
		{"top, over the range", maxRoom, 10, 9, maxRoom - 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rank := endpoint.Rank{}
			if tc.rank >= 0 {
				rank = endpoint.RankOf(tc.rank)
			}
			got := alignRoom(tc.room, tc.size, rank)
			require.Equal(t, tc.want, got)
			require.LessOrEqual(t, got, uint64(maxRoom))
			if tc.rank >= 0 && tc.size > 1 {
				require.Equal(t, uint64(tc.rank), got%uint64(tc.size))
			}
		})
	}
}
