package replay

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestParseTrace(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		limit int
		want  []TraceRequest
		err   string
	}{
		{name: "two lines, a blank one", in: `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}

{"timestamp": 30, "input_length": 100, "output_length": 0, "hash_ids": [7]}
`, want: []TraceRequest{
			{Timestamp: 0, InputLength: 600, OutputLength: 5, HashIDs: []int64{0, 1}},
			{Timestamp: 30, InputLength: 100, OutputLength: 0, HashIDs: []int64{7}},
		}},
		{name: "limit", limit: 1, in: `{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}
{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [1]}`,
			want: []TraceRequest{{InputLength: 1, OutputLength: 1, HashIDs: []int64{0}}}},
		{name: "not JSON", in: "{nope", err: "line 1"},
		{name: "too few blocks", in: `{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}`, err: "fewer than input_length"},
		{name: "no blocks", in: `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}`, err: "no hash_ids"},
		{name: "negative time", in: `{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}`, err: "negative timestamp"},
		{name: "empty", in: "\n", err: "no requests"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseTrace(strings.NewReader(tc.in), tc.limit)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestScaleTokens(t *testing.T) {
	s := Scale{TokenScale: 16}
	for _, tc := range []struct{ real, want int }{{0, 1}, {1, 1}, {16, 1}, {17, 2}, {512, 32}, {12035, 753}} {
		require.Equal(t, tc.want, s.Tokens(tc.real), "%d real tokens", tc.real)
	}
	require.Equal(t, 128, s.BlockBytes(), "a 512-token block is 32 tokens of 4 bytes")
	_, err := Scale{TokenScale: 3}.Requests([]TraceRequest{{InputLength: 1, HashIDs: []int64{0}}})
	require.ErrorContains(t, err, "must divide")
	_, err = Scale{TokenScale: 256}.Requests([]TraceRequest{{InputLength: 1, HashIDs: []int64{0}}})
	require.ErrorContains(t, err, "8-byte blocks")
}

// TestPrompt checks the synthesized prompts: scaled length, equal ids give
// equal prefixes, different ids different text from the first differing
// block on.
func TestPrompt(t *testing.T) {
	s := Scale{TokenScale: 16}
	bb := s.BlockBytes()
	req := func(input int, ids ...int64) TraceRequest {
		return TraceRequest{InputLength: input, OutputLength: 3, HashIDs: ids}
	}
	tests := []struct {
		name   string
		a, b   TraceRequest
		common int // bytes the two prompts share at their start
	}{
		{name: "same ids, same length", a: req(1024, 0, 1), b: req(1024, 0, 1), common: 2 * bb},
		{name: "shared first block", a: req(1024, 0, 1), b: req(1024, 0, 2), common: bb},
		{name: "shared two blocks, one longer", a: req(1200, 0, 1, 2), b: req(1536, 0, 1, 3), common: 2 * bb},
		{name: "nothing shared", a: req(1024, 5, 1), b: req(1024, 6, 1), common: 0},
		{name: "prefix of the other", a: req(512, 0), b: req(1536, 0, 1, 2), common: bb},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pa, pb := s.Prompt(tc.a), s.Prompt(tc.b)
			require.Len(t, pa, s.Tokens(tc.a.InputLength)*bytesPerToken)
			require.Len(t, pb, s.Tokens(tc.b.InputLength)*bytesPerToken)
			n := 0
			for n < min(len(pa), len(pb)) && pa[n] == pb[n] {
				n++
			}
			if tc.common == min(len(pa), len(pb)) {
				require.Equal(t, tc.common, n)
				return
			}
			// Differing blocks may agree on a few leading bytes ("<1" of
			// "<12>" and "<13>"), never on a whole block.
			require.GreaterOrEqual(t, n, tc.common)
			require.Less(t, n, tc.common+bb)
			require.NotContains(t, pa+pb, "[sim:eos]")
			require.NotContains(t, pa+pb, "\x00")
		})
	}
	require.Equal(t, s.Prompt(req(700, 9, 10)), s.Prompt(req(700, 9, 10)), "deterministic")
}

func TestRequestsAndSchedule(t *testing.T) {
	s := Scale{TokenScale: 16}
	trace := []TraceRequest{
		{Timestamp: 1000, InputLength: 512, OutputLength: 0, HashIDs: []int64{0}},
		{Timestamp: 1000, InputLength: 512, OutputLength: 33, HashIDs: []int64{0}},
		{Timestamp: 3000, InputLength: 512, OutputLength: 160, HashIDs: []int64{1}},
		{Timestamp: 5000, InputLength: 512, OutputLength: 16, HashIDs: []int64{2}},
	}
	reqs, err := s.Requests(trace)
	require.NoError(t, err)
	var at, out []int
	for _, r := range reqs {
		at, out = append(at, int(r.At/time.Millisecond)), append(out, r.MaxTokens)
	}
	require.Equal(t, []int{0, 0, 2000, 4000}, at, "offsets from the window's first request")
	require.Equal(t, []int{1, 3, 10, 1}, out, "outputs scaled, at least 1")

	// Native rate: 3 gaps in 4 s, 0.75 req/s; at 3 req/s the timeline
	// runs 4 times faster.
	require.Equal(t, []time.Duration{0, 0, 500 * time.Millisecond, time.Second}, Schedule(reqs, 3))
	require.Equal(t, []time.Duration{0, 0, 2 * time.Second, 4 * time.Second}, Schedule(reqs, 0.75))
}

func TestChatBody(t *testing.T) {
	r := Request{Index: 1, Prompt: "abcd", MaxTokens: 7}
	require.JSONEq(t, `{"model": "demo-model", "messages": [{"role": "user", "content": "abcd"}], "max_tokens": 7,
		"stream": true, "stream_options": {"include_usage": true}}`, string(chatBody(r)))
	require.True(t, strings.HasPrefix(wantPrefix(r), "pdx-sim:"))
	require.NotEqual(t, wantPrefix(r), wantPrefix(Request{Prompt: "abce"}))
}
