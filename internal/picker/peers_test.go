package picker

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// A peer's prefill lease counts on its endpoint as the Set's own do: in
// flight, with its tokens, in the queue, from when the peer leased it;
// until it ends, its peer goes, or never when the Set lacks the endpoint.
func TestPeerLeases(t *testing.T) {
	type start struct {
		peer, address string
		id            uint64
		tokens        int
		age           time.Duration
	}
	a, b := epA.Address, epB.Address
	for _, tc := range []struct {
		name    string
		started []start
		ended   []start // by peer, address and id
		gone    []string
		// want are the in-flight requests and tokens on epA, and the
		// tokens queued ahead of a prompt there (one slot).
		wantInFlight, wantTokens, wantAhead int
		wantLeases                          int
	}{
		{name: "counted", started: []start{{"p1", a, 1, 500, 0}}, wantInFlight: 1, wantTokens: 500, wantAhead: 500, wantLeases: 1},
		{name: "counted once", started: []start{{"p1", a, 1, 500, 0}, {"p1", a, 1, 500, 0}}, wantInFlight: 1, wantTokens: 500, wantAhead: 500, wantLeases: 1},
		// 10 ms at the seed's 15,000 tokens a second: 150 computed.
		{name: "computed since its start", started: []start{{"p1", a, 1, 500, 10 * time.Millisecond}}, wantInFlight: 1, wantTokens: 500, wantAhead: 350, wantLeases: 1},
		{name: "two peers, same number", started: []start{{"p1", a, 1, 500, 0}, {"p2", a, 1, 300, 0}}, wantInFlight: 2, wantTokens: 800, wantAhead: 800, wantLeases: 2},
		{name: "other endpoint", started: []start{{"p1", b, 1, 500, 0}}, wantLeases: 1},
		{name: "endpoint the Set lacks", started: []start{{"p1", "127.0.0.1:9", 1, 500, 0}}},
		{name: "ended", started: []start{{"p1", a, 1, 500, 0}, {"p1", a, 2, 200, 0}}, ended: []start{{"p1", a, 1, 0, 0}},
			wantInFlight: 1, wantTokens: 200, wantAhead: 200, wantLeases: 1},
		{name: "end of another's number", started: []start{{"p1", a, 1, 500, 0}}, ended: []start{{"p2", a, 1, 0, 0}, {"p1", b, 1, 0, 0}},
			wantInFlight: 1, wantTokens: 500, wantAhead: 500, wantLeases: 1},
		{name: "peer gone", started: []start{{"p1", a, 1, 500, 0}, {"p1", b, 2, 500, 0}, {"p2", a, 1, 300, 0}}, gone: []string{"p1"},
			wantInFlight: 1, wantTokens: 300, wantAhead: 300, wantLeases: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clock := newFakeClock()
			set := NewSet(abc, Options{Now: clock.Now})
			clock.Advance(time.Second)
			for _, s := range tc.started {
				set.PeerStarted(s.peer, s.address, s.id, s.tokens, s.age, nil)
			}
			for _, s := range tc.ended {
				set.PeerEnded(s.peer, s.address, s.id, PrefillAnswer{})
			}
			for _, p := range tc.gone {
				set.PeerGone(p)
			}
			h := set.view.Load().lookup(epA)
			require.Equal(t, tc.wantInFlight, set.InFlight(epA))
			require.EqualValues(t, tc.wantTokens, h.inFlightTokens.Load())
			require.Equal(t, tc.wantAhead, h.service.queueNow(set.elapsed(), 0, 0).ahead)
			require.Equal(t, tc.wantLeases, set.PeerLeases())

			for _, p := range []string{"p1", "p2"} {
				set.PeerGone(p)
			}
			for _, ep := range abc {
				require.Zero(t, set.InFlight(ep), "every peer gone: nothing left on %s", ep.Address)
			}
			require.Zero(t, h.service.queueNow(set.elapsed(), 0, 0).ahead)
		})
	}
}

