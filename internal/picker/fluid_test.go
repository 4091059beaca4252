package picker

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
)

// perSecond is a rate of tokens a second in the fluid model's unit.
func perSecond(tokens float64) float64 { return tokens / float64(time.Second) }

// rateOf is the rate the fluid model of ep has learned, in tokens a second.
func rateOf(set *Set, ep endpoint.Endpoint) float64 {
	return math.Float64frombits(set.view.Load().lookup(ep).work.rate.Load()) * float64(time.Second)
}

// teach gives each of eps a busy period of one prefill of tokens that
// answers after d, at once: the rate's first sample, tokens / d.
func teach(t testing.TB, set *Set, clk *fakeClock, tokens int, d time.Duration, eps ...endpoint.Endpoint) {
	t.Helper()
	var leases []*Lease
	for _, ep := range eps {
		leases = append(leases, startPrefill(t, set, ep, tokens))
	}
	clk.Advance(d)
	for _, l := range leases {
		l.End(Succeeded)
	}
}

// remainingOn is what least_work counts of the prefills in flight on ep.
func remainingOn(set *Set, ep endpoint.Endpoint) int {
	c := set.candidates(&Request{}, RolePrefill, true)
	defer c.release()
	k := set.view.Load().position(ep)
	return c.health(k).work.remaining(c.signal(k), &c.now)
}

// flight is a prefill on endpoint ep of tokens, sent at at and answered
// at end (0: still in flight).
type flight struct {
	ep         int
	tokens     int
	at, end    time.Duration
	unanswered bool // the end is not a success
}

// fly runs flights on set from now on, in time order, and leaves the
// clock at now+until.
func fly(t *testing.T, set *Set, clk *fakeClock, role Role, eps []endpoint.Endpoint, flights []flight, until time.Duration) {
	t.Helper()
	type event struct {
		at    time.Duration
		start bool
		i     int
	}
	var events []event
	for i, f := range flights {
		events = append(events, event{at: f.at, start: true, i: i})
		if f.end > 0 {
			events = append(events, event{at: f.end, i: i})
		}
	}
	slices.SortStableFunc(events, func(a, b event) int { return cmp.Compare(a.at, b.at) })
	leases := make([]Lease, len(flights))
	l := newLeg(set, new(RoundRobin), role)
	var now time.Duration
	for _, e := range events {
		clk.Advance(e.at - now)
		now = e.at
		f := flights[e.i]
		if e.start {
			lease, ok := l.Pick(Request{Subset: []string{eps[f.ep].Address}, Tokens: f.tokens})
			require.True(t, ok)
			leases[e.i] = lease
			continue
		}
		o := Succeeded
		if f.unanswered {
			o = Released
		}
		leases[e.i].End(o)
	}
	clk.Advance(until - now)
}

