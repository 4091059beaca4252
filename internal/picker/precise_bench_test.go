package picker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/kvevents"
)

// BenchmarkPrecise is BenchmarkPolicies' pick at 64 endpoints with the
// engines' index (package kvcache): a 2,000-token prompt in 16-token
// blocks, each of 256 prompts held whole by one engine and its first 40
// blocks by 15 more.
func BenchmarkPrecise(b *testing.B) {
	eps := endpoints(64)
	index := kvcache.New(kvcache.Config{})
	var prompts [][]uint64
	for c := range 256 {
		tokens := make([]uint32, 2000)
		for i := range tokens {
			tokens[i] = uint32(c*100_000 + i)
		}
		prompts = append(prompts, kvcache.HashTokens(nil, 0, tokens, 16, 8192))
		for e := range 16 {
			n := 40 * 16
			if e == 0 {
				n = len(tokens) / 16 * 16
			}
			index.Apply(eps[(c+e*4)%64].Address, storedBatch(c, tokens[:n]))
		}
	}
	for _, policy := range []string{LeastWorkPolicy, LoadAwarePolicy} {
		b.Run(policy, func(b *testing.B) {
			set := NewSet(eps, Options{Saturation: Saturation{QueueDepth: 5, KVUsage: 0.8}, Cache: index})
			for i, ep := range eps {
				set.Observe(ep.Address, Load{Waiting: i % 3, Running: i % 7, KVUsage: 0.5, At: time.Now()})
			}
			l, err := NewLeg(set, &configv1.Picker{Policy: policy}, RolePrefill)
			require.NoError(b, err)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				p := prompts[i%len(prompts)]
				l.peek(Request{TokenBlocks: p, TokenBlockSize: 16, Tokens: 2000})
				i++
			}
		})
	}
}

// storedBatch is one BlockStored of tokens' full 16-token blocks, engine
// hashes made up from prompt c.
func storedBatch(c int, tokens []uint32) *kvevents.Batch {
	n := len(tokens) / 16
	hashes := make([]kvevents.Hash, n)
	for i := range hashes {
		hashes[i] = kvevents.Hash{Lo: uint64(c)<<32 | uint64(i) + 1}
	}
	return &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.BlockStored, Hashes: hashes, TokenIDs: tokens[:n*16], BlockSize: 16}}}
}
