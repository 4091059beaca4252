package picker

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

var (
	epA = endpoint.Endpoint{Address: "127.0.0.1:1"}
	epB = endpoint.Endpoint{Address: "127.0.0.1:2"}
	epC = endpoint.Endpoint{Address: "127.0.0.1:3"}
	abc = []endpoint.Endpoint{epA, epB, epC}
)

// fakeClock is a settable clock, safe for concurrent use.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// leg is a round robin leg whose picks lease nothing, as a policy's tests
// want them; its Set's methods (Report, Healthy, ...) are promoted.
type leg struct{ Leg }

func newRR(eps []endpoint.Endpoint, opts Options) leg {
	return leg{newLeg(NewSet(eps, opts), new(RoundRobin), RolePrefill)}
}

// Pick is a pick of a request that tried tried. (It shadows Leg.Pick.)
func (l leg) Pick(tried ...endpoint.Endpoint) (endpoint.Endpoint, bool) {
	return l.peek(Request{Tried: tried})
}

func (l leg) PickGroup(group string, tried ...endpoint.Endpoint) (endpoint.Endpoint, bool) {
	return l.peek(Request{Group: group, Tried: tried})
}

func newTestRR(t testing.TB, threshold int, coolDown time.Duration) (leg, *fakeClock) {
	t.Helper()
	clk := newFakeClock()
	return newRR(abc, Options{FailureThreshold: threshold, CoolDown: coolDown, Now: clk.Now}), clk
}

// picks calls Pick n times and returns what it got, failing on ok=false.
func picks(t *testing.T, rr leg, n int, exclude ...endpoint.Endpoint) []endpoint.Endpoint {
	t.Helper()
	var got []endpoint.Endpoint
	for range n {
		ep, ok := rr.Pick(exclude...)
		require.True(t, ok)
		got = append(got, ep)
	}
	return got
}

func eject(rr leg, ep endpoint.Endpoint, threshold int) {
	for range threshold {
		rr.Report(ep, false)
	}
}

func TestPickOrder(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ejected []endpoint.Endpoint
		exclude []endpoint.Endpoint
		want    []endpoint.Endpoint
	}{
		{name: "all healthy", want: []endpoint.Endpoint{epA, epB, epC, epA, epB, epC, epA}},
		{name: "exclude one", exclude: []endpoint.Endpoint{epB}, want: []endpoint.Endpoint{epA, epC, epA, epC}},
		{name: "exclude two", exclude: []endpoint.Endpoint{epA, epC}, want: []endpoint.Endpoint{epB, epB, epB}},
		{name: "exclude unknown", exclude: []endpoint.Endpoint{{Address: "10.0.0.1:1"}}, want: []endpoint.Endpoint{epA, epB, epC, epA}},
		// A passed-over endpoint uses up its turn, so the others keep an
		// even share instead of its successor getting double.
		{name: "one ejected", ejected: []endpoint.Endpoint{epB}, want: []endpoint.Endpoint{epA, epC, epA, epC, epA, epC}},
		{name: "two ejected", ejected: []endpoint.Endpoint{epA, epB}, want: []endpoint.Endpoint{epC, epC, epC}},
		{name: "ejected and excluded", ejected: []endpoint.Endpoint{epA}, exclude: []endpoint.Endpoint{epC}, want: []endpoint.Endpoint{epB, epB}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr, _ := newTestRR(t, 3, time.Minute)
			for _, ep := range tc.ejected {
				eject(rr, ep, 3)
			}
			require.Equal(t, tc.want, picks(t, rr, len(tc.want), tc.exclude...))
		})
	}
}