// TestLeastWorkFluid: least_work counts what remains of a prefill by the
// rate its engine has shown, 15k tokens a second here.
func TestLeastWorkFluid(t *testing.T) {
	eps := endpoints(2)
	const a, b = 0, 1
	for _, tc := range []struct {
		name    string
		taught  []int // the endpoints that have shown their rate
		role    Role
		flights []flight
		now     time.Duration
		want    int
	}{
		{name: "a long prefill nearly done beats a fresh shorter one", taught: []int{a, b},
			flights: []flight{{ep: a, tokens: 12000}, {ep: b, tokens: 3000, at: 700 * time.Millisecond}},
			now:     700 * time.Millisecond, want: a},
		{name: "without a learned rate, as before",
			flights: []flight{{ep: a, tokens: 12000}, {ep: b, tokens: 3000, at: 700 * time.Millisecond}},
			now:     700 * time.Millisecond, want: b},
		{name: "the rate is the endpoint's own", taught: []int{b},
			flights: []flight{{ep: a, tokens: 12000}, {ep: b, tokens: 3000, at: 700 * time.Millisecond}},
			now:     700 * time.Millisecond, want: b},
		{name: "a long prefill far from done", taught: []int{a, b},
			flights: []flight{{ep: a, tokens: 12000}, {ep: b, tokens: 3000, at: 200 * time.Millisecond}},
			now:     200 * time.Millisecond, want: b},
		{name: "what answered in the busy period was computed first", taught: []int{a, b},
			// 15k tokens a second over 1 s, 9k of them answered: 6k of
			// the 12k are done.
			flights: []flight{{ep: a, tokens: 9000, end: 600 * time.Millisecond}, {ep: a, tokens: 12000, at: 500 * time.Millisecond},
				{ep: b, tokens: 3000, at: time.Second}},
			now: time.Second, want: b},
		{name: "what answered in the busy period was computed first, later", taught: []int{a, b},
			flights: []flight{{ep: a, tokens: 9000, end: 600 * time.Millisecond}, {ep: a, tokens: 12000, at: 500 * time.Millisecond},
				{ep: b, tokens: 3000, at: 1400 * time.Millisecond}},
			now: 1400 * time.Millisecond, want: a},
		{name: "a prefill that did not answer counts as computed", taught: []int{a, b},
			flights: []flight{{ep: a, tokens: 9000, end: 100 * time.Millisecond, unanswered: true}, {ep: a, tokens: 12000},
				{ep: b, tokens: 3000, at: 700 * time.Millisecond}},
			now: 700 * time.Millisecond, want: b},
		{name: "at most one prefill's worth counts as done", taught: []int{a, b},
			// An engine that stopped answering: long past when they
			// were due, two of the three still count.
			flights: []flight{{ep: a, tokens: 4000}, {ep: a, tokens: 4000}, {ep: a, tokens: 4000},
				{ep: b, tokens: 7000, at: 10 * time.Second}},
			now: 10 * time.Second, want: b},
		{name: "a busy period ends when pdx has nothing there", taught: []int{a, b},
			// a idled from 0.1 s to 5 s: nothing of its new prompt is
			// done at once.
			flights: []flight{{ep: a, tokens: 1500, end: 100 * time.Millisecond}, {ep: a, tokens: 4000, at: 5 * time.Second},
				{ep: b, tokens: 3000, at: 5 * time.Second}},
			now: 5 * time.Second, want: b},
		{name: "a decode leg counts every prompt whole", taught: []int{a, b}, role: RoleDecode,
			flights: []flight{{ep: a, tokens: 12000}, {ep: b, tokens: 3000, at: 700 * time.Millisecond}},
			now:     700 * time.Millisecond, want: b},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			var taught []endpoint.Endpoint
			for _, i := range tc.taught {
				taught = append(taught, eps[i])
			}
			teach(t, set, clk, 15000, time.Second, taught...)
			for _, ep := range taught {
				require.InDelta(t, 15000, rateOf(set, ep), 1e-6)
			}
			fly(t, set, clk, tc.role, eps, tc.flights, tc.now)
			l := newLeg(set, LeastWork{}, tc.role)
			req := Request{Tokens: 1000}
			require.Equal(t, eps[tc.want], must(l.peek(req)))
		})
	}
}

// The rate learned from a steady FCFS sequence converges on the engine's,
// from below (the answers' latency and the engine's idle moments inside
// pdx's busy periods count as busy), from whatever it was before.
func TestFluidRateConverges(t *testing.T) {
	const rate = 20000.0 // the engine's, tokens a second
	const latency = 5 * time.Millisecond
	for _, tc := range []struct {
		name   string
		before float64 // the rate taught first; 0: none
	}{
		{name: "from none"},
		{name: "from too low", before: rate / 50},
		{name: "from too high", before: rate * 50},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(1)
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			if tc.before > 0 {
				teach(t, set, clk, 10000, time.Duration(10000/tc.before*float64(time.Second)), eps[0])
				require.InEpsilon(t, tc.before, rateOf(set, eps[0]), 1e-6)
			}
			// Prompts of 200–2600 tokens every 50–150 ms: the engine is
			// busy about 70% of the time, in busy periods of one to a few.
			var flights []flight
			var arrival, done time.Duration
			for i := range 300 {
				arrival += time.Duration(50+i*104729%100) * time.Millisecond
				tokens := 200 + i*7919%2400
				done = max(done, arrival) + time.Duration(float64(tokens)/rate*float64(time.Second))
				flights = append(flights, flight{tokens: tokens, at: arrival, end: done + latency})
			}
			fly(t, set, clk, RolePrefill, eps, flights, done+latency)
			got := rateOf(set, eps[0])
			require.LessOrEqual(t, got, rate)
			require.Greater(t, got, 0.9*rate)
		})
	}
}

