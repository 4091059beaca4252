package picker

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Defaults for the zero Options.
const (
	DefaultFailureThreshold = 3
	DefaultCoolDown         = 10 * time.Second
	// DefaultStaleAfter is when a scraped load stops counting: the Gateway
	// API Inference Extension's metrics staleness (2 s).
	DefaultStaleAfter = 2 * time.Second
	// DefaultIndexBlocks bounds the prefix index of a Set.
	DefaultIndexBlocks = 1 << 17
)

// Options configure a Set's passive outlier detection.
type Options struct {
	// FailureThreshold is how many consecutive failures eject an endpoint;
	// 0 or less means DefaultFailureThreshold.
	FailureThreshold int
	// CoolDown is how long an ejected endpoint stays out; 0 or less means
	// DefaultCoolDown.
	CoolDown time.Duration
	// Now tells the time; nil means time.Now. Tests pass a fake clock.
	Now func() time.Time
	// Inherit, when set, is a Set whose endpoints' health the new one
	// shares: an endpoint both have keeps its failures and ejection, and
	// Reports to either count for both, as do leases' ends for requests
	// waiting for room in either. A rebuilt routing table passes its
	// predecessor's Set, so that passive health survives a config reload.
	// Inherit must use the same clock (Now).
	Inherit *Set
	// StaleAfter is how long a Load that Observe stored counts; 0 or less
	// means DefaultStaleAfter. Older loads are as good as none: policies
	// fall back to pdx's own in-flight counts.
	StaleAfter time.Duration
	// Saturation says when an endpoint is too busy to take more work; the
	// zero value never calls one saturated.
	Saturation Saturation
	// IndexBlocks bounds how many prompt blocks the Set remembers having
	// sent (see Lease); 0 or less means DefaultIndexBlocks.
	IndexBlocks int
	// BlockTokens are the tokens of a prompt block (Request.BlockTokens),
	// for the Set to count an engine's KV (Load.KVTokens) in blocks; 0
	// or less: every block sent counts as held, whatever the engine said.
	BlockTokens int
	// EngineBlocks: the prompt blocks are the engines' own KV blocks
	// (Load.KVBlockTokens, the least the endpoints said, at least
	// MinEngineBlockTokens) once one has said, BlockTokens until then
	// (see Set.BlockTokens).
	EngineBlocks bool
	// Cache, when set, is what the engines report holding: requests with
	// TokenBlocks are matched against it. Inherit passes it on unless the
	// new Options name another.
	Cache PrefixCache
	// Adapters are the LoRA adapters the pool serves (lora.go): the Set
	// remembers which it sent each endpoint. Engines may report others;
	// picks for those read the engines' word alone.
	Adapters []string
	// Journal, when set, hears the Set's prefill leases start and end,
	// for the replica's peers (peers.go); Pool names the Set's pool there.
	Journal *Journal
	Pool    string
}

