package picker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The queue before a new prompt is each slot's rest of work, the waiting
// prompts (pdx's, then the engine's others) taken by the slot free first.
func TestFIFOQueue(t *testing.T) {
	const ns = 1000 // a token a microsecond, per slot
	const perNs = 1.0 / ns
	type lease struct {
		tokens int
		at     int64
	}
	for _, tc := range []struct {
		name        string
		slots       int // as seen at the leases and at the pick
		leases      []lease
		ended       int // leases ended (the first ones), at endedAt
		endedAt     int64
		pickSlots   int
		now         int64
		extra, mean int
		want        queue
	}{
		{name: "idle", slots: 1, pickSlots: 1, want: queue{}},
		{name: "a slot free", slots: 2, pickSlots: 2, leases: []lease{{3000, 0}}, want: queue{ahead: 3000}},
		{name: "one slot: the rest of the running one, the waiting one whole", slots: 1, pickSlots: 1,
			leases: []lease{{1000, 0}, {500, 0}}, now: 400 * ns, want: queue{ahead: 1100, waiting: 1100}},
		{name: "two slots: the one nearly done frees first", slots: 2, pickSlots: 2,
			leases: []lease{{1000, 0}, {3000, 0}, {500, 0}}, now: 900 * ns, want: queue{ahead: 2700, waiting: 600}},
		{name: "computed at most its tokens", slots: 1, pickSlots: 1,
			leases: []lease{{1000, 0}, {500, 0}}, now: 5000 * ns, want: queue{ahead: 500, waiting: 500}},
		{name: "an end gives its slot to the first waiting", slots: 1, pickSlots: 1,
			leases: []lease{{1000, 0}, {500, 0}}, ended: 1, endedAt: 1000 * ns, now: 1200 * ns, want: queue{ahead: 300, waiting: 300}},
		{name: "slots seen after the leases take the waiting", slots: 1, pickSlots: 2,
			leases: []lease{{1000, 0}, {500, 0}}, want: queue{ahead: 1500, waiting: 500}},
		{name: "the engine's other requests wait after pdx's", slots: 2, pickSlots: 2,
			leases: []lease{{1000, 0}}, extra: 2, mean: 400, want: queue{ahead: 1800, waiting: 800}},
		{name: "more slots than modelled", slots: 20, pickSlots: 20,
			leases: make([]lease, 17), want: queue{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var f fifo
			var ids []uint64
			for _, l := range tc.leases {
				ids = append(ids, f.add(l.tokens, l.at, tc.slots))
			}
			for _, id := range ids[:tc.ended] {
				f.remove(id, tc.endedAt, tc.slots)
			}
			require.Equal(t, tc.want, f.queue(tc.now, tc.pickSlots, perNs, tc.extra, tc.mean))
		})
	}
}

// Reading the queue and ending a prefill allocate nothing.
func TestFIFOAllocs(t *testing.T) {
	var f fifo
	for k := range 8 {
		f.add(100*k, 0, 2)
	}
	require.Zero(t, testing.AllocsPerRun(100, func() {
		id := f.add(100, 0, 2) // within the capacity the leases left
		f.queue(10, 2, 0.001, 1, 100)
		f.remove(id, 20, 2)
	}))
}

// On engines of two slots the forecast sends a prompt where a slot frees
// first: behind a prefill nearly done and one just begun rather than
// behind two just begun, though those are fewer tokens in all.
func TestForecastSlotFreesFirst(t *testing.T) {
	eps := endpoints(2)
	clk := newFakeClock()
	set := NewSet(eps, Options{Now: clk.Now})
	for i := range eps {
		set.view.Load().states[i].service.load(2, 1) // two slots, seen in the metrics
	}
	startPrefill(t, set, eps[0], 1500)
	clk.Advance(90 * time.Millisecond) // 1,350 tokens at the seed's 15,000 a second
	startPrefill(t, set, eps[0], 1500)
	startPrefill(t, set, eps[1], 800)
	startPrefill(t, set, eps[1], 800)
	leg := newLeg(set, Forecast{}, RolePrefill)
	got, ok := leg.peek(Request{Tokens: 1000})
	require.True(t, ok)
	require.Equal(t, eps[0], got, "150 tokens to wait for there, 800 on the other")
}

// A prefill lease is in its endpoint's queue from the pick to its end,
// and moves with it.
func TestLeaseQueued(t *testing.T) {
	eps := endpoints(2)
	set := NewSet(eps, Options{})
	queued := func(i int) int {
		f := &set.view.Load().states[i].service.queue
		f.mu.Lock()
		defer f.mu.Unlock()
		return len(f.leases)
	}
	a, b := startPrefill(t, set, eps[0], 100), startPrefill(t, set, eps[0], 200)
	require.Equal(t, 2, queued(0))
	a.End(Succeeded)
	require.Equal(t, 1, queued(0))
	b.Move(eps[1])
	require.Equal(t, [2]int{0, 1}, [2]int{queued(0), queued(1)})
	b.End(Failed)
	require.Equal(t, [2]int{0, 0}, [2]int{queued(0), queued(1)})
	d := newLeg(set, new(RoundRobin), RoleDecode)
	l, ok := d.Pick(Request{Tokens: 100})
	require.True(t, ok)
	require.Equal(t, [2]int{0, 0}, [2]int{queued(0), queued(1)}, "a decode lease is not a prefill's")
	l.End(Released)
}
