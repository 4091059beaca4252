package replay

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTenantsFor: the workload is sized for the rig: its contexts
// together are the ratio asked of the prefill engines' KV, llm-d's regime
// by default (they fit the engines together, so a placement that splits
// the tenants can cache them, but are several times one engine's KV), and
// always more than an engine that sees every tenant can hold.
func TestTenantsFor(t *testing.T) {
	replayRig := Rig{Prefill: 4, Decode: 4, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625}
	tests := []struct {
		name          string
		rig           Rig
		ratio         float64
		contextBlocks int
	}{
		// 4 engines × 27,000 blocks of 16 real tokens = 1,728,000 tokens;
		// 0.8 of that over 150 tenants is 9,216 tokens, 18 blocks.
		{"the replay's rig", replayRig, 0, 18},
		{"another token scale, the same real KV", Rig{Prefill: 4, Decode: 4, Scale: Scale{TokenScale: 4}, TimeScale: 0.0625}, 0, 18},
		{"two prefill engines", Rig{Prefill: 2, Decode: 2, Scale: Scale{TokenScale: 16}, TimeScale: 0.1}, 0, 9},
		{"eight prefill engines", Rig{Prefill: 8, Decode: 8, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625}, 0, 36},
		// The earlier default: twice the engines' KV, 45 blocks.
		{"contexts twice the engines' KV", replayRig, 2, 45},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := TenantsFor(tt.rig, tt.ratio)
			require.Equal(t, 150, w.Tenants, "llm-d's tenant count")
			require.Equal(t, tt.contextBlocks, w.ContextBlocks)
			ratio := tt.ratio
			if ratio == 0 {
				ratio = TenantKVRatio
				require.Less(t, ratio, 1.0, "by default the contexts fit the engines together")
			}
			require.Equal(t, ratio, w.KVRatio)
			_, c := tt.rig.engineConfig()
			engineKV := float64(c.KVBlocks * c.BlockTokens * tt.rig.Scale.TokenScale) // real tokens
			contexts := float64(w.Tenants * w.ContextTokens())
			require.InEpsilon(t, ratio, contexts/(float64(tt.rig.Prefill)*engineKV), 0.05, "the ratio asked")
			require.Greater(t, contexts, 1.5*engineKV, "an engine that sees every tenant cannot cache them all")
			require.Less(t, w.QuestionTokens, w.ContextTokens()/3, "a short question")
			require.Contains(t, w.String(), "150 tenants")
		})
	}
}

// TestTenantsTrace: the generated trace is deterministic for a seed, in
// the Mooncake form (it parses as a trace line would), each request its
// tenant's context blocks then blocks of its own, tenants uniform and
// arrivals Poisson at the rate.
func TestTenantsTrace(t *testing.T) {
	w := TenantsFor(Rig{Prefill: 4, Decode: 4, Scale: Scale{TokenScale: 16}, TimeScale: 0.0625}, 0)
	const n = 3000
	trace, err := w.Trace(n)
	require.NoError(t, err)
	require.Len(t, trace, n)
	again, err := w.Trace(n)
	require.NoError(t, err)
	require.Equal(t, trace, again, "deterministic")
	head, err := w.Trace(10)
	require.NoError(t, err)
	require.Equal(t, trace[:10], head, "a shorter window is the longer one's head")
	other := w
	other.Seed++
	shuffled, err := other.Trace(n)
	require.NoError(t, err)
	require.NotEqual(t, trace, shuffled, "another seed, another trace")

	seen := map[int64]bool{}
	perTenant := make([]int, w.Tenants)
	questionBlocks := (w.QuestionTokens + TraceBlockTokens - 1) / TraceBlockTokens
	for i, r := range trace {
		require.NoError(t, r.check(), "request %d", i)
		require.Equal(t, w.ContextTokens()+w.QuestionTokens, r.InputLength)
		require.Equal(t, w.OutputTokens, r.OutputLength)
		require.Len(t, r.HashIDs, w.ContextBlocks+questionBlocks)
		tenant := w.TenantOf(r)
		perTenant[tenant]++
		for b := range w.ContextBlocks {
			require.Equal(t, int64(tenant*w.ContextBlocks+b), r.HashIDs[b], "request %d: its tenant's context", i)
		}
		for _, id := range r.HashIDs[w.ContextBlocks:] {
			require.GreaterOrEqual(t, id, int64(w.Tenants*w.ContextBlocks), "a question block is no context's")
			require.False(t, seen[id], "request %d: question block %d reused", i, id)
			seen[id] = true
		}
		if i > 0 {
			require.GreaterOrEqual(t, r.Timestamp, trace[i-1].Timestamp)
		}
	}
	// Uniform: 20 requests a tenant on average; a Poisson count of mean
	// 20 is outside [4, 45] with a chance far below 1e-6 per tenant.
	for tenant, c := range perTenant {
		require.True(t, c >= 4 && c <= 45, "tenant %d has %d requests", tenant, c)
	}
	// Poisson at 1 req/s: a mean gap of 1 s (its standard error over 3,000
	// gaps is 18 ms).
	mean := time.Duration(trace[n-1].Timestamp) * time.Millisecond / (n - 1)
	require.InDelta(t, float64(time.Second), float64(mean), float64(100*time.Millisecond))

	// Scaled, a tenant's prompts share exactly its context's bytes.
	s := Scale{TokenScale: 16}
	reqs, err := s.Requests(trace[:200])
	require.NoError(t, err)
	byTenant := map[int]string{}
	for i, r := range reqs {
		tenant := w.TenantOf(trace[i])
		ctx := r.Prompt[:w.ContextBlocks*s.BlockBytes()]
		if prev, ok := byTenant[tenant]; ok {
			require.Equal(t, prev, ctx)
		}
		byTenant[tenant] = ctx
		require.Len(t, r.Prompt, s.Tokens(trace[i].InputLength)*bytesPerToken)
	}
	for a, ca := range byTenant {
		for b, cb := range byTenant {
			if a != b {
				require.False(t, strings.HasPrefix(cb, ca[:s.BlockBytes()]), "tenants %d and %d share their first block", a, b)
			}
		}
	}
}

func TestTenantsTraceErrors(t *testing.T) {
	ok := Tenants{Tenants: 2, ContextBlocks: 1, QuestionTokens: 10, OutputTokens: 1, Rate: 1}
	tests := []struct {
		name string
		edit func(*Tenants)
		n    int
		err  string
	}{
		{"no requests", nil, 0, "0 requests"},
		{"no tenants", func(w *Tenants) { w.Tenants = 0 }, 1, "0 tenants"},
		{"no context", func(w *Tenants) { w.ContextBlocks = 0 }, 1, "of 0 blocks"},
		{"no question", func(w *Tenants) { w.QuestionTokens = 0 }, 1, "question of 0 tokens"},
		{"no rate", func(w *Tenants) { w.Rate = 0 }, 1, "rate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := ok
			if tt.edit != nil {
				tt.edit(&w)
			}
			_, err := w.Trace(tt.n)
			require.ErrorContains(t, err, tt.err)
		})
	}
	_, err := ok.Trace(3)
	require.NoError(t, err)
}
