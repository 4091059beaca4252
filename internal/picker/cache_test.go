package picker

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// engineCache is a PrefixCache that holds, per address, the blocks an
// engine reports: a stand-in for package kvcache's index.
type engineCache struct {
	slots map[string]int32
	held  [][]uint64 // by slot
}

func newEngineCache(held map[string][]uint64) *engineCache {
	c := &engineCache{slots: map[string]int32{}}
	for addr, blocks := range held {
		c.slots[addr] = int32(len(c.held))
		c.held = append(c.held, blocks)
	}
	return c
}

func (c *engineCache) Register(address string) int32 {
	if s, ok := c.slots[address]; ok {
		return s
	}
	return -1
}

func (c *engineCache) Held(slot int32, blocks []uint64) int {
	if slot < 0 {
		return 0
	}
	n := 0
	for n < len(blocks) && n < len(c.held[slot]) && c.held[slot][n] == blocks[n] {
		n++
	}
	return n
}

func (c *engineCache) Fresh([]int32) bool { return true }

func (c *engineCache) Match(blocks []uint64, slots, depth []int32) int32 {
	deepest := int32(0)
	for i, s := range slots {
		depth[i] = int32(c.Held(s, blocks))
		deepest = max(deepest, depth[i])
	}
	return deepest
}

// With a PrefixCache, a request with the engines' tokens is placed by what
// the engines hold, not by what pdx sent where; one without them (its
// render failed) by what pdx sent.
func TestPreciseMatching(t *testing.T) {
	eps := endpoints(3)
	tokens := []uint64{11, 12, 13, 14}
	cache := newEngineCache(map[string][]uint64{
		eps[0].Address: {11},
		eps[2].Address: {11, 12, 13},
	})
	for _, policy := range []string{LeastWorkPolicy, LoadAwarePolicy} {
		t.Run(policy, func(t *testing.T) {
			set := NewSet(eps, Options{Cache: cache})
			leg, err := NewLeg(set, &configv1.Picker{Policy: policy}, RolePrefill)
			require.NoError(t, err)
			sent := blocksOf(1, 2, 3, 4)
			// pdx sent this prompt to endpoint 1 before.
			warm, ok := leg.Pick(Request{Blocks: sent, BlockTokens: 64, Tokens: 1000})
			require.True(t, ok)
			require.NotEqual(t, eps[2], warm.Endpoint())
			warm.End(Succeeded)
			for range 2 {
				l, ok := leg.Pick(Request{Blocks: sent, BlockTokens: 64, Tokens: 1000, TokenBlocks: tokens, TokenBlockSize: 200})
				require.True(t, ok)
				require.Equal(t, eps[2], l.Endpoint(), "the engine holding more of the prompt's tokens than pdx sent anywhere")
				require.Equal(t, 600, l.Cached(), "three blocks of 200 tokens")
				held, ok := l.Held()
				require.True(t, ok)
				require.Equal(t, 600, held)
				l.End(Succeeded)
			}
			l, ok := leg.Pick(Request{Blocks: sent, BlockTokens: 64, Tokens: 1000})
			require.True(t, ok)
			require.Equal(t, warm.Endpoint(), l.Endpoint(), "without tokens: where pdx sent the prompt")
			_, ok = l.Held()
			require.False(t, ok, "no events read without tokens")
			l.End(Succeeded)
		})
	}
}

// A prompt the engines report holding less of than pdx sent goes where pdx
// sent it, not wherever ties go: its events are late, or its KV was
// evicted there and is best computed there again.
func TestPreciseFallsBackToWhatWasSent(t *testing.T) {
	eps := endpoints(3)
	set := NewSet(eps, Options{Cache: newEngineCache(nil)})
	leg, err := NewLeg(set, &configv1.Picker{Policy: LeastWorkPolicy}, RolePrefill)
	require.NoError(t, err)
	req := Request{Blocks: blocksOf(1, 2, 3, 4), BlockTokens: 64, Tokens: 256, TokenBlocks: []uint64{11, 12}, TokenBlockSize: 16}
	first, ok := leg.Pick(req)
	require.True(t, ok)
	first.End(Succeeded)
	for range 3 {
		l, ok := leg.Pick(req)
		require.True(t, ok)
		require.Equal(t, first.Endpoint(), l.Endpoint())
		require.Equal(t, 256, l.Cached(), "as pdx sent it: the engines' events may be late")
		held, ok := l.Held()
		require.True(t, ok)
		require.Zero(t, held, "the engine's word leaves out what pdx sent")
		l.End(Succeeded)
	}
}