func TestOutlierDetection(t *testing.T) {
	// Each step is "F" (report a failure on B), "S" (a success), or "+d"
	// (advance the clock by d), followed by whether B is then healthy.
	type step struct {
		op      string
		healthy bool
	}
	for _, tc := range []struct {
		name      string
		threshold int // 0: the default, 3
		steps     []step
	}{
		{name: "not ejected before the threshold", steps: []step{{"F", true}, {"F", true}, {"+1h", true}, {"F", false}}},
		{name: "ejected at the threshold", threshold: 3, steps: []step{{"F", true}, {"F", true}, {"F", false}}},
		{name: "threshold 1", threshold: 1, steps: []step{{"F", false}}},
		{name: "success resets the count", steps: []step{{"F", true}, {"F", true}, {"S", true}, {"F", true}, {"F", true}, {"F", false}}},
		{name: "success re-admits", steps: []step{{"F", true}, {"F", true}, {"F", false}, {"S", true}, {"F", true}, {"F", true}, {"F", false}}},
		{name: "cool-down expiry re-admits", steps: []step{
			{"F", true}, {"F", true}, {"F", false}, {"+9s", false}, {"+999ms", false}, {"+1ms", true}, {"+1h", true}}},
		{name: "half-open: one failure re-ejects", steps: []step{
			{"F", true}, {"F", true}, {"F", false}, {"+10s", true}, {"F", false}, {"+9s", false}, {"+1s", true}}},
		{name: "half-open: success closes", steps: []step{
			{"F", true}, {"F", true}, {"F", false}, {"+10s", true}, {"S", true}, {"F", true}, {"F", true}, {"F", false}}},
		{name: "failures while ejected do not extend it", steps: []step{
			{"F", true}, {"F", true}, {"F", false}, {"+5s", false}, {"F", false}, {"F", false}, {"+5s", true}, {"F", false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := newFakeClock()
			rr := newRR(abc, Options{FailureThreshold: tc.threshold, CoolDown: 10 * time.Second, Now: clk.Now})
			for i, s := range tc.steps {
				switch {
				case s.op == "F":
					rr.Report(epB, false)
				case s.op == "S":
					rr.Report(epB, true)
				case strings.HasPrefix(s.op, "+"):
					d, err := time.ParseDuration(s.op[1:])
					require.NoError(t, err)
					clk.Advance(d)
				default:
					t.Fatalf("bad step %q", s.op)
				}
				require.Equal(t, s.healthy, rr.Healthy(epB), "after step %d (%s)", i, s.op)
				// Pick agrees with Healthy, and the others are untouched.
				got := picks(t, rr, 3)
				require.Equal(t, s.healthy, containsEP(got, epB), "picks after step %d: %v", i, got)
				require.True(t, rr.Healthy(epA) && rr.Healthy(epC))
			}
		})
	}
}

func containsEP(eps []endpoint.Endpoint, ep endpoint.Endpoint) bool {
	for _, e := range eps {
		if e == ep {
			return true
		}
	}
	return false
}

func TestPanicMode(t *testing.T) {
	for _, tc := range []struct {
		name    string
		exclude []endpoint.Endpoint
		want    endpoint.Endpoint
		ok      bool
	}{
		{name: "earliest cool-down end", want: epA, ok: true},
		{name: "earliest not excluded", exclude: []endpoint.Endpoint{epA}, want: epC, ok: true},
		{name: "only one not excluded", exclude: []endpoint.Endpoint{epA, epC}, want: epB, ok: true},
		{name: "all excluded", exclude: abc, ok: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr, clk := newTestRR(t, 2, 10*time.Second)
			// Ejections end at A: +10s, C: +11s, B: +12s.
			eject(rr, epA, 2)
			clk.Advance(time.Second)
			eject(rr, epC, 2)
			clk.Advance(time.Second)
			eject(rr, epB, 2)
			for range 4 {
				ep, ok := rr.Pick(tc.exclude...)
				require.Equal(t, tc.ok, ok)
				require.Equal(t, tc.want, ep)
			}
		})
	}

	t.Run("healthy but excluded, rest ejected", func(t *testing.T) {
		rr, clk := newTestRR(t, 1, 10*time.Second)
		eject(rr, epC, 1)
		clk.Advance(time.Second)
		eject(rr, epB, 1)
		for range 4 {
			ep, ok := rr.Pick(epA)
			require.True(t, ok)
			require.Equal(t, epC, ep)
		}
	})

	t.Run("a panic pick that succeeds re-admits", func(t *testing.T) {
		rr, _ := newTestRR(t, 1, 10*time.Second)
		for _, ep := range abc {
			eject(rr, ep, 1)
		}
		ep, ok := rr.Pick()
		require.True(t, ok)
		require.Equal(t, epA, ep)
		rr.Report(ep, true)
		require.True(t, rr.Healthy(epA))
		require.Equal(t, []endpoint.Endpoint{epA, epA, epA}, picks(t, rr, 3))
	})
}

