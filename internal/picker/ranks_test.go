package picker

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// rankCounts is what the Set counts on each DP rank of ep.
func rankCounts(s *Set, ep endpoint.Endpoint) []int {
	h := s.view.Load().lookup(ep)
	if h == nil || h.ranks == nil {
		return nil
	}
	out := make([]int, len(h.ranks.inFlight))
	for i := range h.ranks.inFlight {
		out[i] = int(h.ranks.inFlight[i].Load())
	}
	return out
}

func rankNumbers(rs ...endpoint.Rank) []int {
	out := make([]int, len(rs))
	for i, r := range rs {
		n, ok := r.Get()
		if !ok {
			n = -1
		}
		out[i] = n
	}
	return out
}

// leaseOn leases ep of s for a request (NoRank: one that names no rank).
func leaseOn(t testing.TB, s *Set, ep endpoint.Endpoint, noRank bool) *Lease {
	t.Helper()
	l := newLeg(s, new(RoundRobin), RoleDecode)
	lease, ok := l.Pick(Request{Subset: []string{ep.Address}, NoRank: noRank})
	require.True(t, ok)
	require.Equal(t, ep, lease.Endpoint())
	return &lease
}

func TestLeaseRank(t *testing.T) {
	dp4 := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 4}
	dp1 := endpoint.Endpoint{Address: "10.0.0.2:8000", DPSize: 1}
	none := endpoint.Endpoint{Address: "10.0.0.3:8000"}
	for _, tc := range []struct {
		name string
		// run leases ranks on a fresh set; it returns the ranks leased and
		// the endpoint whose counts are then checked.
		run        func(s *Set) ([]endpoint.Rank, endpoint.Endpoint)
		wantRanks  []int
		wantCounts []int
	}{
		{"each rank once before any twice", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			var got []endpoint.Rank
			for range 8 {
				got = append(got, leaseOn(t, s, dp4, false).Rank())
			}
			return got, dp4
		}, []int{1, 2, 3, 0, 1, 2, 3, 0}, []int{2, 2, 2, 2}},
		{"the least loaded rank wins over the turn", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			a, b, c := leaseOn(t, s, dp4, false), leaseOn(t, s, dp4, false), leaseOn(t, s, dp4, false) // 1, 2, 3
			ranks := []endpoint.Rank{a.Rank(), b.Rank(), c.Rank()}
			b.DropRank() // rank 2 is free again
			// Ranks 0 and 2 have none: the turn (from rank 0) takes 0,
			// then the only free one is 2.
			return append(ranks, leaseOn(t, s, dp4, false).Rank(), leaseOn(t, s, dp4, false).Rank()), dp4
		}, []int{1, 2, 3, 0, 2}, []int{1, 1, 1, 1}},
		{"ended requests free their rank", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			var got []endpoint.Rank
			for range 6 {
				l := leaseOn(t, s, dp4, false)
				got = append(got, l.Rank())
				l.End(Released)
			}
			return got, dp4
		}, []int{1, 2, 3, 0, 1, 2}, []int{0, 0, 0, 0}},
		{"an engine of one rank gets none", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			return []endpoint.Rank{leaseOn(t, s, dp1, false).Rank(), leaseOn(t, s, none, false).Rank()}, dp1
		}, []int{-1, -1}, nil},
		{"a lease moved to an endpoint the set does not have has none", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			other := endpoint.Endpoint{Address: "10.0.0.9:8000", DPSize: 4}
			l := leaseOn(t, s, dp4, false)
			l.Move(other)
			r := l.Rank()
			l.End(Released) // ignored
			return []endpoint.Rank{r}, other
		}, []int{-1}, nil},
		{"drops of none are ignored", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			r := leaseOn(t, s, dp4, false).Rank()
			leaseOn(t, s, dp4, true).DropRank()
			leaseOn(t, s, dp1, false).DropRank()
			return []endpoint.Rank{r}, dp4
		}, []int{1}, []int{0, 1, 0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSet([]endpoint.Endpoint{dp4, dp1, none}, Options{})
			got, ep := tc.run(s)
			require.Equal(t, tc.wantRanks, rankNumbers(got...))
			require.Equal(t, tc.wantCounts, rankCounts(s, ep))
		})
	}
}

func TestLeaseRankKeepsCountsAcrossEndpointChanges(t *testing.T) {
	dp2 := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 2}
	other := endpoint.Endpoint{Address: "10.0.0.2:8000", DPSize: 2}
	s := NewSet([]endpoint.Endpoint{dp2}, Options{})
	l := leaseOn(t, s, dp2, false)
	s.SetEndpoints([]endpoint.Endpoint{other, dp2})
	require.Equal(t, []int{0, 1}, rankCounts(s, dp2), "the new view shares the endpoint's counts")
	l.End(Released)
	require.Equal(t, []int{0, 0}, rankCounts(s, dp2))
	// A rebuilt table's set inherits them too.
	next := NewSet([]endpoint.Endpoint{dp2}, Options{Inherit: s})
	l = leaseOn(t, next, dp2, false)
	require.Equal(t, []int{1, 0}, rankCounts(s, dp2), "the turn goes on too")
	l.End(Released)
	require.Equal(t, []int{0, 0}, rankCounts(s, dp2))
}

func TestLeaseRankConcurrent(t *testing.T) {
	const size, workers, rounds = 4, 8, 500
	ep := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: size}
	s := NewSet([]endpoint.Endpoint{ep}, Options{})
	leg := newLeg(s, new(RoundRobin), RoleDecode)

	// Requests held at once: each rank gets one. (The pick whose turn
	// starts at rank k sees it free unless another took it.)
	held := make([]Lease, workers)
	var wg sync.WaitGroup
	for i := range held {
		wg.Go(func() { held[i], _ = leg.Pick(Request{}) })
	}
	wg.Wait()
	counts := rankCounts(s, ep)
	for r, n := range counts {
		require.Positive(t, n, "rank %d of %v", r, counts)
	}

	// Requests coming and going from many goroutines (run with -race).
	for range workers {
		wg.Go(func() {
			for range rounds {
				l, _ := leg.Pick(Request{})
				if n, ok := l.Rank().Get(); !ok || n >= size {
					t.Errorf("rank %v of %d", l.Rank(), size)
					return
				}
				l.End(Released)
			}
		})
	}
	wg.Wait()
	require.Equal(t, counts, rankCounts(s, ep), "every request that came and went released its rank")
	for i := range held {
		held[i].End(Released)
	}
	require.Equal(t, []int{0, 0, 0, 0}, rankCounts(s, ep))
}

func TestLeaseRankDoesNotAllocate(t *testing.T) {
	ep := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 8}
	leg := newLeg(NewSet([]endpoint.Endpoint{ep}, Options{}), new(RoundRobin), RoleDecode)
	allocs := testing.AllocsPerRun(1000, func() {
		l, _ := leg.Pick(Request{})
		l.End(Released)
	})
	require.Zero(t, allocs)
}