// Set is a leg's endpoints and their passive health: an endpoint whose calls
// fail FailureThreshold times in a row (as told by Report) is ejected for
// CoolDown, then admitted again. Picks prefer admitted endpoints.
//
// Its endpoints can be replaced while it is in use (SetEndpoints, as
// Kubernetes discovery does): every pick, Report or Healthy sees either the
// old endpoints or the new ones, and endpoints in both keep their health.
//
// It is safe for concurrent use and holds no per-request state: what a
// request holds is its Lease.
type Set struct {
	// view is the current endpoints. It is replaced whole, never changed,
	// so that a pick reads one consistent view without locking.
	view atomic.Pointer[view]
	// mu serializes SetEndpoints, so that each builds on the view before
	// it, and guards groupIDs.
	mu sync.Mutex
	// groupIDs numbers the groups the Set has seen, for policies to keep
	// per-group state in slices (see view.groups). Numbers are never
	// reused.
	groupIDs map[string]int
	// room wakes the requests waiting for an endpoint with room
	// (AwaitRoom); shared with the Sets that inherit this one.
	room *room

	threshold  int32
	coolDown   int64 // nanoseconds
	staleAfter int64 // nanoseconds
	saturation Saturation
	// indexBlocks is the capacity of each view's prefix index;
	// blockTokens Options.BlockTokens.
	indexBlocks, blockTokens int
	// engineBlocks is Options.EngineBlocks; engineBlock the engines'
	// block the Set follows, 0 until one said (written under mu).
	engineBlocks bool
	engineBlock  atomic.Int64
	// tokens is what the Set's engines answered of the prompts' tokens
	// (learnTokens), shared with the Sets that inherit from it.
	tokens *tokenCount
	cache  PrefixCache
	// adapters numbers Options.Adapters; nil without.
	adapters *adapterTable
	// journal hears the prefill leases (nil: none), as pool; peers are
	// the peers' leases counted here, shared with inheriting Sets.
	journal *Journal
	pool    string
	peers   *peerBook
	now     func() time.Time
	// base is the clock reading at construction. Times are stored as
	// nanoseconds since base, so they fit in an atomic int64 and, with
	// time.Now, are measured on the monotonic clock (immune to wall-clock
	// steps).
	base time.Time

	// turn is where the picks' scans start (Candidates.Start), so that
	// ties go round. Every pick that asks adds to it, from every
	// goroutine; the padding keeps that write traffic off the cache line
	// holding the read-only fields above.
	_    [64]byte
	turn atomic.Uint64
	_    [56]byte
}

// view is one immutable state of a Set's endpoints, as picks read it.
type view struct {
	// endpoints is the order of the endpoints as configured or discovered;
	// it may name an endpoint twice. states[i] is endpoints[i]'s health;
	// repeats share one, since health is a property of the engine, not of
	// its place in the list. first[i] is the first position of
	// endpoints[i], where the index keeps what the endpoint was sent.
	endpoints []endpoint.Endpoint
	states    []*health
	first     []int
	// addresses are the endpoints' distinct addresses, in first listing
	// order (Addresses).
	addresses []string
	// byEP finds an endpoint's health for Report and Healthy in large
	// sets; small ones are scanned (see lookup). nil when small.
	byEP map[endpoint.Endpoint]*health
	// groups holds, per Endpoint.Group, the positions of the group's
	// endpoints. nil when no endpoint has a group.
	groups map[string]group
	// index is what the Set has sent where, by position; a view with other
	// endpoints starts a new one (positions change), see newView.
	index *index
	// cache is the Set's PrefixCache (nil: none) and slots its endpoints'
	// slots in it, by position.
	cache PrefixCache
	slots []int32
}

// group is the endpoints of one Endpoint.Group, in order, and the group's
// number in its Set.
type group struct {
	members []int
	id      int
}

