package picker

import (
	"time"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Outcome is how a leased call went, as the endpoint's passive health
// hears it.
type Outcome int

const (
	// Released says nothing of the endpoint: the client went away, the
	// engine refused the request as such, or a decode stream simply ended.
	Released Outcome = iota
	// Succeeded re-admits the endpoint and clears its failures.
	Succeeded
	// Failed counts against the endpoint: its fault (see Set.Report).
	Failed
)

// Lease is a request counted on the endpoint a pick chose, from the pick
// until End: in the endpoint's in-flight count (with the tokens it is to
// compute there), on a DP rank of it when it serves several, and in the
// Set's prefix index (the prompt is taken to be cached there from now on).
//
// A Lease is a plain value that its request keeps and ends once, whatever
// the way out: End after the first does nothing. The zero Lease is ended.
// It belongs to one request, on one goroutine at a time.
type Lease struct {
	// set is nil once the lease has ended; h is nil when the endpoint is
	// not the set's (see Move).
	set *Set
	h   *health
	ep  endpoint.Endpoint
	// rank is the DP rank counted, none without one.
	rank endpoint.Rank
	// prompt is the prompt's tokens in pdx's count (its bytes over
	// BytesPerToken, in which its Blocks are cut), for the Set to learn
	// how many make one of the engine's (Observe); tokens are those the
	// endpoint is to compute (a prefill's: the prompt less cached).
	prompt, tokens, cached int
	// held is what the engine reported it held of the prompt, in tokens,
	// -1 where the pick did not read its events.
	held int
	// prefill is a prefill leg's lease, which the endpoint's fluid model
	// and queue count (queued is its number there); ahead is what was
	// queued before it at the pick and at when it was picked (nanoseconds
	// since the Set's base), for the endpoint's service model to learn
	// from its answer; uncached, when not negative, is how many of its
	// tokens the engine said it computed (Observe).
	prefill  bool
	queued   uint64
	ahead    queue
	at       int64
	uncached int
	// session is what became of the request's session, if it has one.
	session SessionOutcome
	// blocks are the prompt's, for Move to index them where it moves.
	blocks []uint64
	// adapter is the number of the request's adapter in the Set's table
	// (-1: none, or not listed), for Move; lora how the pick went for it.
	adapter int
	lora    LoRAOutcome
	// tentative: the prompt and adapter are not recorded as sent yet
	// (Request.Tentative, Confirm).
	tentative bool
}

// lease counts a request of role on the endpoint at position i of v (see
// Lease); held is how many of the prompt's token blocks its engine holds,
// as the pick read it, or -1.
func (s *Set) lease(v *view, i, held int, req *Request, role Role) Lease {
	h, pos := v.states[i], v.first[i]
	l := Lease{set: s, h: h, ep: v.endpoints[i], prompt: req.Tokens, tokens: req.Tokens, held: -1, blocks: req.Blocks, adapter: -1, tentative: req.Tentative}
	if req.PromptBytes > 0 {
		// Rendered: Tokens is the engine's exact count.
		l.prompt = req.PromptBytes / BytesPerToken
	}
	if req.Adapter != "" {
		l.adapter = s.adapters.index(req.Adapter)
		if !req.Tentative {
			s.sentAdapter(h, l.adapter)
		}
	}
	// What the endpoint has cached is read before this prompt counts as
	// sent there.
	if role == RolePrefill || req.NeedCached {
		precise := v.cache != nil && req.TokenBlocks != nil
		l.cached = sentTokens(v.index.matched(pos, req.Blocks, true), req.BlockTokens, req.Tokens, req.PromptBytes, precise)
		if precise {
			// As the pick counted it (depths.cachedTokens).
			if held < 0 {
				held = v.cache.Held(v.slots[i], req.TokenBlocks)
			}
			l.held = min(held*req.TokenBlockSize, req.Tokens)
			l.cached = min(max(l.cached, l.held), req.Tokens)
		}
	}
	if role == RolePrefill {
		// The engine computes the prompt but what it has cached.
		l.tokens = max(req.Tokens-l.cached, 0)
		l.prefill, l.uncached = true, -1
		l.ahead, l.at = s.ahead(h, req.Tokens)
	}
	s.count(h, l.tokens, l.prefill)
	if l.prefill {
		// Queued as of the clock reading ahead took.
		l.queued = h.service.queue.add(l.tokens, l.at, h.service.slotsSeen())
		if s.journal != nil {
			s.journal.started(s.pool, l.ep.Address, l.queued, l.tokens, req.Blocks)
		}
	}
	if len(req.Blocks) > 0 && !req.Tentative {
		v.index.add(pos, req.Blocks)
	}
	if h.ranks != nil && !req.NoRank {
		l.rank = h.ranks.begin()
	}
	return l
}

// LoRA is how the pick went for the request's adapter (LoRANone: it has
// none).
func (l *Lease) LoRA() LoRAOutcome { return l.lora }

// Endpoint is the leased endpoint.
func (l *Lease) Endpoint() endpoint.Endpoint { return l.ep }

// Rank is the DP rank of the endpoint that is to serve the request, the
// one with the fewest of pdx's requests in flight (ties go round robin);
// none for an endpoint without DP ranks (Endpoint.DPSize <= 1), for a
// request that names none (Request.NoRank, DropRank), or after a Move.
func (l *Lease) Rank() endpoint.Rank { return l.rank }

// Tokens is how many tokens the lease counts on the endpoint: a prefill's
// uncached prompt tokens, a decode's whole prompt.
func (l *Lease) Tokens() int { return l.tokens }

// Cached is how many of the prompt's tokens the endpoint had cached at the
// pick, as far as this pdx knows (what it sent there): a prefill lease
// always tells, a decode lease when the request asked (NeedCached).
func (l *Lease) Cached() int { return l.cached }

// Held is how many of the prompt's tokens the endpoint's engine reported
// it held at the pick (its KV events), and whether the pick read them: only
// a precise pick does, and only for a lease that tells Cached. Unlike
// Cached it leaves out what pdx sent there, which is an estimate.
func (l *Lease) Held() (int, bool) { return l.held, l.held >= 0 }

// Session is what became of the request's session at the pick: kept on
// its first endpoint, moved down its order, or NoSession for a request
// without one.
func (l *Lease) Session() SessionOutcome { return l.session }

// Observe tells a prefill lease what its engine said of the prompt when
// it answered: promptTokens in all, cachedTokens of them found in its
// cache. The endpoint's service model learns from the tokens it
// computed, rather than from the pick's estimate of them, and the Set how
// many of its tokens the engines count as one (learnTokens). A lease that
// is not a prefill's ignores it.
func (l *Lease) Observe(promptTokens, cachedTokens int) {
	if l.prefill && promptTokens > 0 {
		l.uncached = max(promptTokens-max(cachedTokens, 0), 0)
		if l.set != nil {
			l.set.learnTokens(l.prompt, promptTokens)
		}
	}
}

// Open reports whether the lease has not ended.
func (l *Lease) Open() bool { return l.set != nil }

// End ends the lease: the endpoint and its rank count the request no more,
// and its passive health hears the outcome. Later Ends do nothing.
func (l *Lease) End(o Outcome) {
	s := l.set
	if s == nil {
		return
	}
	l.set = nil
	if h := l.h; h != nil {
		l.uncount(s, o == Succeeded)
		if o != Released {
			s.report(h, o == Succeeded)
		}
	}
	s.room.wake()
}

// Detach ends the lease, leaving the request on the endpoint for the
// engine's metrics to count: picks count it as pdx's until the engine's
// next sample (Observe), which shows it among the engine's running or
// waiting requests, and not after. Its end need not reach pdx, so a decode
// detached at routing needs no stream held for it (and survives pdx
// dying). It reports false, and changes nothing, when the endpoint's load
// is not fresh, the Set's saturation counts pdx's own in-flight requests
// (MaxInFlight), or the lease is not the Set's endpoint's: the count must
// then stay exact. A detached request on a DP rank no longer counts there.
func (l *Lease) Detach() bool {
	s, h := l.set, l.h
	if s == nil || h == nil || s.saturation.MaxInFlight > 0 {
		return false
	}
	ld := h.load.Load()
	if ld == nil || s.elapsed()-ld.at > s.staleAfter {
		return false
	}
	// Counted as pending before it stops counting as in flight: a pick in
	// between counts it twice rather than not at all.
	h.detached.Add(1)
	l.set = nil
	l.uncount(s, false)
	return true
}

// DropRank ends the count on the lease's rank alone: the request goes to
// the endpoint naming no rank, and the engine places it itself.
func (l *Lease) DropRank() {
	if l.set != nil && l.h != nil && l.h.ranks != nil {
		l.h.ranks.end(l.rank)
	}
	l.rank = endpoint.Rank{}
}

// Confirm records the prompt and adapter of a tentative lease (see
// Request.Tentative) as sent to its endpoint: the pick stands. It does
// nothing for a lease that is not tentative or has ended.
func (l *Lease) Confirm() {
	s := l.set
	if !l.tentative || s == nil || l.h == nil {
		return
	}
	l.tentative = false
	s.sentAdapter(l.h, l.adapter)
	if v := s.view.Load(); len(l.blocks) > 0 {
		if i := v.position(l.ep); i >= 0 {
			v.index.add(i, l.blocks)
		}
	}
}

// Move moves an open lease to ep, the endpoint that served the request in
// the end (a decode fallback): ep counts it from now on, with the lease's
// tokens and prompt, on none of its ranks. An endpoint the Set does not
// have counts nothing.
func (l *Lease) Move(ep endpoint.Endpoint) {
	s := l.set
	if s == nil {
		return
	}
	if l.h != nil {
		// Ended there, unanswered (see fluid.end).
		l.uncount(s, false)
	}
	v := s.view.Load()
	l.ep, l.h, l.rank, l.tentative = ep, nil, endpoint.Rank{}, false
	if i := v.position(ep); i >= 0 {
		l.h = v.states[i]
		s.count(l.h, l.tokens, l.prefill)
		if l.prefill {
			l.queued = l.h.service.queue.add(l.tokens, s.elapsed(), l.h.service.slotsSeen())
			if s.journal != nil {
				s.journal.started(s.pool, ep.Address, l.queued, l.tokens, l.blocks)
			}
		}
		s.sentAdapter(l.h, l.adapter)
		if len(l.blocks) > 0 {
			v.index.add(i, l.blocks)
		}
	}
	s.room.wake()
}

// uncount takes the lease of s off its endpoint and rank; succeeded: the
// engine answered it.
func (l *Lease) uncount(s *Set, succeeded bool) {
	h := l.h
	if h.ranks != nil {
		h.ranks.end(l.rank)
	}
	if l.prefill {
		now := s.elapsed()
		h.service.queue.remove(l.queued, now, h.service.slotsSeen())
		var a PrefillAnswer
		if succeeded {
			a = PrefillAnswer{Took: time.Duration(now - l.at), Ahead: l.ahead.ahead, Waiting: l.ahead.waiting, Computed: l.tokens}
			if l.uncached >= 0 {
				a.Computed = l.uncached
			}
		}
		if s.journal != nil {
			s.journal.ended(s.pool, l.ep.Address, l.queued, a)
		}
		h.work.end(s, l.tokens, succeeded)
		if succeeded {
			h.service.learn(a.Took.Seconds(), l.ahead, a.Computed)
		}
	}
	h.inFlight.Add(-1)
	h.inFlightTokens.Add(-int64(l.tokens))
}

// Sent returns how many leading blocks of a prompt (Blocks) the Set counts
// as sent to ep, by this replica or by a peer (PeerStarted), whether or
// not the engine's cache has room for them still.
func (s *Set) Sent(ep endpoint.Endpoint, blocks []uint64) int {
	v := s.view.Load()
	i := v.position(ep)
	if i < 0 {
		return 0
	}
	return v.index.matched(v.first[i], blocks, false)
}

// KVBlocks is how many prompt blocks (Options.BlockTokens) ep's engine
// said its KV cache holds: what the Set sent there counts as cached only
// while it is among that many blocks sent last (Load.KVTokens). False
// while the engine has not said, or when its cache outgrows what the Set
// remembers sending.
func (s *Set) KVBlocks(ep endpoint.Endpoint) (int, bool) {
	v := s.view.Load()
	i := v.position(ep)
	if i < 0 {
		return 0, false
	}
	n := int(v.index.sizes[v.first[i]].Load())
	return n, n > 0
}

// InFlight returns how many of the requests leased ep have not ended.
func (s *Set) InFlight(ep endpoint.Endpoint) int {
	if h := s.view.Load().lookup(ep); h != nil {
		return int(h.inFlight.Load())
	}
	return 0
}
