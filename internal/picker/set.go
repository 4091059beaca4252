package picker

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

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
	// Reports to either count for both. A rebuilt routing table passes its
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
	// sent (see Begin); 0 or less means DefaultIndexBlocks.
	IndexBlocks int
}

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
	// At is when the engine said so.
	At time.Time
}

// Set is a leg's endpoints and their passive health: an endpoint whose calls
// fail FailureThreshold times in a row (as told by Report) is ejected for
// CoolDown, then admitted again. Policies prefer admitted endpoints.
//
// Its endpoints can be replaced while it is in use (SetEndpoints, as
// Kubernetes discovery does): every Pick, Report or Healthy sees either the
// old endpoints or the new ones, and endpoints in both keep their health.
//
// It is safe for concurrent use and holds no per-request state.
type Set struct {
	// view is the current endpoints. It is replaced whole, never changed,
	// so that a Pick reads one consistent view without locking.
	view atomic.Pointer[view]
	// mu serializes SetEndpoints, so that each builds on the view before
	// it, and guards groupIDs.
	mu sync.Mutex
	// groupIDs numbers the groups the Set has seen, for policies to keep
	// per-group state in slices (see view.groups). Numbers are never
	// reused.
	groupIDs map[string]int

	threshold  int32
	coolDown   int64 // nanoseconds
	staleAfter int64 // nanoseconds
	saturation Saturation
	// indexBlocks is the capacity of each view's prefix index.
	indexBlocks int
	now         func() time.Time
	// base is the clock reading at construction. Times are stored as
	// nanoseconds since base, so they fit in an atomic int64 and, with
	// time.Now, are measured on the monotonic clock (immune to wall-clock
	// steps).
	base time.Time
}

// view is one immutable state of a Set's endpoints, as policies read it.
type view struct {
	// endpoints is the order of the endpoints as configured or discovered;
	// it may name an endpoint twice. states[i] is endpoints[i]'s health;
	// repeats share one, since health is a property of the engine, not of
	// its place in the list.
	endpoints []endpoint.Endpoint
	states    []*health
	// byEP finds an endpoint's health for Report and Healthy in large
	// sets; small ones are scanned (see lookup). nil when small.
	byEP map[endpoint.Endpoint]*health
	// groups holds, per Endpoint.Group, the positions of the group's
	// endpoints. nil when no endpoint has a group.
	groups map[string]group
	// index is what the Set has sent where, by position; a view with other
	// endpoints starts a new one (positions change), see newView.
	index *index
}

// group is the endpoints of one Endpoint.Group, in order, and the group's
// number in its Set.
type group struct {
	members []int
	id      int
}

// health is one endpoint's outlier-detection state and load signals.
//
// Picks only read until, atomically and without locking, so picking never
// waits for a Report. Report changes failures and until together under mu, so
// that the invariant "ejected implies failures >= threshold" holds and
// concurrent Reports cannot leave an ejection behind a reset counter.
type health struct {
	mu sync.Mutex
	// failures counts consecutive failures. Written only under mu; read
	// atomically by Report's lock-free success path.
	failures atomic.Int32
	// until is when the current ejection ends, in nanoseconds since
	// Set.base; 0 means not ejected (admitted).
	until atomic.Int64
	// inFlight counts the requests pdx has on the endpoint (Begin, End),
	// inFlightTokens their prompts' tokens.
	inFlight, inFlightTokens atomic.Int64
	// load is the engine's latest Load (Observe), nil before the first.
	load atomic.Pointer[load]
	// seed is the hash of the endpoint's address: every pdx replica
	// computes the same, for prefix affinity to agree without talking.
	seed uint64
	// ranks counts pdx's requests per DP rank of the endpoint (BeginRank,
	// EndRank); nil without DP ranks (Endpoint.DPSize <= 1).
	ranks *ranks
}

// health fills a cache line exactly (this fails to compile otherwise):
// endpoints' health is allocated together, and Reports on one must not slow
// Picks reading another.
var _ [0]struct{} = [unsafe.Sizeof(health{}) - 64]struct{}{}

