package kvcache

// A tier's table maps a pdx block hash to its row: words words of holder
// bits (a bit per engine slot: the engine holds the block on the tier),
// words words of kid bits (the engine holds there a child of the block, a
// block chained to it), and the block's parent, the block it chains to (0
// for the first of a chain). Holder bits come first: Match reads them with
// the key, in one cache line. A table per tier (the CPU's is empty unless
// engines offload) keeps a row of up to 64 engines in a cell of 32 bytes,
// kid bits and parent included. A row lives while some engine holds the
// block or one of its children: a row held by none (the parent of a hole)
// keeps its kid bits.
//
// Holes. A hole is a block an engine holds on a tier without its parent.
// An engine without holes holds of any chain a prefix of it: holding block
// k of a prompt it holds block k-1, and so down to block 0. Match then
// need not look up every block of a prompt to find where such an engine
// stops: a few lookups of a search find it (match.go). Engines evict a
// chain from its end (vLLM frees a request's blocks last first into a
// queue it evicts the oldest of, so that a block's children go before it),
// so holes are rare and short-lived, but the index counts them exactly:
// at each change of a holder bit it reads the parent's holder bit and the
// engine's children of the block (the kid bit, and engine.kids beyond
// one). It costs a removal one more lookup, the parent's row.

// rowVals is the words of a row of words-word bitsets after its key.
func rowVals(words int) int { return 2*words + 1 }

// slotBit is where slot's bits are in a bitset: a word and its bit.
func slotBit(slot int32) (int, uint64) { return int(slot) / 64, 1 << (slot % 64) }

// none reports whether no bit of bits is set.
func none(bits []uint64) bool {
	for _, b := range bits {
		if b != 0 {
			return false
		}
	}
	return true
}

// addHoles adds d to e's holes on tier t, keeping x.open.
func (x *Index) addHoles(e *engine, t tier, d int) {
	e.holes[t] += d
	w, bit := slotBit(e.slot)
	if e.holes[t] == 0 {
		x.open[t][w] &^= bit
	} else {
		x.open[t][w] |= bit
	}
}

// hold counts a copy of pdx, whose parent is parent (0: none), on tier t
// of e, setting e's bit when it is the first.
func (x *Index) hold(e *engine, t tier, pdx, parent uint64) {
	tab, n := &x.tables[t], x.words
	row, _ := tab.upsert(pdx)
	w, bit := slotBit(e.slot)
	if row[w]&bit != 0 {
		c := e.extra[pdx]
		c[t]++
		e.extra[pdx] = c
		return
	}
	if none(row[:n]) {
		// The first holder: the row is new or kept for its kid bits. A
		// block's hash is its parent's and tokens': its parent is the same
		// whoever stores it.
		row[2*n] = parent
		x.blocks[t]++
	}
	row[w] |= bit
	e.blocks[t]++
	parent = row[2*n]
	if row[n+w]&bit != 0 {
		// Its children on e were holes.
		x.addHoles(e, t, -1-int(e.kids[t][pdx]))
	}
	if parent == 0 {
		return
	}
	// The parent of a block stored after it in one event was just held:
	// its row is in the CPU's caches.
	prow, _ := tab.upsert(parent) // row is stale from here
	if prow[w]&bit == 0 {
		x.addHoles(e, t, 1)
	}
	if prow[n+w]&bit == 0 {
		prow[n+w] |= bit
		return
	}
	if e.kids[t] == nil {
		e.kids[t] = make(map[uint64]uint32)
	}
	e.kids[t][parent]++
}

// release drops a copy of pdx on tier t of e, clearing e's bit with the
// last, and the row when no engine holds the block or a child of it.
func (x *Index) release(e *engine, t tier, pdx uint64) {
	if len(e.extra) > 0 {
		if c, ok := e.extra[pdx]; ok && c[t] > 0 {
			if c[t]--; c == ([tiers]uint32{}) {
				delete(e.extra, pdx)
			} else {
				e.extra[pdx] = c
			}
			return
		}
	}
	tab, n := &x.tables[t], x.words
	row := tab.find(pdx)
	w, bit := slotBit(e.slot)
	if row == nil || row[w]&bit == 0 {
		return
	}
	row[w] &^= bit
	e.blocks[t]--
	parent := row[2*n]
	if row[n+w]&bit != 0 {
		// Its children on e become holes.
		x.addHoles(e, t, 1+int(e.kids[t][pdx]))
	}
	if none(row[:n]) {
		x.blocks[t]--
		if none(row[n : 2*n]) {
			tab.remove(pdx) // row is stale from here
		}
	}
	if parent == 0 {
		return
	}
	prow := tab.find(parent)
	if prow == nil {
		return // not reached: e's kid bit keeps the row
	}
	if prow[w]&bit == 0 {
		// pdx was a hole.
		x.addHoles(e, t, -1)
	}
	if len(e.kids[t]) > 0 {
		if c := e.kids[t][parent]; c > 0 {
			if c == 1 {
				delete(e.kids[t], parent)
			} else {
				e.kids[t][parent] = c - 1
			}
			return
		}
	}
	prow[n+w] &^= bit
	if none(prow[:2*n]) {
		tab.remove(parent)
	}
}

// widen makes the rows' bitsets words wide.
func (x *Index) widen(words int) {
	old := x.words
	for t := range x.tables {
		tab := &x.tables[t]
		cells, stride := tab.cells, tab.stride
		tab.alloc(tab.size(), rowVals(words))
		for c := 0; c < len(cells); c += stride {
			if cells[c] == 0 {
				continue
			}
			v, _ := tab.upsert(cells[c])
			r := cells[c+1 : c+1+rowVals(old)]
			copy(v[:old], r[:old])
			copy(v[words:words+old], r[old:2*old])
			v[2*words] = r[2*old]
		}
	}
	x.words = words
}