// What pdx sent counts, in a precise pick, as its share of the prompt's
// bytes in the engine's tokens: the byte estimate of a JSON prompt runs
// ahead of the engine's count (escapes, the request's structure), and its
// blocks at BlockTokens each would make a new question look held.
func TestPreciseSentCountsItsShare(t *testing.T) {
	eps := endpoints(2)
	// 4 sent blocks of 64 estimated tokens (1,024 bytes) of a 1,200-byte
	// prompt that the engine renders as 240 tokens: they are 204 of them.
	const sentBlocks, promptBytes, tokens = 4, 1200, 240
	for _, tt := range []struct {
		name        string
		promptBytes int
		want        int
	}{
		{"share of the bytes", promptBytes, sentBlocks * 64 * BytesPerToken * tokens / promptBytes},
		{"no bytes given: the estimate, up to the prompt", 0, tokens},
	} {
		t.Run(tt.name, func(t *testing.T) {
			set := NewSet(eps, Options{Cache: newEngineCache(nil)})
			leg, err := NewLeg(set, &configv1.Picker{Policy: LoadAwarePolicy}, RoleDecode)
			require.NoError(t, err)
			req := Request{Blocks: blocksOf(1, 2, 3, 4), BlockTokens: 64, Tokens: tokens,
				TokenBlocks: []uint64{11, 12}, TokenBlockSize: 16, PromptBytes: tt.promptBytes, NeedCached: true}
			first, ok := leg.Pick(req)
			require.True(t, ok)
			require.Zero(t, first.Cached())
			first.End(Succeeded)
			l, ok := leg.Pick(req)
			require.True(t, ok)
			require.Equal(t, first.Endpoint(), l.Endpoint(), "where pdx sent it")
			require.Equal(t, tt.want, l.Cached())
			l.End(Succeeded)
		})
	}
}

// movingCache is an engineCache whose slots the test moves, as package
// kvcache's frees an engine's slot when it leaves.
type movingCache struct {
	engineCache
	fresh     bool
	registers int
}

func (c *movingCache) Register(address string) int32 {
	c.registers++
	return c.engineCache.Register(address)
}

func (c *movingCache) Fresh([]int32) bool { return c.fresh }

// RefreshSlots registers a view's endpoints anew only when the cache says
// their slots moved, keeping their health and what the Set sent them.
func TestRefreshSlots(t *testing.T) {
	eps := endpoints(2)
	cache := &movingCache{engineCache: *newEngineCache(map[string][]uint64{eps[0].Address: {11}, eps[1].Address: {12}}), fresh: true}
	set := NewSet(eps, Options{Cache: cache, FailureThreshold: 1})
	set.Report(eps[1], false)
	require.False(t, set.Healthy(eps[1]))
	before := set.view.Load()
	require.Equal(t, 2, cache.registers)

	set.RefreshSlots()
	require.Same(t, before, set.view.Load(), "fresh: nothing to do")
	require.Equal(t, 2, cache.registers)

	cache.fresh = false
	cache.slots[eps[0].Address], cache.slots[eps[1].Address] = 1, 0
	set.RefreshSlots()
	after := set.view.Load()
	require.NotSame(t, before, after)
	require.Equal(t, 4, cache.registers)
	require.Equal(t, []int32{1, 0}, after.slots)
	require.Equal(t, eps, set.Endpoints())
	require.False(t, set.Healthy(eps[1]), "health kept")
	require.Same(t, before.index, after.index, "what the Set sent kept")

	none := NewSet(eps, Options{})
	none.RefreshSlots() // without a cache: nothing to refresh
}