// A peer's lease queues behind the Set's own as the engine's slots take
// them: with two slots, the third prefill waits for the one free first.
func TestPeerLeaseQueues(t *testing.T) {
	clock := newFakeClock()
	set := NewSet(abc, Options{Now: clock.Now})
	h := set.view.Load().lookup(epA)
	h.service.load(2, 1) // seen computing two prompts with one waiting
	own := newLeg(set, new(RoundRobin), RolePrefill)
	lease, ok := own.Pick(Request{Subset: []string{epA.Address}, Tokens: 1500})
	require.True(t, ok)
	set.PeerStarted("p1", epA.Address, 1, 300, 0, nil)
	q := h.service.queueNow(set.elapsed(), 0, 0)
	require.Equal(t, queue{ahead: 1800, waiting: 300}, q, "both slots taken: a prompt waits for the shorter")

	set.PeerStarted("p1", epA.Address, 2, 900, 0, nil)
	q = h.service.queueNow(set.elapsed(), 0, 0)
	require.Equal(t, queue{ahead: 2700, waiting: 1200}, q, "the waiting one takes the slot free first (300 + 900), then the prompt waits for that one")

	lease.End(Released)
	set.PeerEnded("p1", epA.Address, 1, PrefillAnswer{})
	q = h.service.queueNow(set.elapsed(), 0, 0)
	require.Equal(t, queue{ahead: 900, waiting: 0}, q)
	set.PeerGone("p1")
	require.Zero(t, set.InFlight(epA))
}

// A peer's prompt blocks count as sent to its endpoint, after its prefill
// too (the engine keeps the cache): a later prompt sharing them goes there
// by a policy reading the prefix, as if this replica had sent the first.
func TestPeerBlocks(t *testing.T) {
	prompt := []byte(strings.Repeat("a conversation's first turn. ", 40))
	blocks := Blocks(nil, prompt, 16)
	require.Greater(t, len(blocks), 4)
	set := NewSet(abc, Options{})
	set.PeerStarted("p1", epB.Address, 1, 100, 0, blocks)
	set.PeerEnded("p1", epB.Address, 1, PrefillAnswer{})
	require.Equal(t, len(blocks), set.Sent(epB, blocks))
	require.Zero(t, set.Sent(epA, blocks))

	leg := newLeg(set, &LoadAware{w: Weights{Prefix: 1}}, RolePrefill)
	next := Blocks(nil, append(prompt, "and its second."...), 16)
	for range 3 {
		l, ok := leg.Pick(Request{Blocks: next, BlockTokens: 16, Tokens: 400})
		require.True(t, ok)
		require.Equal(t, epB, l.Endpoint())
		l.End(Released)
	}

	// A peer's line has at most MaxBlocks blocks read.
	long := make([]uint64, MaxBlocks+8)
	for k := range long {
		long[k] = uint64(k + 1)
	}
	set.PeerStarted("p1", epC.Address, 2, 100, 0, long)
	require.Equal(t, MaxBlocks, set.Sent(epC, long))
}

// A reloaded Set keeps counting the peers' leases its predecessor counted,
// and their ends reach them.
func TestPeerLeasesInherited(t *testing.T) {
	old := NewSet(abc, Options{})
	old.PeerStarted("p1", epA.Address, 1, 500, 0, nil)
	set := NewSet(abc, Options{Inherit: old})
	require.Equal(t, 1, set.InFlight(epA))
	require.Equal(t, 1, set.PeerLeases())
	set.PeerEnded("p1", epA.Address, 1, PrefillAnswer{})
	require.Zero(t, set.InFlight(epA))
	require.Zero(t, old.PeerLeases())
}

