package enginesim

import (
	"math"
	"time"
)

// One GPU for prefill and decode (Capacity.MaxBatchedTokens, the Capacity
// doc comment's "One GPU"): the prefill server computes a prompt in chunks,
// each riding the decode steps of the moment when sequences decode, and
// every sequence's steps grow by the prompt compute done beside them. All
// under engineLoad.mu.

// promptRun is the prompt the prefill server computes, and its current
// chunk. Its zero value is no prompt.
type promptRun struct {
	running  bool
	uncached int // the prompt's tokens to compute
	done     int // those of the chunks before the current one
	// The current chunk: its tokens and span, its compute when it rides
	// decode steps (0 when computed alone), and the time it takes beyond
	// its compute and the prompt's PrefillOverhead (Usage's
	// PrefillSharedDelay).
	tokens     int
	start, end time.Time
	compute    time.Duration
	delay      time.Duration
}

// startRun begins computing a prompt of uncached tokens at now.
func (m *engineLoad) startRun(uncached int, now time.Time) {
	m.run = promptRun{running: true, uncached: uncached}
	m.openChunk(now)
}

// openChunk begins the run's next chunk at start, with the batch of now:
// the whole rest without a step budget, MaxBatchedTokens of it without
// sequences decoding, and with n decoding what the budget leaves them,
// at least a token.
func (m *engineLoad) openChunk(start time.Time) {
	r := &m.run
	left := r.uncached - r.done
	n, budget := m.decoding, m.capa.MaxBatchedTokens
	switch {
	case budget == 0:
		r.tokens = left
	case n == 0:
		r.tokens = min(budget, left)
	default:
		r.tokens = min(max(budget-n, 1), left)
	}
	first := r.done == 0
	d := m.promptTime(r.done, r.tokens, n, first)
	compute := m.computeTime(r.done, r.tokens)
	r.start, r.end = start, start.Add(d)
	r.compute, r.delay = 0, d-compute
	if first {
		r.delay -= m.capa.PrefillOverhead
	}
	if budget > 0 && n > 0 {
		r.compute = compute
	}
}

// nextChunk ends the run's current chunk, at its end, and begins the next
// there; false when the prompt is done.
func (m *engineLoad) nextChunk() bool {
	r := &m.run
	m.shared += r.compute
	m.usage.PrefillSharedDelay += r.delay
	r.done += r.tokens
	r.tokens, r.compute, r.delay = 0, 0, 0
	if r.done >= r.uncached {
		return false
	}
	m.openChunk(r.end)
	return true
}

// endRun ends the run, done or given up. The compute of a chunk cut short
// counts whole: the decode step carrying it runs to its end (and sequences
// may have paid for it in advance, seat.stepAt).
func (m *engineLoad) endRun() {
	m.shared += m.run.compute
	m.run = promptRun{}
}

// sharedAt is the prompt compute done beside the decode batch by now: the
// chunks ended, and the current one's in proportion to its time elapsed.
func (m *engineLoad) sharedAt(now time.Time) time.Duration {
	r := &m.run
	if r.compute == 0 || !now.After(r.start) {
		return m.shared
	}
	f := min(1, float64(now.Sub(r.start))/float64(r.end.Sub(r.start)))
	return m.shared + time.Duration(math.Round(float64(r.compute)*f))
}

// computeTime is the compute of tokens prompt tokens after the first done
// of its uncached ones, at PrefillTokensPerSec (so that the chunks of a
// prompt add up to the whole's).
func (m *engineLoad) computeTime(done, tokens int) time.Duration {
	at := func(n int) time.Duration {
		return time.Duration(float64(n) / m.capa.PrefillTokensPerSec * float64(time.Second))
	}
	return at(done+tokens) - at(done)
}

