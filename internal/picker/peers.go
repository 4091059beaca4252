package picker

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Several pdx replicas share the prefill engines, each sending a part of
// the prompts. A replica that counts only its own prefills in an engine's
// queue (fifo) sees the others' through the engine's metrics alone, up to a
// scrape old and as requests of mean size: on the cache-bound rig three
// replicas placed 37–39% of prefills where another engine would have
// started them sooner, against 23–27% for one, and sharing the picker
// state between them closed the gap (docs/placement.md, "Three replicas").
// So replicas tell each other their prefill leases: a Set's Journal
// reports its own as they start and end, and the peers' come back through
// PeerStarted and PeerEnded, counted as the Set counts its own. An end
// that the engine answered carries what its replica's service model
// learned from it, so that every replica's model learns from every
// prefill, not from the share it timed.

// PrefillEvent is a prefill lease starting or ending on a Set that writes
// a Journal.
type PrefillEvent struct {
	// Pool is the Set's (Options.Pool), Endpoint the leased endpoint's
	// address, ID the lease's number there (unique per pool and endpoint).
	Pool, Endpoint string
	ID             uint64
	// Tokens are the uncached tokens the lease counts; Start when it was
	// leased; Blocks the prompt's block hashes (Blocks), which every
	// replica computes alike: the peers count them as sent to the
	// endpoint, in the prefix index placement reads without KV events.
	// None is set for an end. Blocks are the request's; nobody writes them
	// after the lease.
	Tokens int
	Start  time.Time
	Blocks []uint64
	Ended  bool
	// Answer is set for an end the engine answered.
	Answer PrefillAnswer
}

// PrefillAnswer is one answered prefill as its replica's service model
// learned it: the time from the pick to the answer, the engine's queue at
// the pick as that replica counted it (its own prefills and its peers'),
// and the uncached tokens the engine computed. Took is 0 for a prefill
// the engine did not answer, which teaches nothing.
type PrefillAnswer struct {
	Took                     time.Duration
	Ahead, Waiting, Computed int
}

// answered reports whether a teaches a service model anything.
func (a PrefillAnswer) answered() bool {
	return a.Took > 0 && a.Ahead >= 0 && a.Waiting >= 0 && a.Computed >= 0
}

// Journal is what one pdx replica tells its peers: its prefill leases in
// flight, for a snapshot, and every start and end, for each reader. It is
// shared by every Set of the replica's routing tables (Options.Journal),
// and safe for concurrent use. A lease's start and end cost a lock and a
// send to each reader; without readers, a lock and a map entry.
type Journal struct {
	mu      sync.Mutex
	open    map[journalKey]openLease
	readers map[*JournalReader]struct{}
}

// openLease is a lease in flight as the Journal keeps it: small enough
// (not a whole PrefillEvent) for the map to hold it in place, without an
// allocation a lease.
type openLease struct {
	tokens int
	start  time.Time
	blocks []uint64
}

type journalKey struct {
	pool, endpoint string
	id             uint64
}

// JournalReader is one reader of a Journal (Subscribe).
type JournalReader struct {
	c    chan PrefillEvent
	lost atomic.Bool
}

// NewJournal returns an empty Journal.
func NewJournal() *Journal {
	return &Journal{open: map[journalKey]openLease{}, readers: map[*JournalReader]struct{}{}}
}

// Subscribe returns the leases in flight now and a reader of every start
// and end after them, with room for buffer events: a reader that falls
// that far behind is dropped (its channel closes, Lost reports true), to
// subscribe again, rather than slowing the leases.
func (j *Journal) Subscribe(buffer int) ([]PrefillEvent, *JournalReader) {
	r := &JournalReader{c: make(chan PrefillEvent, max(buffer, 1))}
	j.mu.Lock()
	defer j.mu.Unlock()
	snapshot := make([]PrefillEvent, 0, len(j.open))
	for k, l := range j.open {
		snapshot = append(snapshot, PrefillEvent{Pool: k.pool, Endpoint: k.endpoint, ID: k.id, Tokens: l.tokens, Start: l.start, Blocks: l.blocks})
	}
	j.readers[r] = struct{}{}
	// In lease order, as the engines' queues have them.
	slices.SortFunc(snapshot, func(a, b PrefillEvent) int { return a.Start.Compare(b.Start) })
	return snapshot, r
}

// Unsubscribe stops r; its channel closes if it has not.
func (j *Journal) Unsubscribe(r *JournalReader) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, ok := j.readers[r]; ok {
		delete(j.readers, r)
		close(r.c)
	}
}

// Events are the starts and ends after the snapshot; closed once the
// reader is unsubscribed or lost.
func (r *JournalReader) Events() <-chan PrefillEvent { return r.c }

// Lost reports whether r fell behind and was dropped (Events closed).
func (r *JournalReader) Lost() bool { return r.lost.Load() }

// record sends e to every reader, dropping one without room. j.mu is held.
func (j *Journal) record(e PrefillEvent) {
	for r := range j.readers {
		select {
		case r.c <- e:
		default:
			r.lost.Store(true)
			delete(j.readers, r)
			close(r.c)
		}
	}
}