// What least_work counts of a prefill in flight, by the rate learned: none
// counts it whole, as before; the lower the rate, the nearer that (too low
// is never worse than none); a rate too high counts the prefill done, but
// never more than one prefill's worth of an endpoint's.
func TestFluidRateTooLowOrHigh(t *testing.T) {
	const rate = 15000.0
	for _, tc := range []struct {
		name    string
		taught  float64 // tokens a second; 0: none
		flights int     // prefills of 4000 tokens in flight, sent at once
		// want is what remains after 200 ms.
		want int
	}{
		{name: "none", flights: 1, want: 4000},
		{name: "right", taught: rate, flights: 1, want: 1000},
		{name: "a tenth", taught: rate / 10, flights: 1, want: 3700},
		{name: "a thousandth", taught: rate / 1000, flights: 1, want: 3997},
		{name: "too high, one in flight", taught: rate * 100, flights: 1, want: 0},
		{name: "too high, two in flight", taught: rate * 100, flights: 2, want: 4000},
		{name: "too high, four in flight", taught: rate * 100, flights: 4, want: 12000},
		{name: "none, four in flight", flights: 4, want: 16000},
		{name: "right, four in flight", taught: rate, flights: 4, want: 13000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			eps := endpoints(1)
			clk := newFakeClock()
			set := NewSet(eps, Options{Now: clk.Now})
			if tc.taught > 0 {
				teach(t, set, clk, 15000, time.Duration(15000/tc.taught*float64(time.Second)), eps[0])
			}
			for range tc.flights {
				startPrefill(t, set, eps[0], 4000)
			}
			clk.Advance(200 * time.Millisecond)
			require.InDelta(t, tc.want, remainingOn(set, eps[0]), 1, "the model rounds what is done down")
		})
	}
}

// The model's counts through every way a lease ends: End by outcome,
// Detach and Move; decode leases leave it alone.
func TestFluidCounts(t *testing.T) {
	eps := endpoints(2)
	clk := newFakeClock()
	set := NewSet(eps, Options{Now: clk.Now})
	work := func(ep endpoint.Endpoint) (ended, served int64, busyStart time.Duration) {
		f := &set.view.Load().lookup(ep).work
		return f.ended.Load(), f.served.Load(), time.Duration(f.busyStart.Load())
	}

	decode := newLeg(set, new(RoundRobin), RoleDecode)
	d, _ := decode.Pick(Request{Subset: []string{eps[0].Address}, Tokens: 500})
	clk.Advance(time.Second)
	d.End(Succeeded)
	f := &set.view.Load().lookup(eps[0]).work
	require.Equal(t, [6]int64{}, [6]int64{f.busyStart.Load(), f.ended.Load(), f.served.Load(), f.endedAt.Load(), f.servedAt.Load(), int64(f.rate.Load())},
		"decode leases leave the model alone")

	failed, released := startPrefill(t, set, eps[0], 100), startPrefill(t, set, eps[0], 200)
	clk.Advance(time.Second)
	failed.End(Failed)
	released.End(Released)
	ended, served, start := work(eps[0])
	require.Equal(t, [3]any{int64(300), int64(0), time.Second}, [3]any{ended, served, start}, "ended, unanswered")
	require.Zero(t, rateOf(set, eps[0]), "only answers teach the rate")

	moved := startPrefill(t, set, eps[0], 1000)
	clk.Advance(time.Second)
	moved.Move(eps[1])
	ended, served, start = work(eps[0])
	require.Equal(t, [3]any{int64(1300), int64(0), 2 * time.Second}, [3]any{ended, served, start}, "moved away: ended, unanswered")
	clk.Advance(time.Second)
	moved.End(Succeeded)
	ended, served, start = work(eps[1])
	require.Equal(t, [3]any{int64(1000), int64(1000), 3 * time.Second}, [3]any{ended, served, start}, "its busy period starts with the move")
	require.InDelta(t, 1000, rateOf(set, eps[1]), 1e-6)
	require.Zero(t, rateOf(set, eps[0]))

	set.Observe(eps[1].Address, Load{At: clk.Now()})
	detached := startPrefill(t, set, eps[1], 50)
	require.True(t, detached.Detach())
	ended, served, _ = work(eps[1])
	require.Equal(t, [2]int64{1050, 1000}, [2]int64{ended, served}, "detached: ended, unanswered")
	require.InDelta(t, 1000, rateOf(set, eps[1]), 1e-6)
	for _, ep := range eps {
		require.Zero(t, set.InFlight(ep))
		require.Zero(t, set.view.Load().lookup(ep).inFlightTokens.Load())
	}

	// A second answer in a busy period: the tokens answered in it over its
	// time, into the EWMA.
	first, second := startPrefill(t, set, eps[1], 1000), startPrefill(t, set, eps[1], 3000)
	clk.Advance(time.Second)
	first.End(Succeeded) // 1000 in 1 s: 1000 a second, no change
	clk.Advance(time.Second)
	second.End(Succeeded) // 4000 in 2 s
	require.InDelta(t, 1000+(2000-1000)*rateWeight, rateOf(set, eps[1]), 1e-6)
}