func TestAllExcluded(t *testing.T) {
	for _, tc := range []struct {
		name      string
		endpoints []endpoint.Endpoint
		exclude   []endpoint.Endpoint
	}{
		{name: "all excluded", endpoints: abc, exclude: []endpoint.Endpoint{epC, epB, epA}},
		{name: "single excluded", endpoints: []endpoint.Endpoint{epA}, exclude: []endpoint.Endpoint{epA}},
		{name: "empty picker", endpoints: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr := newRR(tc.endpoints, Options{})
			ep, ok := rr.Pick(tc.exclude...)
			require.False(t, ok)
			require.Zero(t, ep)
		})
	}
}

func TestContainsHealthyEndpoints(t *testing.T) {
	eps := []endpoint.Endpoint{epA, epB, epA}
	rr := newRR(eps, Options{FailureThreshold: 1})
	require.True(t, slices.Contains(rr.Endpoints(), epB))
	require.False(t, slices.Contains(rr.Endpoints(), epC))
	require.False(t, rr.Healthy(epC), "unknown endpoints are not healthy")
	rr.Report(epC, false) // ignored

	got := rr.Endpoints()
	require.Equal(t, eps, got)
	got[0] = epC
	require.Equal(t, eps, rr.Endpoints(), "Endpoints returns a copy")
	eps[1] = epC
	require.Equal(t, []endpoint.Endpoint{epA, epB, epA}, rr.Endpoints(), "NewRoundRobin keeps a copy")

	// A repeated endpoint has one health: ejecting it takes out both turns.
	rr.Report(epA, false)
	require.Equal(t, []endpoint.Endpoint{epB, epB, epB}, picks(t, rr, 3))
}

func TestLargePool(t *testing.T) {
	// Past scanMax endpoints are found through a map; same behaviour.
	var eps []endpoint.Endpoint
	for i := range scanMax + 4 {
		eps = append(eps, endpoint.Endpoint{Address: fmt.Sprintf("10.0.0.%d:8000", i+1)})
	}
	eps = append(eps, eps[3]) // a repeat shares its health
	rr := newRR(eps, Options{FailureThreshold: 1})
	require.True(t, slices.Contains(rr.Endpoints(), eps[5]))
	require.False(t, slices.Contains(rr.Endpoints(), epA))
	require.False(t, rr.Healthy(epA))
	rr.Report(eps[3], false)
	require.False(t, rr.Healthy(eps[3]))
	require.True(t, rr.Healthy(eps[4]))
	for range 2 * len(eps) {
		ep, ok := rr.Pick()
		require.True(t, ok)
		require.NotEqual(t, eps[3], ep)
	}
	rr.Report(eps[3], true)
	require.True(t, rr.Healthy(eps[3]))
}

func TestDefaults(t *testing.T) {
	clk := newFakeClock()
	rr := newRR(abc, Options{Now: clk.Now})
	eject(rr, epA, DefaultFailureThreshold-1)
	require.True(t, rr.Healthy(epA))
	rr.Report(epA, false)
	require.False(t, rr.Healthy(epA))
	clk.Advance(DefaultCoolDown - time.Nanosecond)
	require.False(t, rr.Healthy(epA))
	clk.Advance(time.Nanosecond)
	require.True(t, rr.Healthy(epA))

	// The real clock works too.
	rr = newRR(abc, Options{FailureThreshold: 1, CoolDown: time.Hour})
	rr.Report(epA, false)
	require.False(t, rr.Healthy(epA))
}

func TestPickDoesNotAllocate(t *testing.T) {
	rr, _ := newTestRR(t, 1, time.Minute)
	// A pick keeps the request's slices for its duration, so they are on
	// the heap, as requests' are.
	tried := []endpoint.Endpoint{epA}
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.Pick() }))
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.Pick(tried...) }))
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.Report(epA, true) }))
	rr.Report(epB, false)
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.Pick() }))
}

func TestRoundRobinConcurrentIsEven(t *testing.T) {
	eps := []endpoint.Endpoint{epA, epB}
	rr := newRR(eps, Options{})
	var mu sync.Mutex
	counts := map[endpoint.Endpoint]int{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				ep, ok := rr.Pick()
				assert.True(t, ok)
				rr.Report(ep, true)
				mu.Lock()
				counts[ep]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, map[endpoint.Endpoint]int{epA: 400, epB: 400}, counts)
}

