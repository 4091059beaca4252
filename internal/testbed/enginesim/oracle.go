package enginesim

import (
	"slices"
	"time"
)

// The forecasts below read an engine's true state under Capacity (its
// prefix cache, its prefill queue, its decode batch), which no real router
// can see: they are for a replay's oracle, the yardstick that placement
// policies are measured against, never for pdx. Without Capacity they
// report zeros.

// PrefillForecast is what a prompt sent to an engine's prefill server now
// would wait and compute, by the engine's true state.
type PrefillForecast struct {
	// Wait is until the prefill server takes the prompt: the rest of the
	// prompt being computed and the work of every prompt queued before it,
	// each with the cache hits the prompts ahead of it leave it, and each
	// beside the sequences decoding now (see Compute). With several
	// prefill slots (Capacity.PrefillSlots), until the first slot is free
	// once each prompt ahead has taken the slot free first.
	Wait time.Duration
	// CachedTokens are the prompt's tokens it will find cached when taken:
	// in the cache now, or computed by a prompt ahead of it. Eviction
	// meanwhile is not foreseen.
	CachedTokens int
	// PromptTokens are the prompt's tokens, cached or not.
	PromptTokens int
	// Compute is its own prefill: PrefillOverhead plus its uncached
	// tokens over PrefillTokensPerSec, or, with a step budget
	// (Capacity.MaxBatchedTokens) and sequences decoding on the engine,
	// its uncached tokens over PrefillTokensPerSec plus the decode steps
	// its chunks ride at the batch of now (at least PrefillOverhead).
	Compute time.Duration
}

// TTFT is the forecast time to the prompt's first token on the engine:
// its wait and its compute.
func (f PrefillForecast) TTFT() time.Duration { return f.Wait + f.Compute }

// ForecastPrefill forecasts prompt (the text the engine tokenizes, e.g.
// ChatPromptText of the messages) sent to the engine now. It counts no
// prefix-cache query and changes nothing.
func (s *Server) ForecastPrefill(prompt string) PrefillForecast {
	m := s.load
	if m.capa == nil {
		return PrefillForecast{}
	}
	p := blocksOf(prompt, m.capa.BlockTokens)
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.forecastPrefill(p)
}

// forecastPrefill is ForecastPrefill of p. m.mu is held.
func (m *engineLoad) forecastPrefill(p promptBlocks) PrefillForecast {
	now, n := time.Now(), m.decoding
	var (
		f     PrefillForecast
		ahead [][]uint64 // the prompts that will be cached before p is taken
		// free is each prefill slot's time until it is free: the rest of
		// the prompt it computes, then the queued prompts it will take,
		// each queued prompt taken by the slot free first, as FIFO does.
		free = make([]time.Duration, m.slots())
	)
	for i, c := range m.truth.running {
		switch {
		case !c.started: // granted, its lookup not yet done
			free[i] = m.prefillTime(c.prompt.tokens-m.hitAfter(*c.prompt, nil)*m.capa.BlockTokens, n)
		case len(free) == 1:
			free[i] = m.restOfRun(now, n)
		default:
			free[i] = max(c.end.Sub(now), 0)
		}
		ahead = append(ahead, c.prompt.hashes)
	}
	for _, t := range m.prefillQ {
		i := slices.Index(free, slices.Min(free))
		free[i] += m.prefillTime(t.prompt.tokens-m.hitAfter(*t.prompt, ahead)*m.capa.BlockTokens, n)
		ahead = append(ahead, t.prompt.hashes)
	}
	f.Wait = slices.Min(free)
	f.CachedTokens = m.hitAfter(p, ahead) * m.capa.BlockTokens
	f.PromptTokens = p.tokens
	f.Compute = m.prefillTime(p.tokens-f.CachedTokens, n)
	return f
}

// PlainForecast is what a plain request (no kv_transfer_params: the
// engine computes the prompt and decodes it) sent to an engine now would
// wait and compute, by the engine's true state. On a decode engine that
// holds most of the prompt it is decode-side reuse.
type PlainForecast struct {
	// PrefillForecast is its prompt phase, as for a prefill leg: the
	// engine's one prefill server serves both, beside the sequences
	// decoding on the engine (with a step budget its chunks ride their
	// steps). Its first token comes with it, so TTFT is the request's
	// when Fits.
	PrefillForecast
	// Fits reports whether its sequence would then join the decode batch
	// at once, by the batch of now: nothing queued ahead, a place free and
	// room for its KV. The room is the same before and after its prompt's
	// blocks are cached: they are the blocks it needs.
	Fits bool
}

// ForecastPlain forecasts a plain request of prompt (as for
// ForecastPrefill) generating maxTokens tokens, sent to the engine now.
// It counts no prefix-cache query and changes nothing.
func (s *Server) ForecastPlain(prompt string, maxTokens int) PlainForecast {
	m := s.load
	if m.capa == nil {
		return PlainForecast{}
	}
	bt := m.capa.BlockTokens
	p := blocksOf(prompt, bt)
	private := (p.tokens+maxTokens+bt-1)/bt - len(p.hashes)
	m.mu.Lock()
	defer m.mu.Unlock()
	return PlainForecast{PrefillForecast: m.forecastPrefill(p), Fits: m.fitsNow(p, private)}
}

