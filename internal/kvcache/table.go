package kvcache

import (
	"math/bits"
	"math/rand/v2"
)

// table is an open-addressing hash table from a non-zero 64-bit key to
// vals 64-bit words, with linear probing, at most 3/4 full, the words
// stored inline after their key. A lookup touches one cache line where
// Go's map touches two or more, and misses the CPU's caches about as often
// with tables of millions of blocks: the Index's cost is its cache misses.
// Key 0 marks an empty cell.
//
// The Index keeps two kinds: per tier pdx block hash → the block's row
// (rows.go), and per store engine block key → pdx hash.
type table struct {
	// vals is the words after a cell's key; a cell is padded to stride
	// words, a power of two, so that none straddles two cache lines.
	vals, stride int
	// cellShift is log2(stride); cell i starts at i<<cellShift.
	cellShift uint
	// shift turns a 64-bit product into a cell index: 64 - log2(cells);
	// mask is cells-1.
	shift uint
	mask  int
	// seed keys the cell index, so that keys crafted to share low bits
	// (prompts chosen for their hashes) do not pile up in one run.
	seed  uint64
	n     int
	cells []uint64
}

const (
	minCells = 1 << 8
	// cellMul is the multiplier of Fibonacci hashing.
	cellMul = 0x9e3779b97f4a7c15
)

func newTable(vals int) table {
	t := table{seed: rand.Uint64()}
	t.alloc(minCells, vals)
	return t
}

func (t *table) alloc(cells, vals int) {
	t.vals = vals
	t.cellShift = uint(bits.Len(uint(vals))) // 1+vals rounded up to a power of two
	t.stride = 1 << t.cellShift
	t.shift = uint(64 - bits.TrailingZeros(uint(cells)))
	t.mask = cells - 1
	t.cells = make([]uint64, cells<<t.cellShift)
	t.n = 0
}

func (t *table) size() int { return t.mask + 1 }

func (t *table) home(k uint64) int { return int(((k ^ t.seed) * cellMul) >> t.shift) }

// find returns k's words, nil without k. The slice is valid until the
// next upsert or remove.
func (t *table) find(k uint64) []uint64 {
	for i := t.home(k); ; i = (i + 1) & t.mask {
		c := i << t.cellShift
		switch t.cells[c] {
		case k:
			return t.cells[c+1 : c+1+t.vals]
		case 0:
			return nil
		}
	}
}

// rows sets off[i] to where keys[i]'s cell starts in t.cells, -1
// without it. It loads the keys' home cells first, in a loop of
// independent loads, so that their cache misses overlap: a lookup alone
// waits for its miss, and lookups one after another for each in turn.
func (t *table) rows(keys []uint64, off []int) {
	off = off[:len(keys)]
	if t.n == 0 {
		for i := range off {
			off[i] = -1
		}
		return
	}
	var home [maxRows]uint64
	for i, k := range keys {
		c := t.home(k) << t.cellShift
		off[i], home[i] = c, t.cells[c]
	}
	for i, k := range keys {
		if home[i] != k {
			off[i] = t.findFrom(off[i], k)
		}
	}
}

// maxRows is the most keys rows looks up at once.
const maxRows = 64

// findFrom returns where k's cell starts, probing from cell offset c, -1
// without k.
func (t *table) findFrom(c int, k uint64) int {
	for {
		switch t.cells[c] {
		case k:
			return c
		case 0:
			return -1
		}
		c = (c + t.stride) & (len(t.cells) - 1)
	}
}

// touch loads the first cell of k's run and returns its key. Loading the
// cells of several keys first, in a loop of independent loads, makes
// their cache misses overlap; the lookups that follow find them cached.
func (t *table) touch(k uint64) uint64 { return t.cells[t.home(k)<<t.cellShift] }

// upsert returns k's words, adding k with zero words if absent, and
// whether it added k. The slice is valid until the next upsert or remove.
func (t *table) upsert(k uint64) ([]uint64, bool) {
	if 4*(t.n+1) > 3*t.size() {
		t.rehash(2*t.size(), t.vals)
	}
	for i := t.home(k); ; i = (i + 1) & t.mask {
		c := i << t.cellShift
		switch t.cells[c] {
		case k:
			return t.cells[c+1 : c+1+t.vals], false
		case 0:
			t.cells[c] = k
			t.n++
			return t.cells[c+1 : c+1+t.vals], true
		}
	}
}

// remove deletes k. Later cells of its run move back into the hole
// (backward-shift deletion), so that lookups need no tombstones.
func (t *table) remove(k uint64) {
	cell := func(i int) []uint64 { return t.cells[i<<t.cellShift : (i+1)<<t.cellShift] }
	i := t.home(k)
	for ; cell(i)[0] != k; i = (i + 1) & t.mask {
		if cell(i)[0] == 0 {
			return
		}
	}
	for j := i; ; {
		j = (j + 1) & t.mask
		kj := cell(j)[0]
		if kj == 0 {
			break
		}
		// The cell at j may fill the hole at i unless its home lies
		// cyclically in (i, j].
		if home := t.home(kj); (i < j && i < home && home <= j) || (i > j && (i < home || home <= j)) {
			continue
		}
		copy(cell(i), cell(j))
		i = j
	}
	clear(cell(i))
	t.n--
	if size := t.size(); size > minCells && 8*t.n < size {
		t.rehash(size/2, t.vals)
	}
}

// each calls f with every key and its words.
func (t *table) each(f func(k uint64, v []uint64)) {
	for c := 0; c < len(t.cells); c += t.stride {
		if t.cells[c] != 0 {
			f(t.cells[c], t.cells[c+1:c+1+t.vals])
		}
	}
}

// rehash moves the entries to a table of cells cells with vals words a
// cell (at least the current vals), keeping each entry's words in front
// when vals grows; for the Index's rows, widen does the re-layout.
func (t *table) rehash(cells, vals int) {
	old, oldStride, oldVals := t.cells, t.stride, t.vals
	t.alloc(cells, vals)
	for c := 0; c < len(old); c += oldStride {
		if old[c] == 0 {
			continue
		}
		v, _ := t.upsert(old[c])
		copy(v, old[c+1:c+1+oldVals])
	}
}