// The journal hears a Set's prefill leases start and end, moves
// included; a reader gets the leases open when it subscribed, then each
// start and end, and one that falls behind is dropped rather than
// slowing the leases.
func TestJournal(t *testing.T) {
	j := NewJournal()
	clock := newFakeClock()
	set := NewSet(abc, Options{Journal: j, Pool: "demo", Now: clock.Now})
	prefill := newLeg(set, new(RoundRobin), RolePrefill)
	first, ok := prefill.Pick(Request{Subset: []string{epA.Address}, Tokens: 400})
	require.True(t, ok)

	snapshot, r := j.Subscribe(16)
	require.Len(t, snapshot, 1)
	require.Equal(t, PrefillEvent{Pool: "demo", Endpoint: epA.Address, ID: 1, Tokens: 400, Start: snapshot[0].Start}, snapshot[0])
	require.False(t, snapshot[0].Start.IsZero())

	blocks := []uint64{7, 8}
	second, ok := prefill.Pick(Request{Subset: []string{epB.Address}, Tokens: 200, Blocks: blocks, BlockTokens: 16})
	require.True(t, ok)
	second.Move(epC)
	clock.Advance(30 * time.Millisecond)
	first.Observe(400, 100) // the engine found 100 cached
	first.End(Succeeded)
	second.End(Released)
	first.End(Released) // ended once: heard once
	want := []PrefillEvent{
		{Pool: "demo", Endpoint: epB.Address, ID: 1, Tokens: 200, Blocks: blocks},
		{Pool: "demo", Endpoint: epB.Address, ID: 1, Ended: true},
		{Pool: "demo", Endpoint: epC.Address, ID: 1, Tokens: 200, Blocks: blocks},
		// Answered: what epA's model learned, nothing ahead of it.
		{Pool: "demo", Endpoint: epA.Address, ID: 1, Ended: true, Answer: PrefillAnswer{Took: 30 * time.Millisecond, Computed: 300}},
		{Pool: "demo", Endpoint: epC.Address, ID: 1, Ended: true},
	}
	for _, w := range want {
		got := <-r.Events()
		require.Equal(t, w.Ended, got.Start.IsZero(), "a start has its time, an end none")
		got.Start = time.Time{}
		require.Equal(t, w, got)
	}
	require.Empty(t, r.Events())

	// A long prompt's peers hear its first MaxPeerBlocks blocks.
	long := make([]uint64, MaxPeerBlocks+8)
	third, ok := prefill.Pick(Request{Subset: []string{epA.Address}, Tokens: 200, Blocks: long, BlockTokens: 16})
	require.True(t, ok)
	require.Len(t, (<-r.Events()).Blocks, MaxPeerBlocks)
	third.End(Released)
	require.True(t, (<-r.Events()).Start.IsZero(), "its end")

	decode := newLeg(set, new(RoundRobin), RoleDecode)
	d, _ := decode.Pick(Request{Tokens: 100})
	d.End(Released)
	require.Empty(t, r.Events(), "a decode lease is not a prefill")

	slow := func() *JournalReader { _, s := j.Subscribe(1); return s }()
	for range 2 {
		l, _ := prefill.Pick(Request{Subset: []string{epA.Address}, Tokens: 10})
		l.End(Released)
	}
	require.True(t, slow.Lost())
	require.Len(t, slow.Events(), 1, "what it had room for")
	<-slow.Events()
	_, open := <-slow.Events()
	require.False(t, open, "a lost reader's channel closes")
	j.Unsubscribe(slow) // a no-op once lost

	require.False(t, r.Lost())
	j.Unsubscribe(r)
	for range r.Events() {
	}
	snapshot, r = j.Subscribe(1)
	require.Empty(t, snapshot, "every lease ended")
	j.Unsubscribe(r)
}

