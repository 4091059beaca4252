package picker

import "sync"

// fifo is a prefill endpoint's queue as pdx's own prefills make it, for
// the forecast to count what a new prompt would wait for there. An engine
// takes prompts first come first served into its slots (the prompts it
// computes at once, service.slotsSeen): of pdx's prefills in flight, in
// the order pdx leased them, the first are in the slots, each computed
// since it was taken (its lease, or the end of the prefill whose slot it
// took), and the rest wait whole. A new prompt waits for the slot free
// first once each waiting one has taken the slot free first.
//
// A count of the tokens in flight (the fluid model least_work reads)
// cannot tell one slot nearly done from all of them half done, which is
// the whole of the wait on an engine of several slots: with two 1,000-token
// prompts in two slots, one started long ago, a new prompt waits for the
// older's rest, not for half of both.
//
// A prefill in a slot counts as computed at the rate of one prompt (the
// service model's), at most its tokens: an engine that stopped answering
// looks lighter by the prefills in its slots, while those waiting count
// whole. On an engine whose prompts share one accelerator (vLLM's batched
// prefill steps) the metrics never show prompts waiting beside running
// ones short of its batch limit, so it is one slot and its queue drains
// at its whole rate, as it does.
type fifo struct {
	mu sync.Mutex
	// leases are pdx's prefills in flight, in lease order.
	leases []fifoLease
	// seq numbers the leases.
	seq uint64
}

// fifoLease is one of pdx's prefills in flight on the engine.
type fifoLease struct {
	id     uint64
	tokens int
	// start is when the engine is taken to have begun it, in nanoseconds
	// since the Set's base; negative while it waits.
	start int64
}

// maxSlots bounds the slots the queue models: an engine seen computing
// more prompts at once than this is taken to have this many (its prompts
// beyond wait for the slot free first, as if queued).
const maxSlots = 16

// add counts a prefill of tokens uncached tokens leased at now on an
// engine of slots, and returns its number for remove.
func (f *fifo) add(tokens int, now int64, slots int) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.seq++
	start := int64(-1)
	if f.running() < slots {
		start = now
	}
	f.leases = append(f.leases, fifoLease{id: f.seq, tokens: tokens, start: start})
	return f.seq
}

// remove ends the prefill id at now: its slot, and any the engine has
// been seen to have since, take the first waiting. It does not allocate.
func (f *fifo) remove(id uint64, now int64, slots int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range f.leases {
		if f.leases[i].id == id {
			f.leases = append(f.leases[:i], f.leases[i+1:]...)
			break
		}
	}
	run := f.running()
	for i := range f.leases {
		if run >= slots {
			return
		}
		if f.leases[i].start < 0 {
			f.leases[i].start = now
			run++
		}
	}
}

// running counts the leases in slots. f.mu is held.
func (f *fifo) running() int {
	n := 0
	for i := range f.leases {
		if f.leases[i].start >= 0 {
			n++
		}
	}
	return n
}

// queue is the engine's queue before a prompt sent now, of slots slots
// computing perNs tokens a nanosecond each: ahead, the tokens it has yet
// to compute (pdx's and extra requests of mean tokens that pdx did not
// send, queued after them), and waiting, those the slot free first has
// yet to compute before it takes the prompt.
func (f *fifo) queue(now int64, slots int, perNs float64, extra, mean int) queue {
	slots = min(max(slots, 1), maxSlots)
	if slots == 1 {
		// One slot waits for everything ahead.
		f.mu.Lock()
		ahead := 0
		for i := range f.leases {
			ahead += f.leases[i].rest(now, perNs)
		}
		f.mu.Unlock()
		ahead += extra * mean
		return queue{ahead: ahead, waiting: ahead}
	}
	var free [maxSlots]int
	ahead, taken := 0, 0
	f.mu.Lock()
	// The leases in slots come first (remove starts the first waiting),
	// but for one taken after its slots were seen to grow, which is
	// counted as a waiting one's.
	for i := range f.leases {
		l := &f.leases[i]
		rest := l.rest(now, perNs)
		ahead += rest
		if l.start >= 0 && taken < slots {
			free[taken] = rest
			taken++
		} else {
			takeFirstFree(free[:slots], rest)
		}
	}
	f.mu.Unlock()
	for range extra {
		ahead += mean
		takeFirstFree(free[:slots], mean)
	}
	return queue{ahead: ahead, waiting: free[firstFree(free[:slots])]}
}

// rest is what the engine has yet to compute of l at now, computing
// perNs tokens a nanosecond since it began it: all of it while it waits.
func (l *fifoLease) rest(now int64, perNs float64) int {
	if l.start < 0 || now <= l.start {
		return l.tokens
	}
	return max(l.tokens-int(float64(now-l.start)*perNs), 0)
}

// takeFirstFree gives tokens to the slot free first.
func takeFirstFree(free []int, tokens int) { free[firstFree(free)] += tokens }

// firstFree is the slot with the least left to compute.
func firstFree(free []int) int {
	i := 0
	for j := 1; j < len(free); j++ {
		if free[j] < free[i] {
			i = j
		}
	}
	return i
}