// TestConcurrentPickReport runs Picks and Reports together (for -race) with B
// kept ejected, and checks that A and C share the load evenly.
func TestConcurrentPickReport(t *testing.T) {
	const goroutines, perGoroutine = 8, 500
	rr, clk := newTestRR(t, 3, time.Hour)
	eject(rr, epB, 3)

	// Goroutines use assert: require's FailNow must run on the test's own.
	stop := make(chan struct{})
	var bg sync.WaitGroup
	// Meanwhile B keeps failing (which must not re-admit it), the clock
	// moves (not past the cool-down), and metrics read health.
	bg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			rr.Report(epB, false)
			clk.Advance(time.Millisecond)
			assert.False(t, rr.Healthy(epB))
			assert.True(t, rr.Healthy(epA))
		}
	})

	var mu sync.Mutex
	counts := map[endpoint.Endpoint]int{}
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			local := map[endpoint.Endpoint]int{}
			for range perGoroutine {
				ep, ok := rr.Pick()
				assert.True(t, ok)
				rr.Report(ep, true)
				local[ep]++
			}
			mu.Lock()
			for ep, n := range local {
				counts[ep] += n
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	close(stop)
	bg.Wait()

	const total = goroutines * perGoroutine
	require.Zero(t, counts[epB])
	require.Equal(t, total, counts[epA]+counts[epC])
	// Sequentially the split is exact; concurrently a Pick that draws only
	// B's turns falls back to scanning, which may shift a turn or two.
	require.InDelta(t, total/2, counts[epA], total/50, "counts: %v", counts)
}

// TestConcurrentStateChanges flips endpoints in and out while picking, for
// -race: every Pick must still succeed and honour exclude.
func TestConcurrentStateChanges(t *testing.T) {
	rr, clk := newTestRR(t, 2, 5*time.Millisecond)
	var wg sync.WaitGroup
	// Goroutines use assert: require's FailNow must run on the test's own.
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				exclude := abc[:g%3]
				ep, ok := rr.Pick(exclude...)
				assert.True(t, ok)
				assert.False(t, containsEP(exclude, ep))
				rr.Report(ep, (i+g)%3 != 0)
				if i%50 == 0 {
					clk.Advance(time.Millisecond)
				}
				rr.Healthy(ep)
			}
		})
	}
	wg.Wait()
}

func BenchmarkPick(b *testing.B) {
	for _, bc := range []struct {
		name    string
		ejected []endpoint.Endpoint
		exclude []endpoint.Endpoint
	}{
		{name: "healthy"},
		{name: "exclude", exclude: []endpoint.Endpoint{epA}},
		{name: "one ejected", ejected: []endpoint.Endpoint{epB}},
		{name: "all ejected", ejected: abc},
	} {
		b.Run(bc.name, func(b *testing.B) {
			rr := newRR(abc, Options{FailureThreshold: 1, CoolDown: time.Hour})
			for _, ep := range bc.ejected {
				rr.Report(ep, false)
			}
			b.ReportAllocs()
			b.ResetTimer() // the Set's prefix index is made above
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					rr.Pick(bc.exclude...)
				}
			})
		})
	}
}

// BenchmarkPickEnd is a request's whole bookkeeping on a leg: its lease's
// pick and end with an outcome.
func BenchmarkPickEnd(b *testing.B) {
	for _, bc := range []struct {
		name      string
		failEvery int // 0: never
	}{
		{name: "success"},
		{name: "fail 1 in 100", failEvery: 100},
	} {
		b.Run(bc.name, func(b *testing.B) {
			rr := newRR(abc, Options{CoolDown: time.Millisecond})
			b.ReportAllocs()
			b.ResetTimer() // the Set's prefix index is made above
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					lease, _ := rr.Leg.Pick(Request{})
					i++
					if bc.failEvery == 0 || i%bc.failEvery != 0 {
						lease.End(Succeeded)
					} else {
						lease.End(Failed)
					}
				}
			})
		})
	}
}

