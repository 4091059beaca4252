package picker

import (
	"math"
	"time"
)

// Saturation thresholds: an endpoint is saturated when its fresh Load has
// at least QueueDepth requests waiting or KVUsage of its KV cache in use,
// or when pdx has MaxInFlight requests on it. Zero fields do not count.
//
// Unlike the Gateway API Inference Extension's detector, a stale or absent
// Load does not make an endpoint saturated: a metrics endpoint that fails
// must degrade picking to in-flight counts, not stop traffic.
type Saturation struct {
	QueueDepth  int
	KVUsage     float64
	MaxInFlight int
}

// Load is what an engine says of its load (see Set.Observe).
type Load struct {
	// Waiting and Running are the engine's queued and running requests.
	Waiting, Running int
	// KVUsage is the share of its KV cache in use, 0–1; negative when the
	// engine does not say.
	KVUsage float64
	// KVTokens is how many tokens its KV cache holds; 0 when the engine
	// does not say. The Set's record of what it sent the engine then
	// counts as cached only what the engine has had room for since.
	KVTokens int
	// KVBlockTokens is how many tokens a block of that cache holds; 0
	// when the engine does not say. With Options.EngineBlocks the Set's
	// prompt blocks follow it (BlockTokens).
	KVBlockTokens int
	// At is when the engine said so.
	At time.Time
	// Adapters is what it said of its LoRA adapters; Observe keeps the
	// slices, which the caller must not change after.
	Adapters AdapterLoad
}

// load is a Load as picks read it: times in nanoseconds since Set.base.
type load struct {
	waiting, running int
	kvUsage          float64
	kvTokens         int
	// kvBlock is Load.KVBlockTokens (or the last that said it).
	kvBlock int
	at      int64
	// ours is how many of this pdx's requests were on the endpoint when the
	// load was stored: those of the engine's requests it knows of.
	ours int
	// detached is health.detached when the load was stored.
	detached uint32
	lora     AdapterLoad
}

// Observe stores what the engine at address said of its load, for every
// endpoint of the set at that address. It is called off the request path
// (the engine metrics scraper).
func (s *Set) Observe(address string, l Load) {
	v := s.view.Load()
	newBlock := false
	for i, ep := range v.endpoints {
		if ep.Address == address {
			h := v.states[i]
			h.service.load(l.Running, l.Waiting)
			kvTokens, kvBlock := l.KVTokens, l.KVBlockTokens
			prev := h.load.Load()
			if prev != nil {
				// A sample that does not say keeps what the last said.
				if kvTokens <= 0 {
					kvTokens = prev.kvTokens
				}
				if kvBlock <= 0 {
					kvBlock = prev.kvBlock
				}
			}
			newBlock = newBlock || kvBlock > 0 && (prev == nil || prev.kvBlock != kvBlock)
			h.load.Store(&load{waiting: l.Waiting, running: l.Running, kvUsage: l.KVUsage, kvTokens: kvTokens, kvBlock: kvBlock, at: int64(l.At.Sub(s.base)), ours: int(h.inFlight.Load()), detached: h.detached.Load(), lora: l.Adapters})
			v.index.setKVBlocks(v.first[i], s.inBlocks(kvTokens))
		}
	}
	if newBlock && s.engineBlocks {
		s.mu.Lock()
		s.followEngineBlocks()
		s.mu.Unlock()
	}
	s.room.wake() // a lighter load may make room
}

// Addresses returns the distinct addresses of the set's endpoints, in the
// order first listed, for the metrics scraper, which asks at every tick:
// the view computed them once. The caller must not modify them.
func (s *Set) Addresses() []string { return s.view.Load().addresses }

// signal is what one pick reads of an endpoint: everything at once, so
// that a policy touches each endpoint's state once.
type signal struct {
	inFlight, inFlightTokens int
	// waiting, running, kvUsage and kvTokens (the KV's size, 0 when the
	// engine never said) are the engine's load when fresh; else 0, 0, -1
	// and 0. foreign are the engine's requests pdx does not count,
	// as of that load: its waiting and running ones less pdx's then
	// (detached ones are the engine's to count). pending are the requests
	// pdx detached there since (Lease.Detach), which the load cannot show
	// yet; 0 without a fresh load.
	waiting, running, foreign, pending, kvTokens int
	kvUsage                                      float64
	// gen is the pick that read it (see Candidates.signal).
	gen uint32
	// admitted: not ejected; usable: admitted and not saturated; fresh:
	// the engine's load above is not stale; excluded: the request may not
	// use the endpoint at all (tried, or outside its subset), and nothing
	// else is read.
	admitted, usable, saturated, fresh, excluded bool
}