// ranks is the in-flight requests on each DP rank of one endpoint, and
// where the next pick starts looking, so that ties go round robin.
type ranks struct {
	next     atomic.Uint32
	inFlight []atomic.Int32
}

// begin picks the rank with the fewest requests in flight, the first from
// next on a tie, and counts one more on it. Two picks at once may see the
// same counts and pick the same rank, as picks of endpoints may: the
// spread is even over time, not exact at every instant.
func (rs *ranks) begin() endpoint.Rank {
	n := uint32(len(rs.inFlight))
	start := rs.next.Add(1) % n
	best, least := start, rs.inFlight[start].Load()
	for i := uint32(1); i < n; i++ {
		k := (start + i) % n
		if c := rs.inFlight[k].Load(); c < least {
			best, least = k, c
		}
	}
	rs.inFlight[best].Add(1)
	return endpoint.RankOf(int(best))
}

// load is a Load as picks read it: times in nanoseconds since Set.base.
type load struct {
	waiting, running int
	kvUsage          float64
	at               int64
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
		threshold:   int32(min(opts.FailureThreshold, 1<<30)),
		coolDown:    int64(opts.CoolDown),
		staleAfter:  int64(opts.StaleAfter),
		saturation:  opts.Saturation,
		indexBlocks: opts.IndexBlocks,
		now:         opts.Now,
	}
	var prev *view
	if opts.Inherit != nil {
		// Shared health holds times relative to base, so share that too.
		s.base = opts.Inherit.base
		prev = opts.Inherit.view.Load()
	} else {
		s.base = s.now()
	}
	s.view.Store(s.newView(endpoints, prev))
	return s
}

// SetEndpoints replaces the set's endpoints with a copy of endpoints, at once
// for every caller: a Pick running concurrently returns an endpoint of the
// old endpoints or of the new ones. Endpoints in both keep their health;
// endpoints that leave lose it (one that comes back starts afresh).
func (s *Set) SetEndpoints(endpoints []endpoint.Endpoint) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.view.Store(s.newView(endpoints, s.view.Load()))
}

// Endpoints returns a copy of the set's endpoints, in order.
func (s *Set) Endpoints() []endpoint.Endpoint {
	return slices.Clone(s.view.Load().endpoints)
}