// Leases start and end, move and detach on many goroutines while others
// pick: no data race, and the counts come out exact.
func TestFluidConcurrent(t *testing.T) {
	eps := endpoints(4)
	set := NewSet(eps, Options{StaleAfter: time.Hour})
	for _, ep := range eps {
		set.Observe(ep.Address, Load{At: time.Now()})
	}
	leg, err := NewLeg(set, &configv1.Picker{Policy: LeastWorkPolicy}, RolePrefill)
	require.NoError(t, err)
	var ended, served atomic.Int64
	var failed atomic.Int32 // picks or detaches that failed, off the test's goroutine
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 2 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
					leg.peek(Request{Tokens: 1000})
				}
			}
		})
	}
	var workers sync.WaitGroup
	for g := range 8 {
		workers.Go(func() {
			for i := range 300 {
				tokens := 100 + (g*31+i*17)%900
				l, ok := leg.Pick(Request{Tokens: tokens})
				if !ok {
					failed.Add(1)
					continue
				}
				if i%7 == 0 {
					time.Sleep(time.Microsecond)
				}
				ended.Add(int64(l.Tokens()))
				switch i % 5 {
				case 0:
					l.End(Released)
				case 1:
					if !l.Detach() {
						failed.Add(1)
						l.End(Released)
					}
				case 2:
					l.Move(eps[(g+i)%len(eps)])
					ended.Add(int64(l.Tokens()))
					served.Add(int64(l.Tokens()))
					l.End(Succeeded)
				default:
					served.Add(int64(l.Tokens()))
					l.End(Succeeded)
				}
			}
		})
	}
	workers.Wait()
	close(stop)
	wg.Wait()
	require.Zero(t, failed.Load())
	var gotEnded, gotServed int64
	for _, ep := range eps {
		h := set.view.Load().lookup(ep)
		require.Zero(t, h.inFlight.Load())
		require.Zero(t, h.inFlightTokens.Load())
		gotEnded += h.work.ended.Load()
		gotServed += h.work.served.Load()
		r := rateOf(set, ep)
		require.False(t, math.IsNaN(r) || math.IsInf(r, 0) || r < 0, "%s: %v", ep.Address, r)
		require.Equal(t, 0, remainingOn(set, ep))
	}
	require.Equal(t, ended.Load(), gotEnded)
	require.Equal(t, served.Load(), gotServed)
}