// queue is the load least-request picking counts: the requests waiting or
// running on the engine by its own fresh word, or pdx's in-flight count
// when that is more (the engine's word is up to a scrape old) or the engine
// has none, and the requests detached there since the engine's word.
func (g *signal) queue() int { return max(g.inFlight, g.waiting+g.running) + g.pending }

// requests are the requests on the engine as far as pdx can tell: its own
// in flight, those it detached since the engine's fresh word, and the
// others that word counts.
func (g *signal) requests() int { return g.inFlight + g.pending + g.foreign }

// look reads h at t into g. It writes through a pointer: picks call it for
// every candidate, and a returned signal is a copy. It works in locals and
// stores each field of g once: fields read back after a store wait on it.
// For a pick whose policy weighs each engine's queue itself (ownQueue),
// the engine's waiting requests do not make it unusable (queueWeigher);
// they still make it saturated, which the leg's admission reads. own and
// ownTokens are the pick's own request's count on h, which a pick made
// again (Request.Stay) does not weigh against h.
func (t *instant) look(h *health, g *signal, ownQueue bool, own, ownTokens int) {
	inFlight := max(int(h.inFlight.Load())-own, 0)
	g.inFlight, g.inFlightTokens = inFlight, max(int(h.inFlightTokens.Load())-ownTokens, 0)
	waiting, running, foreign, pending, kvTokens, kvUsage := 0, 0, 0, 0, 0, -1.0
	admitted, fresh := true, false
	if u, l := h.until.Load(), h.load.Load(); u != 0 || l != nil {
		now := t.read()
		admitted = now >= u
		if l != nil && now-l.at <= t.set.staleAfter {
			fresh, waiting, running, kvUsage, kvTokens = true, l.waiting, l.running, l.kvUsage, l.kvTokens
			foreign = max(waiting+running-l.ours, 0)
			pending = int(h.detached.Load() - l.detached)
		}
	}
	sat := &t.set.saturation
	full := sat.MaxInFlight > 0 && inFlight >= sat.MaxInFlight ||
		fresh && sat.KVUsage > 0 && kvUsage >= sat.KVUsage
	queued := fresh && sat.QueueDepth > 0 && waiting >= sat.QueueDepth
	saturated := full || queued
	g.waiting, g.running, g.foreign, g.pending, g.kvTokens, g.kvUsage = waiting, running, foreign, pending, kvTokens, kvUsage
	g.admitted, g.usable, g.saturated, g.fresh, g.excluded = admitted, admitted && !full && (ownQueue || !queued), saturated, fresh, false
}

// Saturated reports whether every endpoint a request of group may use is
// saturated (see Options.Saturation), ejected endpoints aside. It is false
// when the group has no endpoint: the pick's error says that better.
func (s *Set) Saturated(group string) bool {
	saturated, _ := s.saturated(group)
	return saturated
}

// saturated is Saturated, and, when true, the earliest time (since base)
// at which the group may have room without anyone telling the Set: an
// ejection ending or a saturating load going stale; math.MaxInt64 when
// none is due.
func (s *Set) saturated(group string) (bool, int64) {
	if s.saturation == (Saturation{}) {
		return false, 0
	}
	v := s.view.Load()
	members, _, ok := v.members(group)
	n := v.count(members)
	if !ok || n == 0 {
		return false, 0
	}
	now := s.clock()
	some, next := false, int64(math.MaxInt64)
	for k := range n {
		h := v.states[position(members, k)]
		var g signal
		if now.look(h, &g, false, 0, 0); !g.admitted {
			next = min(next, h.until.Load())
			continue
		}
		if !g.saturated {
			return false, 0
		}
		if l := h.load.Load(); g.fresh && l != nil {
			next = min(next, l.at+s.staleAfter+1)
		}
		some = true
	}
	return some, next
}