func TestSetEndpoints(t *testing.T) {
	epD := endpoint.Endpoint{Address: "127.0.0.1:4"}
	for _, tc := range []struct {
		name        string
		next        []endpoint.Endpoint
		wantHealthy map[endpoint.Endpoint]bool // after the swap
		wantPicks   []endpoint.Endpoint
	}{
		{
			// B stays ejected across the swap; A and C keep being healthy.
			name:        "remaining endpoints keep their health",
			next:        []endpoint.Endpoint{epC, epB, epA},
			wantHealthy: map[endpoint.Endpoint]bool{epA: true, epB: false, epC: true},
			wantPicks:   []endpoint.Endpoint{epC, epA, epC, epA},
		},
		{
			name:        "removed endpoints are no longer picked",
			next:        []endpoint.Endpoint{epA},
			wantHealthy: map[endpoint.Endpoint]bool{epA: true, epB: false, epC: false},
			wantPicks:   []endpoint.Endpoint{epA, epA},
		},
		{
			name:        "new endpoints start healthy",
			next:        []endpoint.Endpoint{epB, epD},
			wantHealthy: map[endpoint.Endpoint]bool{epB: false, epD: true},
			wantPicks:   []endpoint.Endpoint{epD, epD},
		},
		{
			name: "empty set picks nothing",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr, _ := newTestRR(t, 1, time.Hour)
			rr.Report(epB, false)
			rr.SetEndpoints(tc.next)
			require.Equal(t, tc.next, rr.Endpoints())
			for ep, want := range tc.wantHealthy {
				require.Equal(t, want, rr.Healthy(ep), ep.Address)
			}
			if len(tc.wantPicks) == 0 {
				_, ok := rr.Pick()
				require.False(t, ok)
				return
			}
			require.Equal(t, tc.wantPicks, picks(t, rr, len(tc.wantPicks)))
		})
	}

	t.Run("an endpoint that leaves and comes back starts afresh", func(t *testing.T) {
		rr, _ := newTestRR(t, 1, time.Hour)
		rr.Report(epB, false)
		rr.SetEndpoints([]endpoint.Endpoint{epA})
		rr.Report(epB, false) // ignored: not an endpoint now
		rr.SetEndpoints(abc)
		require.True(t, rr.Healthy(epB))
	})

	t.Run("the caller's slice is copied", func(t *testing.T) {
		rr, _ := newTestRR(t, 1, time.Hour)
		eps := []endpoint.Endpoint{epA, epB}
		rr.SetEndpoints(eps)
		eps[0] = epC
		require.Equal(t, []endpoint.Endpoint{epA, epB}, rr.Endpoints())
	})
}

func TestPickGroup(t *testing.T) {
	in := func(group string, ep endpoint.Endpoint) endpoint.Endpoint {
		ep.Group = group
		return ep
	}
	a1, b1, c2 := in("g1", epA), in("g1", epB), in("g2", epC)
	ungrouped := endpoint.Endpoint{Address: "127.0.0.1:9"}
	for _, tc := range []struct {
		name    string
		group   string
		ejected []endpoint.Endpoint
		exclude []endpoint.Endpoint
		want    []endpoint.Endpoint // nil: ok=false
	}{
		{name: "round robin within the group", group: "g1", want: []endpoint.Endpoint{a1, b1, a1, b1}},
		{name: "single member", group: "g2", want: []endpoint.Endpoint{c2, c2}},
		{name: "ejected member passed over", group: "g1", ejected: []endpoint.Endpoint{a1}, want: []endpoint.Endpoint{b1, b1}},
		{name: "panic mode stays in the group", group: "g2", ejected: []endpoint.Endpoint{c2}, want: []endpoint.Endpoint{c2}},
		{name: "excluded member", group: "g1", exclude: []endpoint.Endpoint{b1}, want: []endpoint.Endpoint{a1, a1}},
		{name: "all members excluded", group: "g1", exclude: []endpoint.Endpoint{a1, b1}},
		{name: "unknown group", group: "g3"},
		{name: "no group picks among all", group: "", want: []endpoint.Endpoint{a1, ungrouped, c2, b1, a1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rr := newRR([]endpoint.Endpoint{a1, ungrouped, c2, b1}, Options{FailureThreshold: 1, CoolDown: time.Hour})
			for _, ep := range tc.ejected {
				rr.Report(ep, false)
			}
			if tc.want == nil {
				ep, ok := rr.PickGroup(tc.group, tc.exclude...)
				require.False(t, ok)
				require.Zero(t, ep)
				return
			}
			var got []endpoint.Endpoint
			for range tc.want {
				ep, ok := rr.PickGroup(tc.group, tc.exclude...)
				require.True(t, ok)
				got = append(got, ep)
			}
			require.Equal(t, tc.want, got)
		})
	}

	t.Run("groups follow SetEndpoints", func(t *testing.T) {
		rr := newRR([]endpoint.Endpoint{a1, c2}, Options{})
		rr.SetEndpoints([]endpoint.Endpoint{in("g2", epA), c2})
		_, ok := rr.PickGroup("g1")
		require.False(t, ok)
		require.ElementsMatch(t, []endpoint.Endpoint{in("g2", epA), c2},
			[]endpoint.Endpoint{must(rr.PickGroup("g2")), must(rr.PickGroup("g2"))})
	})
}