// A replica learns from its peers' answered prefills as from its own:
// fed a replica's journal, a Set's service model for each engine is the
// one of the replica that timed the prefills, sample for sample; an end
// the engine did not answer, or of a lease the Set never counted, teaches
// nothing.
func TestPeerAnswersTeach(t *testing.T) {
	j := NewJournal()
	clock := newFakeClock()
	timer := NewSet(abc, Options{Journal: j, Pool: "demo", Now: clock.Now})
	peer := NewSet(abc, Options{Pool: "demo", Now: clock.Now})
	_, r := j.Subscribe(1 << 10)
	defer j.Unsubscribe(r)
	relay := func() {
		for len(r.Events()) > 0 {
			e := <-r.Events()
			if e.Ended {
				peer.PeerEnded("timer", e.Endpoint, e.ID, e.Answer)
			} else {
				peer.PeerStarted("timer", e.Endpoint, e.ID, e.Tokens, 0, e.Blocks)
			}
		}
	}
	prefill := newLeg(timer, new(RoundRobin), RolePrefill)
	// Prompts of 200 to 1,800 tokens, three at a time on each engine, each
	// answered 5 ms plus its queue's and its own tokens at 20,000 a
	// second later.
	for k := range 60 {
		var leases []Lease
		for i := range 3 {
			l, ok := prefill.Pick(Request{Subset: []string{epA.Address, epB.Address}, Tokens: 200 + 400*((k+i)%5)})
			require.True(t, ok)
			leases = append(leases, l)
		}
		relay()
		for i := range leases {
			clock.Advance(5*time.Millisecond + time.Duration(leases[i].Tokens())*50*time.Microsecond)
			leases[i].End(Succeeded)
		}
		relay()
	}
	for _, ep := range []endpoint.Endpoint{epA, epB} {
		want, _ := timer.Service(ep)
		got, _ := peer.Service(ep)
		require.Equal(t, int64(90), want.Samples)
		require.Equal(t, want, got, "%s: the peer's model is the timer's", ep.Address)
		require.Zero(t, peer.InFlight(ep))
	}

	unanswered, _ := prefill.Pick(Request{Subset: []string{epA.Address}, Tokens: 500})
	relay()
	clock.Advance(time.Second)
	unanswered.End(Failed)
	relay()
	// A lease the peer never counted (started before it read the journal
	// and missed from its snapshot): its answer is not learned.
	peer.PeerEnded("timer", epA.Address, 999, PrefillAnswer{Took: time.Second, Computed: 100})
	got, _ := peer.Service(epA)
	require.Equal(t, int64(90), got.Samples, "neither end teaches")
	require.Zero(t, peer.InFlight(epA))
}

// A prefill's lease, its end and the learning from it allocate nothing
// with a journal, heard by a reader or not: the open leases' map keeps
// its room.
func TestJournalLeaseAllocs(t *testing.T) {
	j := NewJournal()
	prefill := newLeg(NewSet(abc, Options{Journal: j, Pool: "demo"}), new(RoundRobin), RolePrefill)
	req := Request{Subset: []string{epA.Address}, Tokens: 10}
	lease := func() {
		l, _ := prefill.Pick(req)
		l.End(Succeeded)
	}
	lease()
	require.Zero(t, testing.AllocsPerRun(100, lease))
	_, r := j.Subscribe(1 << 10)
	defer j.Unsubscribe(r)
	require.Zero(t, testing.AllocsPerRun(100, lease))
	require.Len(t, r.Events(), 2*101, "every start and end heard")
}

// BenchmarkPrefillLease is a prefill's lease and end on one endpoint,
// without a journal and with one told to no reader and to two (a replica
// with two peers; their readers drain their events as they come).
func BenchmarkPrefillLease(b *testing.B) {
	for _, tc := range []struct {
		name    string
		journal bool
		readers int
	}{{"no journal", false, 0}, {"journal, no reader", true, 0}, {"journal, two readers", true, 2}} {
		b.Run(tc.name, func(b *testing.B) {
			opts := Options{Pool: "demo"}
			if tc.journal {
				opts.Journal = NewJournal()
				for range tc.readers {
					_, r := opts.Journal.Subscribe(1 << 14)
					go func() {
						for range r.Events() {
						}
					}()
					defer opts.Journal.Unsubscribe(r)
				}
			}
			l := newLeg(NewSet(abc, opts), new(RoundRobin), RolePrefill)
			req := Request{Subset: []string{epA.Address}, Tokens: 512}
			b.ReportAllocs()
			for b.Loop() {
				lease, _ := l.Pick(req)
				lease.End(Succeeded)
			}
		})
	}
}