// NewSet returns a set of endpoints, keeping its own copy of them. An empty
// set's picks fail until SetEndpoints gives it some.
func NewSet(endpoints []endpoint.Endpoint, opts Options) *Set {
	if opts.FailureThreshold <= 0 {
		opts.FailureThreshold = DefaultFailureThreshold
	}
	if opts.CoolDown <= 0 {
		opts.CoolDown = DefaultCoolDown
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.StaleAfter <= 0 {
		opts.StaleAfter = DefaultStaleAfter
	}
	if opts.IndexBlocks <= 0 {
		opts.IndexBlocks = DefaultIndexBlocks
	}
	s := &Set{
		threshold:    int32(min(opts.FailureThreshold, 1<<30)),
		coolDown:     int64(opts.CoolDown),
		staleAfter:   int64(opts.StaleAfter),
		saturation:   opts.Saturation,
		indexBlocks:  opts.IndexBlocks,
		blockTokens:  opts.BlockTokens,
		engineBlocks: opts.EngineBlocks,
		cache:        opts.Cache,
		now:          opts.Now,
		room:         new(room),
		tokens:       new(tokenCount),
		journal:      opts.Journal,
		pool:         opts.Pool,
		peers:        &peerBook{leases: map[peerKey]peerLease{}},
	}
	var prev *view
	var prevAdapters *adapterTable
	if opts.Inherit != nil {
		prevAdapters = opts.Inherit.adapters
		// Shared health holds times relative to base, so share that too.
		s.base = opts.Inherit.base
		s.room = opts.Inherit.room
		s.peers = opts.Inherit.peers
		s.tokens = opts.Inherit.tokens
		if s.cache == nil {
			s.cache = opts.Inherit.cache
		}
		prev = opts.Inherit.view.Load()
	} else {
		s.base = s.now()
	}
	s.adapters = newAdapterTable(opts.Adapters, prevAdapters)
	s.view.Store(s.newView(endpoints, prev))
	if s.engineBlocks {
		s.followEngineBlocks() // an inherited endpoint's engine has said
	}
	return s
}

// SetEndpoints replaces the set's endpoints with a copy of endpoints, at once
// for every caller: a pick running concurrently returns an endpoint of the
// old endpoints or of the new ones. Endpoints in both keep their health;
// endpoints that leave lose it (one that comes back starts afresh).
func (s *Set) SetEndpoints(endpoints []endpoint.Endpoint) {
	s.mu.Lock()
	s.view.Store(s.newView(endpoints, s.view.Load()))
	if s.engineBlocks {
		s.followEngineBlocks() // the endpoints that left may have had the least
	}
	s.mu.Unlock()
	s.room.wake() // new endpoints may have room
}

// RefreshSlots resolves the endpoints' slots in the Set's PrefixCache
// anew when the cache no longer holds them as the view does: a view keeps
// the slots it was built with, and the cache frees an engine's slot when
// the engine leaves, which may be while the engine is coming back (then
// its slot in the view names no engine), or had none to give. Endpoints
// keep their health and what the Set sent them. The KV event
// subscriptions call it each time they follow the routing table's engines.
func (s *Set) RefreshSlots() {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.view.Load()
	if v.cache == nil || v.cache.Fresh(v.slots) {
		return
	}
	s.view.Store(s.newView(v.endpoints, v))
}

// Endpoints returns a copy of the set's endpoints, in order.
func (s *Set) Endpoints() []endpoint.Endpoint {
	return slices.Clone(s.view.Load().endpoints)
}

// At is the endpoint at position i modulo the set's size, false when the
// set is empty: a caller's own rotation over the endpoints, without the
// copy Endpoints makes.
func (s *Set) At(i uint64) (endpoint.Endpoint, bool) {
	v := s.view.Load()
	if len(v.endpoints) == 0 {
		return endpoint.Endpoint{}, false
	}
	return v.endpoints[i%uint64(len(v.endpoints))], true
}

// newView builds a view of endpoints, taking the health of those that prev
// (which may be nil) has. The caller holds s.mu, or is NewSet.
func (s *Set) newView(endpoints []endpoint.Endpoint, prev *view) *view {
	v := &view{
		endpoints: slices.Clone(endpoints),
		states:    make([]*health, len(endpoints)),
		first:     make([]int, len(endpoints)),
	}
	// A fresh set allocates its health in one block.
	var states []health
	if prev == nil {
		states = make([]health, len(endpoints))
	}
	byEP := make(map[endpoint.Endpoint]*health, len(endpoints))
	firsts := make(map[endpoint.Endpoint]int, len(endpoints))
	addresses := make(map[string]bool, len(endpoints))
	for i, ep := range v.endpoints {
		if !addresses[ep.Address] {
			addresses[ep.Address] = true
			v.addresses = append(v.addresses, ep.Address)
		}
		h, ok := byEP[ep]
		if !ok {
			firsts[ep] = i
			switch h = prev.lookup(ep); {
			case h != nil:
			case states != nil:
				h = &states[i]
			default:
				h = new(health)
			}
			h.seed = xxhash.Sum64String(ep.Address)
			if h.service == nil {
				h.service = new(service)
			}
			s.remember(h)
			if h.ranks == nil && ep.DPSize > 1 {
				// Endpoints with other DP sizes are other endpoints:
				// an inherited health has its ranks already.
				h.ranks = &ranks{inFlight: make([]atomic.Int32, ep.DPSize)}
			}
			byEP[ep] = h
		}
		v.states[i] = h
		v.first[i] = firsts[ep]
		if ep.Group != "" {
			if v.groups == nil {
				v.groups = map[string]group{}
			}
			g, ok := v.groups[ep.Group]
			if !ok {
				g.id = s.groupID(ep.Group)
			}
			g.members = append(g.members, i)
			v.groups[ep.Group] = g
		}
	}
	v.addresses = slices.Clip(v.addresses) // a caller's append copies them
	if len(v.endpoints) > scanMax {
		v.byEP = byEP
	}
	if s.cache != nil {
		v.cache = s.cache
		v.slots = make([]int32, len(v.endpoints))
		for i, ep := range v.endpoints {
			v.slots[i] = s.cache.Register(ep.Address)
		}
	}
	if prev != nil && slices.Equal(prev.endpoints, v.endpoints) {
		v.index = prev.index
	} else {
		v.index = newIndex(len(v.endpoints), s.indexBlocks)
		for i, h := range v.states {
			if ld := h.load.Load(); ld != nil {
				v.index.setKVBlocks(v.first[i], s.inBlocks(ld.kvTokens))
			}
		}
	}
	return v
}

// inBlocks is kvTokens of KV in prompt blocks; 0 without BlockTokens.
func (s *Set) inBlocks(kvTokens int) int64 {
	bt := s.BlockTokens()
	if bt <= 0 {
		return 0
	}
	return int64(float64(kvTokens) * s.TokenScale() / float64(bt))
}

// Bounds and memory of the token scale (learnTokens).
const (
	// tokenScaleMemory is how many answered prompts the scale remembers:
	// each answer keeps 1 − 1/tokenScaleMemory of the counts before it.
	tokenScaleMemory = 64
	// minTokenScale and maxTokenScale bound a prompt's ratio: beyond
	// them pdx's count is not a count of the same text (an engine that
	// reports no prompt tokens, a prompt truncated).
	minTokenScale, maxTokenScale = 0.25, 4.0
)

// tokenCount is what the Set's engines answered of the prompts' tokens,
// in pdx's count and in theirs, decayed by answer, and their ratio (the
// scale) as float64 bits, 0 until an engine answered.
type tokenCount struct {
	mu           sync.Mutex
	ours, theirs float64
	scale        atomic.Uint64
}

// learnTokens counts a prompt pdx took for ours tokens that its engine
// counted as theirs. An engine's KV holds its tokens; pdx's record of
// what the engine holds (the prefix index's LRU of each endpoint) is in pdx's
// blocks, which a prompt has that many more of: sized in the engine's
// count, it would forget what the engine still holds (on the cache-bound
// rig, pdx counted 9% more tokens than the engines, and predicted prompts
// uncached that the engine held).
//
// The scale is the ratio of the tokens, not the mean of the prompts'
// ratios: a KV cache holds tokens, and a short prompt's ratio is mostly
// the fixed part of each count (the JSON around pdx's, the chat
// template's tokens in the engine's). On the synthetic trace the mean of
// the ratios was 1.65 where the tokens' was 1.09, and the LRUs would have
// remembered half as much again as the engines held. It does not
// allocate; answers take a lock, picks never do.
func (s *Set) learnTokens(ours, theirs int) {
	if ours <= 0 || theirs <= 0 {
		return
	}
	t := float64(theirs)
	o := min(max(float64(ours), minTokenScale*t), maxTokenScale*t)
	c := s.tokens
	c.mu.Lock()
	const keep = 1 - 1.0/tokenScaleMemory
	c.ours, c.theirs = c.ours*keep+o, c.theirs*keep+t
	c.scale.Store(math.Float64bits(c.ours / c.theirs))
	c.mu.Unlock()
}

// TokenScale is how many of pdx's tokens the Set's engines count as one
// of theirs, as learned from their answers; 1 until they have answered.
func (s *Set) TokenScale() float64 {
	if r := math.Float64frombits(s.tokens.scale.Load()); r > 0 {
		return r
	}
	return 1
}

// MinEngineBlockTokens is the least engine block Options.EngineBlocks
// follows: an engine that says it caches finer (blocks of 1 or 8 tokens)
// is matched in blocks of vLLM's default on GPUs, as hashing the prompt
// in smaller ones costs more than it tells.
const MinEngineBlockTokens = 16

// BlockTokens is the size, in tokens, of the prompt blocks the Set counts
// its engines' KV in, and so of those its requests' prompts are hashed in
// (Request.BlockTokens): Options.BlockTokens, or with Options.EngineBlocks
// the engines' own KV block once one has said. A prefix is cached in
// whole engine blocks: counted in larger ones, its last engine blocks are
// missed; in smaller ones, part of a block it does not have is counted.
func (s *Set) BlockTokens() int {
	if n := s.engineBlock.Load(); n > 0 {
		return int(n)
	}
	return s.blockTokens
}

// followEngineBlocks makes the Set's block the least its endpoints'
// engines said (at least MinEngineBlockTokens), and counts every
// engine's KV in it. Blocks hashed in the former size match no prompt
// hashed since, and leave the index as it turns over. s.mu is held, or
// the Set is not shared yet.
func (s *Set) followEngineBlocks() {
	v := s.view.Load()
	least := 0
	for _, h := range v.states {
		if ld := h.load.Load(); ld != nil && ld.kvBlock > 0 && (least == 0 || ld.kvBlock < least) {
			least = ld.kvBlock
		}
	}
	n := int64(max(least, MinEngineBlockTokens))
	if least == 0 || n == s.engineBlock.Load() {
		return
	}
	s.engineBlock.Store(n)
	for i, h := range v.states {
		if ld := h.load.Load(); ld != nil {
			v.index.setKVBlocks(v.first[i], s.inBlocks(ld.kvTokens))
		}
	}
}

// groupID returns the number of group, numbering it if it is new. The
// caller holds s.mu, or is NewSet.
func (s *Set) groupID(name string) int {
	id, ok := s.groupIDs[name]
	if !ok {
		if s.groupIDs == nil {
			s.groupIDs = map[string]int{}
		}
		id = len(s.groupIDs)
		s.groupIDs[name] = id
	}
	return id
}

// scanMax is the set size up to which lookup scans rather than hashes. The
// endpoint a caller reports is normally the one a pick returned, sharing
// its strings, so comparing is a pointer check per field; hashing the
// strings costs more than scanning a few of those.
const scanMax = 16

// position returns the first position of ep in v, -1 if it has none.
func (v *view) position(ep endpoint.Endpoint) int {
	return slices.Index(v.endpoints, ep)
}

// lookup returns ep's health, or nil if ep is not one of v's endpoints (or
// v is nil).
func (v *view) lookup(ep endpoint.Endpoint) *health {
	if v == nil {
		return nil
	}
	if v.byEP != nil {
		return v.byEP[ep]
	}
	for i, e := range v.endpoints {
		if e == ep {
			return v.states[i]
		}
	}
	return nil
}

// members returns the positions of v's endpoints a request of group may
// use (nil: all of them), and the group's number (-1 for all). It reports
// false when the group has no endpoint.
func (v *view) members(group string) (members []int, id int, ok bool) {
	if group == "" {
		return nil, -1, true
	}
	g, ok := v.groups[group]
	return g.members, g.id, ok
}

// count is how many positions members has in v.
func (v *view) count(members []int) int {
	if members == nil {
		return len(v.endpoints)
	}
	return len(members)
}

// position is the k-th of members, or k when members is nil (all).
func position(members []int, k int) int {
	if members == nil {
		return k
	}
	return members[k]
}