// newView builds a view of endpoints, taking the health of those that prev
// (which may be nil) has. The caller holds s.mu, or is NewSet.
func (s *Set) newView(endpoints []endpoint.Endpoint, prev *view) *view {
	v := &view{
		endpoints: slices.Clone(endpoints),
		states:    make([]*health, len(endpoints)),
	}
	// A fresh set allocates its health in one block.
	var states []health
	if prev == nil {
		states = make([]health, len(endpoints))
	}
	byEP := make(map[endpoint.Endpoint]*health, len(endpoints))
	for i, ep := range v.endpoints {
		h, ok := byEP[ep]
		if !ok {
			switch h = prev.lookup(ep); {
			case h != nil:
			case states != nil:
				h = &states[i]
			default:
				h = new(health)
			}
			h.seed = xxhash.Sum64String(ep.Address)
			if h.ranks == nil && ep.DPSize > 1 {
				// Endpoints with other DP sizes are other endpoints:
				// an inherited health has its ranks already.
				h.ranks = &ranks{inFlight: make([]atomic.Int32, ep.DPSize)}
			}
			byEP[ep] = h
		}
		v.states[i] = h
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
	if len(v.endpoints) > scanMax {
		v.byEP = byEP
	}
	if prev != nil && slices.Equal(prev.endpoints, v.endpoints) {
		v.index = prev.index
	} else {
		v.index = newIndex(len(v.endpoints), s.indexBlocks)
	}
	return v
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
// endpoint a caller reports is normally the one Pick returned, sharing its
// strings, so comparing is a pointer check per field; hashing the strings
// costs more than scanning a few of those.
const scanMax = 16

// position returns the first position of ep in v, -1 if it has none.
func (v *view) position(ep endpoint.Endpoint) int {
	for i, e := range v.endpoints {
		if e == ep {
			return i
		}
	}
	return -1
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

// Report records the outcome of a call to ep. Success resets ep's
// consecutive failures and re-admits it. Failure counts; the
// FailureThreshold-th consecutive failure ejects ep until now+CoolDown.
// Once the cool-down is over ep is admitted again but keeps its count
// (half-open), so one more failure ejects it again at once, while a success
// clears it.
//
// Failures reported while ep is ejected are counted but do not extend the
// ejection: they are mostly calls picked before it, and would otherwise keep
// an endpoint out for as long as its in-flight requests keep failing.
//
// Reports about endpoints the set does not have are ignored.
func (s *Set) Report(ep endpoint.Endpoint, ok bool) {
	h := s.view.Load().lookup(ep)
	if h == nil {
		return
	}
	if ok {
		// The common case, a success on a healthy endpoint, writes
		// nothing: no lock, no cache-line traffic for Pick. failures == 0
		// implies not ejected (see health).
		if h.failures.Load() == 0 {
			return
		}
		h.mu.Lock()
		h.failures.Store(0)
		h.until.Store(0)
		h.mu.Unlock()
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f := h.failures.Load()
	if f < 1<<30 { // saturate rather than wrap on an endless failure streak
		f++
		h.failures.Store(f)
	}
	if f < s.threshold {
		return
	}
	now := s.elapsed()
	if u := h.until.Load(); u != 0 && now < u {
		return // already ejected
	}
	until := now + s.coolDown
	if until < now { // overflow: a cool-down of "forever"
		until = math.MaxInt64
	}
	// At least 1: 0 means admitted, and a fake clock standing at base with a
	// tiny cool-down must still eject.
	h.until.Store(max(until, 1))
}

// Healthy reports whether ep is currently admitted: a known endpoint that is
// not ejected, or whose cool-down is over.
func (s *Set) Healthy(ep endpoint.Endpoint) bool {
	h := s.view.Load().lookup(ep)
	if h == nil {
		return false
	}
	now := s.clock()
	return now.admits(h)
}

// Begin tells the Set that a request goes to ep, whose prompt has the
// chained block hashes blocks (see Blocks; nil: unknown) and tokens tokens:
// ep has one more request, and tokens more, in flight until End, and is
// taken to hold blocks' KV from now on. Endpoints the set does not have
// are ignored.
func (s *Set) Begin(ep endpoint.Endpoint, blocks []uint64, tokens int) {
	v := s.view.Load()
	h := v.lookup(ep)
	if h == nil {
		return
	}
	h.inFlight.Add(1)
	h.inFlightTokens.Add(int64(tokens))
	if len(blocks) > 0 {
		v.index.add(v.position(ep), blocks)
	}
}

// Matched returns how many leading blocks of blocks the Set has sent to ep
// (see Begin): an estimate of how much of the prompt ep has cached.
func (s *Set) Matched(ep endpoint.Endpoint, blocks []uint64) int {
	v := s.view.Load()
	return v.index.matched(v.position(ep), blocks)
}

// End tells the Set that a request Begin counted on ep, with its tokens, is
// over.
func (s *Set) End(ep endpoint.Endpoint, tokens int) {
	if h := s.view.Load().lookup(ep); h != nil {
		h.inFlight.Add(-1)
		h.inFlightTokens.Add(-int64(tokens))
	}
}

// BeginRank picks the DP rank of ep that is to serve a request, the one
// with the fewest of pdx's requests in flight (ties go round robin), and
// counts the request on it until EndRank. It returns none for an endpoint
// without DP ranks (Endpoint.DPSize <= 1) or that the set does not have.
func (s *Set) BeginRank(ep endpoint.Endpoint) endpoint.Rank {
	h := s.view.Load().lookup(ep)
	if h == nil || h.ranks == nil {
		return endpoint.Rank{}
	}
	return h.ranks.begin()
}

// EndRank tells the Set that a request BeginRank counted on rank of ep is
// over. Ranks that ep does not have (none among them) are ignored.
func (s *Set) EndRank(ep endpoint.Endpoint, rank endpoint.Rank) {
	r, ok := rank.Get()
	if !ok {
		return
	}
	if h := s.view.Load().lookup(ep); h != nil && h.ranks != nil && r < len(h.ranks.inFlight) {
		h.ranks.inFlight[r].Add(-1)
	}
}

// RankInFlight returns how many requests BeginRank counted on DP rank
// rank of ep that have not ended.
func (s *Set) RankInFlight(ep endpoint.Endpoint, rank int) int {
	if h := s.view.Load().lookup(ep); h != nil && h.ranks != nil && rank >= 0 && rank < len(h.ranks.inFlight) {
		return int(h.ranks.inFlight[rank].Load())
	}
	return 0
}

// InFlight returns how many requests Begin counted on ep that have not
// ended.
func (s *Set) InFlight(ep endpoint.Endpoint) int {
	if h := s.view.Load().lookup(ep); h != nil {
		return int(h.inFlight.Load())
	}
	return 0
}

// Observe stores what the engine at address said of its load, for every
// endpoint of the set at that address. It is called off the request path
// (the engine metrics scraper).
func (s *Set) Observe(address string, l Load) {
	v := s.view.Load()
	ld := &load{waiting: l.Waiting, running: l.Running, kvUsage: l.KVUsage, at: int64(l.At.Sub(s.base))}
	for i, ep := range v.endpoints {
		if ep.Address == address {
			v.states[i].load.Store(ld)
		}
	}
}

// Addresses returns the distinct addresses of the set's endpoints, for the
// metrics scraper.
func (s *Set) Addresses() []string {
	var out []string
	for _, ep := range s.view.Load().endpoints {
		if !slices.Contains(out, ep.Address) {
			out = append(out, ep.Address)
		}
	}
	return out
}

// Saturated reports whether every endpoint a request of group may use is
// saturated (see Options.Saturation), ejected endpoints aside. It is false
// when the group has no endpoint: the pick's error says that better.
func (s *Set) Saturated(group string) bool {
	if s.saturation == (Saturation{}) {
		return false
	}
	v := s.view.Load()
	members, _, ok := v.candidates(group)
	n := v.count(members)
	if !ok || n == 0 {
		return false
	}
	now := s.clock()
	some := false
	for k := range n {
		h := v.states[position(members, k)]
		if !now.admits(h) {
			continue
		}
		var g signal
		if now.look(h, &g); !g.saturated {
			return false
		}
		some = true
	}
	return some
}

// elapsed is the time since s.base in nanoseconds, never negative (a fake
// clock may go back before base).
func (s *Set) elapsed() int64 {
	return max(int64(s.now().Sub(s.base)), 0)
}

// clock returns a reading of s's clock for one pick.
func (s *Set) clock() instant { return instant{set: s, ns: -1} }

// instant is one reading of a Set's clock, taken the first time a pick
// meets an ejected endpoint, so that the common case, all admitted, never
// reads the clock.
type instant struct {
	set *Set
	ns  int64 // negative: not read yet
}

// admits reports whether h is not ejected at t.
func (t *instant) admits(h *health) bool {
	u := h.until.Load()
	if u == 0 {
		return true
	}
	return t.read() >= u
}

// read returns the reading, taking it the first time.
func (t *instant) read() int64 {
	if t.ns < 0 {
		t.ns = t.set.elapsed()
	}
	return t.ns
}

// signal is what one pick reads of an endpoint: everything at once, so
// that a policy touches each endpoint's state once.
type signal struct {
	inFlight, inFlightTokens int
	// waiting, running and kvUsage are the engine's load when fresh; else
	// 0, 0 and -1.
	waiting, running int
	kvUsage          float64
	// usable: admitted and not saturated; fresh: the engine's load above
	// is not stale.
	usable, saturated, fresh bool
}

// queue is the load least-request picking counts: the requests waiting or
// running on the engine by its own fresh word, or pdx's in-flight count
// when that is more (the engine's word is up to a scrape old) or the engine
// has none.
func (g *signal) queue() int { return max(g.inFlight, g.waiting+g.running) }

// look reads h at t into g. It writes through a pointer: policies call it
// for every endpoint of every pick, and a returned signal is a copy.
func (t *instant) look(h *health, g *signal) {
	*g = signal{inFlight: int(h.inFlight.Load()), inFlightTokens: int(h.inFlightTokens.Load()), kvUsage: -1}
	admitted := true
	u, l := h.until.Load(), h.load.Load()
	if u != 0 || l != nil {
		now := t.read()
		admitted = now >= u
		if l != nil && now-l.at <= t.set.staleAfter {
			g.fresh, g.waiting, g.running, g.kvUsage = true, l.waiting, l.running, l.kvUsage
		}
	}
	if sat := &t.set.saturation; sat.MaxInFlight > 0 || g.fresh {
		g.saturated = sat.MaxInFlight > 0 && g.inFlight >= sat.MaxInFlight ||
			g.fresh && (sat.QueueDepth > 0 && g.waiting >= sat.QueueDepth || sat.KVUsage > 0 && g.kvUsage >= sat.KVUsage)
	}
	g.usable = admitted && !g.saturated
}

// usable reports whether a pick may take h without panic mode: admitted
// and not saturated.
func (t *instant) usable(h *health) bool {
	if t.set.saturation == (Saturation{}) {
		return t.admits(h)
	}
	var g signal
	t.look(h, &g)
	return g.usable
}

// candidates returns the positions of v's endpoints a request of group may
// use (members nil: all of them), and the group's number (-1 for all). It
// reports false when the group has no endpoint.
func (v *view) candidates(group string) (members []int, id int, ok bool) {
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

// tried reports whether ep is among the endpoints a request has tried.
func tried(ep endpoint.Endpoint, tried []endpoint.Endpoint) bool {
	for _, e := range tried {
		if e == ep {
			return true
		}
	}
	return false
}

// looks reads, into buf when it is long enough, the signals of the
// candidates (members of v) a request may use; signals of the others are
// not usable. It returns the signals by position in members, and how many
// are usable.
func (t *instant) looks(v *view, members []int, req Request, buf []signal) ([]signal, int) {
	n := v.count(members)
	out := buf[:0]
	if n > len(buf) {
		out = make([]signal, 0, n)
	}
	usable := 0
	out = out[:n]
	for k := range out {
		i := position(members, k)
		g := &out[k]
		if req.narrowed() && req.skips(v.endpoints[i]) {
			*g = signal{}
			continue
		}
		if t.look(v.states[i], g); g.usable {
			usable++
		}
	}
	return out, usable
}

// soonest is what a policy returns when every endpoint of members not tried
// is ejected or saturated: an admitted one (saturated) if there is one,
// else the one whose ejection ends first, ties going to the first
// at or after position start (in members' order). Like Envoy's panic mode,
// it assumes the detector is wrong sooner than that the whole leg is down.
// It reports false only when every endpoint has been tried.
func (v *view) soonest(members []int, start int, req Request, now *instant) (endpoint.Endpoint, bool) {
	n := v.count(members)
	best, bestUntil := -1, int64(0)
	for k := range n {
		i := position(members, (start+k)%n)
		if req.skips(v.endpoints[i]) {
			continue
		}
		h := v.states[i]
		if now.admits(h) {
			return v.endpoints[i], true
		}
		if u := h.until.Load(); best < 0 || u < bestUntil {
			best, bestUntil = i, u
		}
	}
	if best < 0 {
		return endpoint.Endpoint{}, false
	}
	return v.endpoints[best], true
}