// MaxPeerBlocks bounds the blocks of a prompt a replica tells its peers,
// so that a line of them fits the 64 KB in which a replica reads a line
// (replicas of the versions before MaxBlocks grew to 4,096 too).
const MaxPeerBlocks = 1024

func (j *Journal) started(pool, endpoint string, id uint64, tokens int, blocks []uint64) {
	blocks = blocks[:min(len(blocks), MaxPeerBlocks)]
	e := PrefillEvent{Pool: pool, Endpoint: endpoint, ID: id, Tokens: tokens, Start: time.Now(), Blocks: blocks}
	j.mu.Lock()
	defer j.mu.Unlock()
	j.open[journalKey{pool, endpoint, id}] = openLease{tokens: tokens, start: e.Start, blocks: blocks}
	j.record(e)
}

func (j *Journal) ended(pool, endpoint string, id uint64, a PrefillAnswer) {
	k := journalKey{pool, endpoint, id}
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, ok := j.open[k]; !ok {
		return
	}
	delete(j.open, k)
	j.record(PrefillEvent{Pool: pool, Endpoint: endpoint, ID: id, Ended: true, Answer: a})
}

// peerBook is the peers' prefill leases a Set counts, shared with the Sets
// that inherit it: a lease counted before a reload ends on the same health.
type peerBook struct {
	mu     sync.Mutex
	leases map[peerKey]peerLease
}

type peerKey struct {
	peer, endpoint string
	id             uint64
}

type peerLease struct {
	h      *health
	queued uint64
	tokens int
}

// PeerStarted counts a peer's prefill lease of tokens uncached tokens on
// the endpoint at address, leased age ago, as the Set counts its own: in
// the endpoint's in-flight requests and tokens (so that the engine's
// metrics' requests beyond them shrink to those no replica sent), in its
// queue, and its prompt's blocks (Blocks, at most MaxBlocks read) as sent
// there. peer names the replica; id is its number for the lease. A lease
// counted already, or on an endpoint the Set does not have, is ignored.
func (s *Set) PeerStarted(peer, address string, id uint64, tokens int, age time.Duration, blocks []uint64) {
	v := s.view.Load()
	i := v.byAddress(address)
	if i < 0 || v.states[i].service == nil {
		return
	}
	h := v.states[i]
	k := peerKey{peer, address, id}
	b := s.peers
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.leases[k]; ok {
		return
	}
	tokens = max(tokens, 0)
	s.count(h, tokens, true)
	queued := h.service.queue.add(tokens, s.elapsed()-max(int64(age), 0), h.service.slotsSeen())
	b.leases[k] = peerLease{h: h, queued: queued, tokens: tokens}
	if len(blocks) > 0 {
		v.index.add(v.first[i], blocks[:min(len(blocks), MaxBlocks)])
	}
}

// PeerEnded stops counting the peer's lease id on the endpoint at address;
// an answer the engine gave it (a.Took > 0) teaches the endpoint's service
// model as the Set's own prefills' do. Only a lease the Set counted
// teaches: one on an endpoint it lacks, or whose start it missed, not.
func (s *Set) PeerEnded(peer, address string, id uint64, a PrefillAnswer) {
	b := s.peers
	b.mu.Lock()
	l, ok := b.leases[peerKey{peer, address, id}]
	if ok {
		delete(b.leases, peerKey{peer, address, id})
		s.uncountPeer(l, a)
	}
	b.mu.Unlock()
	if ok {
		s.room.wake()
	}
}

// PeerGone stops counting every lease of peer: its stream ended, and a
// new one starts with a snapshot.
func (s *Set) PeerGone(peer string) {
	b := s.peers
	b.mu.Lock()
	n := 0
	for k, l := range b.leases {
		if k.peer == peer {
			delete(b.leases, k)
			s.uncountPeer(l, PrefillAnswer{})
			n++
		}
	}
	b.mu.Unlock()
	if n > 0 {
		s.room.wake()
	}
}

// PeerLeases is how many of the peers' leases the Set counts.
func (s *Set) PeerLeases() int {
	s.peers.mu.Lock()
	defer s.peers.mu.Unlock()
	return len(s.peers.leases)
}

// uncountPeer takes a peer's lease off its endpoint, learning from its
// answer a if it has one. b.mu is held.
func (s *Set) uncountPeer(l peerLease, a PrefillAnswer) {
	h := l.h
	h.service.queue.remove(l.queued, s.elapsed(), h.service.slotsSeen())
	answered := a.answered()
	h.work.end(s, l.tokens, answered)
	if answered {
		h.service.learn(a.Took.Seconds(), queue{ahead: a.Ahead, waiting: a.Waiting}, a.Computed)
	}
	h.inFlight.Add(-1)
	h.inFlightTokens.Add(-int64(l.tokens))
}

// byAddress returns the position of v's first endpoint at address, -1 if
// none is.
func (v *view) byAddress(address string) int {
	for i, ep := range v.endpoints {
		if ep.Address == address {
			return i
		}
	}
	return -1
}
