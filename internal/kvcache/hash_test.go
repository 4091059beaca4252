package kvcache

import (
	"encoding/binary"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// tokens returns n token ids from start on: start, start+1, ...
func tokens(start, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(start + i)
	}
	return ids
}

// concat is the tokens of parts, one after another.
func concat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func TestHashTokens(t *testing.T) {
	a := tokens(0, 10) // 2 full blocks of 4 and a partial one
	tests := []struct {
		name      string
		seed      uint64
		tokens    []uint32
		blockSize int
		max       int
		want      int // hashes
	}{
		{"partial block not hashed", 0, a, 4, 0, 2},
		{"exact blocks", 0, tokens(0, 8), 4, 0, 2},
		{"max", 0, a, 4, 1, 1},
		{"max above blocks", 0, a, 4, 9, 2},
		{"fewer tokens than a block", 0, tokens(0, 3), 4, 0, 0},
		{"no block size", 0, a, 0, 0, 0},
		{"seeded", 7, a, 4, 0, 2},
		{"long blocks streamed", 0, tokens(0, 1000), 300, 0, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := HashTokens([]uint64{42}, tt.seed, tt.tokens, tt.blockSize, tt.max)
			require.Len(t, got, 1+tt.want, "appended to dst")
			require.Equal(t, uint64(42), got[0])
			// Each hash is xxhash of the parent and the block, little-endian.
			parent := tt.seed
			for k, h := range got[1:] {
				b := binary.LittleEndian.AppendUint64(nil, parent)
				for _, id := range tt.tokens[k*tt.blockSize : (k+1)*tt.blockSize] {
					b = binary.LittleEndian.AppendUint32(b, id)
				}
				require.Equal(t, xxhash.Sum64(b), h, "block %d", k)
				parent = h
			}
		})
	}
}

// TestHashTokensChains is the property the index rests on: a prefix's
// hashes are those of every prompt it starts, and a chain extended from a
// block's hash equals the chain hashed at once.
func TestHashTokensChains(t *testing.T) {
	a, b := tokens(0, 8), tokens(100, 12)
	whole := HashTokens(nil, 0, concat(a, b), 4, 0)
	require.Len(t, whole, 5)
	require.Equal(t, HashTokens(nil, 0, a, 4, 0), whole[:2], "a prefix's hashes")
	require.Equal(t, whole[2:], HashTokens(nil, whole[1], b, 4, 0), "extended from the parent's hash")
	require.NotEqual(t, whole, HashTokens(nil, Seed("adapter", nil), concat(a, b), 4, 0), "another identity, other hashes")
	other := HashTokens(nil, 0, concat(tokens(1, 8), b), 4, 0)
	for i := range other {
		require.NotEqual(t, whole[i], other[i], "a different first block changes every later hash")
	}
	require.NotEqual(t, whole[1], HashTokens(nil, 0, concat(a, b), 8, 0)[0], "block sizes do not mix")
}

// TestHashTokensPortable: the copy of the tokens' memory that little-endian
// machines take gives the bytes the other path writes one by one.
func TestHashTokensPortable(t *testing.T) {
	ids := tokens(1<<20, 300)
	fast := HashTokens(nil, 9, ids, 16, 0)
	littleEndian = !littleEndian
	defer func() { littleEndian = !littleEndian }()
	require.Equal(t, fast, HashTokens(nil, 9, ids, 16, 0))
}

func TestHashTokensAllocs(t *testing.T) {
	ids := tokens(0, 2000)
	dst := make([]uint64, 0, 125)
	long := tokens(0, 600)
	require.Zero(t, testing.AllocsPerRun(100, func() {
		dst = HashTokens(dst[:0], 0, ids, 16, 0)
		dst = HashTokens(dst[:0], 0, long, 300, 0)
	}))
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = Seed("adapter", []byte{0x91, 0xa1, 's'}) }))
}

func TestSeed(t *testing.T) {
	enc := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		return b
	}
	nils := make([]any, 20)
	tests := []struct {
		name      string
		lora      string
		extraKeys []byte
		base      bool // the base model's identity, 0
	}{
		{"base", "", nil, true},
		{"empty extra keys", "", []byte{}, true},
		{"nil extra keys", "", enc(nil), true},
		{"a nil per block", "", enc([]any{nil, nil}), true},
		{"many nils (array 16)", "", enc(nils), true},
		{"cache salt", "", enc([]any{[]any{"salt"}, nil}), false},
		{"multimodal hash", "", enc([]any{nil, []any{"mm-hash", 3}}), false},
		{"not an array", "", enc("salt"), false},
		{"truncated array", "", []byte{0x92, 0xc0}, false},
		{"lora", "adapter", nil, false},
	}
	seen := map[uint64]string{}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := Seed(tt.lora, tt.extraKeys)
			if tt.base {
				require.Zero(t, s)
				return
			}
			require.NotZero(t, s)
			require.NotContains(t, seen, s, "identities differ")
			seen[s] = tt.name
		})
	}
	require.NotEqual(t, Seed("a", nil), Seed("a", enc([]any{[]any{"salt"}})), "a salted adapter's blocks are another's")
	require.NotEqual(t, Seed("a", nil), loraIDSeed(1))
}

// TestTable checks the open-addressing table against a map through growth,
// shrinking, backward-shift deletion and wider cells.
func TestTable(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tab := newTable(2)
	model := map[uint64]uint64{}
	var keys []uint64
	check := func() {
		require.Equal(t, len(model), tab.n)
		for k, v := range model {
			row := tab.find(k)
			require.NotNil(t, row, "key %x", k)
			require.Len(t, row, tab.vals)
			require.Equal(t, v, row[0])
			require.Equal(t, ^v, row[1])
		}
		// rows finds them too, loading them first, and not the absent.
		keys := append(slices.Collect(maps.Keys(model))[:min(len(model), maxRows-1)], 12345)
		off := make([]int, len(keys))
		tab.rows(keys, off)
		for i, k := range keys {
			if _, ok := model[k]; !ok {
				require.Equal(t, -1, off[i])
				continue
			}
			require.Equal(t, k, tab.cells[off[i]])
			require.Equal(t, tab.find(k), tab.cells[off[i]+1:off[i]+1+tab.vals])
		}
		n := 0
		tab.each(func(k uint64, row []uint64) {
			require.Equal(t, model[k], row[0])
			n++
		})
		require.Equal(t, len(model), n)
	}
	for round := range 6 {
		for range 3000 {
			// Few distinct low bits: long runs of cells.
			k := r.Uint64()<<12 | 1
			row, added := tab.upsert(k)
			_, seen := model[k]
			require.Equal(t, !seen, added)
			v := r.Uint64()
			row[0], row[1] = v, ^v
			model[k] = v
			keys = append(keys, k)
		}
		check()
		if round == 2 {
			tab.rehash(tab.size(), 8)
			require.Equal(t, 8, tab.vals)
			require.Equal(t, 16, tab.stride)
			check()
		}
		r.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		for _, k := range keys[:len(keys)*3/4] {
			tab.remove(k)
			delete(model, k)
			require.Nil(t, tab.find(k))
		}
		keys = keys[len(keys)*3/4:]
		tab.remove(12345) // absent
		check()
	}
	for _, k := range keys {
		tab.remove(k)
	}
	require.Zero(t, tab.n)
	require.Equal(t, minCells, tab.size(), "shrunk back")
}