// fitsNow is admit's test for a sequence of p's blocks and private more,
// by the batch of now. m.mu is held.
func (m *engineLoad) fitsNow(p promptBlocks, private int) bool {
	return len(m.decodeQ) == 0 && m.decoding < m.capa.MaxRunning && (m.decoding == 0 || m.cache.fits(p.hashes, private))
}

// DecodeForecast is what a sequence sent to an engine's decode batch now
// would find, by the engine's true state.
type DecodeForecast struct {
	// CachedTokens are the prompt's tokens its prefix cache holds: a KV
	// pull reads only the rest.
	CachedTokens int
	// Pull is the time to pull the rest.
	Pull time.Duration
	// Running are the sequences decoding; Waiting those queued for a place
	// or pulling their KV.
	Running, Waiting int
	// Step is a decode step once the sequence and every waiting one run:
	// about its time per output token. While the engine computes a prompt
	// beside the batch (Capacity.MaxBatchedTokens), it includes the
	// compute of the chunk of it the step would carry.
	Step time.Duration
	// Fits reports whether it would be admitted at once: nothing queued
	// ahead, a place free and room for its KV.
	Fits bool
}

// ForecastDecode forecasts a sequence of prompt (as for ForecastPrefill)
// generating maxTokens tokens, pulling its KV to the engine now. It counts
// no prefix-cache query and changes nothing.
func (s *Server) ForecastDecode(prompt string, maxTokens int) DecodeForecast {
	m := s.load
	if m.capa == nil {
		return DecodeForecast{}
	}
	bt := m.capa.BlockTokens
	p := blocksOf(prompt, bt)
	private := (p.tokens+maxTokens+bt-1)/bt - len(p.hashes)
	m.mu.Lock()
	defer m.mu.Unlock()
	hit := m.hitAfter(p, nil)
	f := DecodeForecast{
		CachedTokens: hit * bt,
		Pull:         time.Duration(p.blocks-hit) * m.capa.KVPullPerBlock,
		Running:      m.decoding,
		Waiting:      len(m.decodeQ) + m.pulling,
	}
	f.Step = m.batchStep(f.Running+f.Waiting+1) + m.chunkCompute(f.Running+f.Waiting+1)
	f.Fits = m.fitsNow(p, private)
	return f
}

// CachedPrefixTokens is the number of leading tokens of prompt (as for
// ForecastPrefill) the engine's prefix cache holds now and a request
// would reuse (all but the last token at most, as vLLM computes that one
// whatever the cache holds). It counts no prefix-cache query.
func (s *Server) CachedPrefixTokens(prompt string) int {
	m := s.load
	if m.capa == nil {
		return 0
	}
	p := blocksOf(prompt, m.capa.BlockTokens)
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.hitAfter(p, nil) * m.capa.BlockTokens
}

// PrefillArrivals returns the number of prompts that have entered the
// engine's prefill queue so far and a channel closed when the next one
// does. A router that serializes its picks waits on it, so that the next
// pick sees the prompt it just sent in the queue rather than on the wire.
func (s *Server) PrefillArrivals() (uint64, <-chan struct{}) {
	m := s.load
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.truth.next == nil {
		m.truth.next = make(chan struct{})
	}
	return m.truth.arrivals, m.truth.next
}

// ObservePrefills has f called with the prompt text (as for
// ForecastPrefill) of every prefill leg the engine takes from now on,
// before the prompt is queued, so that the engines' forecasts read then
// are what the placement that sent it could have had; nil stops it. f
// runs on the request's goroutine and must not block.
func (s *Server) ObservePrefills(f func(prompt string)) {
	if f == nil {
		s.prefillObserver.Store(nil)
		return
	}
	s.prefillObserver.Store(&f)
}

// truth is an engine's bookkeeping for the forecasts, under engineLoad.mu:
// the prefills being computed (granted, in the order granted; one per
// busy prefill slot) and the prefill queue's arrivals.
type truth struct {
	running  []*ticket
	arrivals uint64
	next     chan struct{} // closed at the next arrival; nil while nobody waits
}

// done notes that t, a granted prefill, ended or gave its slot back.
func (t *truth) done(p *ticket) {
	t.running = slices.DeleteFunc(t.running, func(o *ticket) bool { return o == p })
}

// queued notes a prompt's arrival in the prefill queue. m.mu is held.
func (t *truth) queued() {
	t.arrivals++
	if t.next != nil {
		close(t.next)
		t.next = nil
	}
}

// prefillTime is the prefill server's time for a prompt of uncached
// tokens, with n sequences decoding throughout.
func (m *engineLoad) prefillTime(uncached, n int) time.Duration {
	return m.promptTime(0, uncached, n, true)
}

// hitAfter is lookup's hit, in blocks, once the prompts ahead are cached
// too, without counting a query: the longer of the cached run and the
// prefix shared with a prompt ahead (hashes are chained, so a shared hash
// is a shared prefix). A run that only the union of the two covers is
// missed; the forecast is that much pessimistic. m.mu is held.
func (m *engineLoad) hitAfter(p promptBlocks, ahead [][]uint64) int {
	hit := m.cache.match(p.hashes)
	for _, a := range ahead {
		n := 0
		for n < min(len(a), len(p.hashes)) && a[n] == p.hashes[n] {
			n++
		}
		hit = max(hit, n)
	}
	return min(hit, (p.tokens-1)/m.capa.BlockTokens)
}