// promptTime is the time to compute tokens uncached tokens of a prompt,
// after its first done, with n sequences decoding throughout (first: the
// prompt's first chunk is among them). Alone (or without a step budget)
// that is their compute, plus PrefillOverhead for the first chunk; beside
// a batch each chunk rides a decode step, a partial one the same share of
// the step as of the budget, and the first chunk at least PrefillOverhead.
func (m *engineLoad) promptTime(done, tokens, n int, first bool) time.Duration {
	d := m.computeTime(done, tokens)
	budget := m.capa.MaxBatchedTokens
	if budget == 0 || n == 0 {
		if first {
			d += m.capa.PrefillOverhead
		}
		return d
	}
	room := max(budget-n, 1)
	ride := func(t int) time.Duration {
		return time.Duration(float64(m.batchStep(n)) * float64(t) / float64(room))
	}
	head := min(room, tokens)
	headRide := ride(head)
	if first {
		headRide = max(headRide, m.capa.PrefillOverhead)
	}
	return d + headRide + ride(tokens-head)
}

// restOfRun is the time until the run's prompt is done, with n sequences
// decoding from the next chunk on.
func (m *engineLoad) restOfRun(now time.Time, n int) time.Duration {
	r := &m.run
	done := r.done + r.tokens
	return max(r.end.Sub(now), 0) + m.promptTime(done, r.uncached-done, n, false)
}

// sharedAhead is the compute of the current chunk that a decode step
// beginning at now, base long without it, overlaps once it is lengthened
// by it: x with x = the compute done in [now, now+base+x], at most the
// rest of the chunk (a steady step carrying a whole chunk gets its whole
// compute).
func (m *engineLoad) sharedAhead(now time.Time, base time.Duration) time.Duration {
	r := &m.run
	if r.compute == 0 || !now.Before(r.end) {
		return 0
	}
	rest := m.shared + r.compute - m.sharedAt(now)
	frac := float64(r.compute) / float64(r.end.Sub(r.start)) // of the chunk's time, its compute
	if frac >= 1 {
		return rest
	}
	return min(time.Duration(math.Round(float64(base)*frac/(1-frac))), rest)
}

// chunkCompute is the compute of the chunk a decode step would carry with
// n sequences decoding: of the rest of the prompt being computed, what the
// budget leaves them; 0 when no prompt is computed or there is no budget.
func (m *engineLoad) chunkCompute(n int) time.Duration {
	r := &m.run
	budget := m.capa.MaxBatchedTokens
	if !r.running || budget == 0 {
		return 0
	}
	return m.computeTime(r.done, min(max(budget-n, 1), r.uncached-r.done))
}

// seat is a sequence's place in the decode batch.
type seat struct {
	m *engineLoad
	// paid is how much of the engine's shared prompt compute
	// (engineLoad.sharedAt) the sequence's steps have paid for: at
	// admission all done so far (it was not there), after a step all done
	// by the end the step was given.
	paid  time.Duration
	leave func() // gives the place back
}

// step is the time of the sequence's next decode step. Under Capacity only.
func (s *seat) step() time.Duration {
	s.m.mu.Lock()
	defer s.m.mu.Unlock()
	return s.stepAt(time.Now())
}

// stepAt is the time of the sequence's decode step beginning at now: the
// batch's at its size of now, plus the prompt compute done beside the batch
// that the sequence has not paid for (what its previous step overlapped
// beyond what it paid in advance, a step waking late included), plus in
// advance the compute of the chunk in progress that the step overlaps
// (sharedAhead). So a steady step carrying a chunk takes its compute
// longer, and a sequence decoding throughout a prompt pays all of the
// prompt's compute once. m.mu is held.
func (s *seat) stepAt(now time.Time) time.Duration {
	m := s.m
	shared := m.sharedAt(now)
	late := max(shared-s.paid, 0)
	base := m.batchStep(m.decoding) + late
	ahead := m.sharedAhead(now, base)
	s.paid = max(s.paid, shared) + ahead
	m.usage.DecodeTokens++
	if extra := late + ahead; extra > 0 {
		m.usage.DecodeSharedSteps++
		m.usage.DecodeSharedDelay += extra
	}
	return base + ahead
}