func must(ep endpoint.Endpoint, ok bool) endpoint.Endpoint {
	if !ok {
		panic("no endpoint")
	}
	return ep
}

func TestInherit(t *testing.T) {
	clk := newFakeClock()
	old := newRR(abc, Options{FailureThreshold: 1, CoolDown: 10 * time.Second, Now: clk.Now})
	old.Report(epB, false)
	clk.Advance(5 * time.Second)

	// The new picker keeps B's ejection (with its end time), not C's
	// absence, and both pickers see each other's Reports afterwards.
	epD := endpoint.Endpoint{Address: "127.0.0.1:4"}
	rr := newRR([]endpoint.Endpoint{epA, epB, epD}, Options{FailureThreshold: 2, CoolDown: time.Minute, Now: clk.Now, Inherit: old.Set})
	require.False(t, rr.Healthy(epB))
	require.True(t, rr.Healthy(epD))
	clk.Advance(5 * time.Second)
	require.True(t, rr.Healthy(epB), "the inherited ejection ends when it would have")
	rr.Report(epA, false)
	require.True(t, rr.Healthy(epA), "one failure is under the new picker's threshold of 2")
	require.True(t, old.Healthy(epA))
	old.Report(epA, false)
	require.False(t, old.Healthy(epA))
	require.False(t, rr.Healthy(epA), "an ejection is the endpoint's, whichever picker heard of it")
	rr.Report(epA, true)
	require.True(t, old.Healthy(epA), "and so is a success")
}

// TestConcurrentSetEndpoints swaps endpoint sets while picking and
// reporting, for -race: every Pick returns an endpoint of one of the sets,
// and B, ejected in every set it is in, is never picked while healthy ones
// exist.
func TestConcurrentSetEndpoints(t *testing.T) {
	rr, _ := newTestRR(t, 1, time.Hour)
	rr.Report(epB, false)
	// Every set has B, so that it keeps its ejection, and a healthy endpoint.
	sets := [][]endpoint.Endpoint{abc, {epA, epB}, {epB, epC}, {epC, epB, epA}}
	stop := make(chan struct{})
	var swapper sync.WaitGroup
	swapper.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			rr.SetEndpoints(sets[i%len(sets)])
		}
	})
	var wg sync.WaitGroup
	// Goroutines use assert: require's FailNow must run on the test's own.
	for range 4 {
		wg.Go(func() {
			for range 2000 {
				ep, ok := rr.Pick()
				assert.True(t, ok)
				assert.Contains(t, abc, ep)
				assert.NotEqual(t, epB, ep)
				rr.Report(ep, true)
				rr.Healthy(ep)
				rr.Endpoints()
			}
		})
	}
	wg.Wait()
	close(stop)
	swapper.Wait()
	require.False(t, rr.Healthy(epB), "B's ejection survived every swap")
}

func TestPickGroupDoesNotAllocate(t *testing.T) {
	a := epA
	a.Group = "g"
	rr := newRR([]endpoint.Endpoint{a, epB}, Options{})
	tried := []endpoint.Endpoint{a}
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.PickGroup("g") }))
	require.Zero(t, testing.AllocsPerRun(100, func() { rr.PickGroup("g", tried...) }))
}
