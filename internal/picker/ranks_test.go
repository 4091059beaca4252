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

func TestBeginRank(t *testing.T) {
	dp4 := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 4}
	dp1 := endpoint.Endpoint{Address: "10.0.0.2:8000", DPSize: 1}
	none := endpoint.Endpoint{Address: "10.0.0.3:8000"}
	for _, tc := range []struct {
		name string
		// run picks ranks on a fresh set; it returns the ranks picked and
		// the endpoint whose counts are then checked.
		run        func(s *Set) ([]endpoint.Rank, endpoint.Endpoint)
		wantRanks  []int
		wantCounts []int
	}{
		{"each rank once before any twice", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			var got []endpoint.Rank
			for range 8 {
				got = append(got, s.BeginRank(dp4))
			}
			return got, dp4
		}, []int{1, 2, 3, 0, 1, 2, 3, 0}, []int{2, 2, 2, 2}},
		{"the least loaded rank wins over the turn", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			a, b, c := s.BeginRank(dp4), s.BeginRank(dp4), s.BeginRank(dp4) // 1, 2, 3
			s.EndRank(dp4, b)                                               // rank 2 is free again
			// Ranks 0 and 2 have none: the turn (from rank 0) takes 0,
			// then the only free one is 2.
			return []endpoint.Rank{a, b, c, s.BeginRank(dp4), s.BeginRank(dp4)}, dp4
		}, []int{1, 2, 3, 0, 2}, []int{1, 1, 1, 1}},
		{"ended requests free their rank", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			var got []endpoint.Rank
			for range 6 {
				r := s.BeginRank(dp4)
				got = append(got, r)
				s.EndRank(dp4, r)
			}
			return got, dp4
		}, []int{1, 2, 3, 0, 1, 2}, []int{0, 0, 0, 0}},
		{"an engine of one rank gets none", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			return []endpoint.Rank{s.BeginRank(dp1), s.BeginRank(none)}, dp1
		}, []int{-1, -1}, nil},
		{"an endpoint the set does not have gets none", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			other := endpoint.Endpoint{Address: "10.0.0.9:8000", DPSize: 4}
			r := s.BeginRank(other)
			s.EndRank(other, endpoint.RankOf(3)) // ignored
			return []endpoint.Rank{r}, other
		}, []int{-1}, nil},
		{"ends of none and of ranks it lacks are ignored", func(s *Set) ([]endpoint.Rank, endpoint.Endpoint) {
			r := s.BeginRank(dp4)
			s.EndRank(dp4, endpoint.Rank{})
			s.EndRank(dp4, endpoint.RankOf(4))
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

func TestBeginRankKeepsCountsAcrossEndpointChanges(t *testing.T) {
	dp2 := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 2}
	other := endpoint.Endpoint{Address: "10.0.0.2:8000", DPSize: 2}
	s := NewSet([]endpoint.Endpoint{dp2}, Options{})
	r := s.BeginRank(dp2)
	s.SetEndpoints([]endpoint.Endpoint{other, dp2})
	require.Equal(t, []int{0, 1}, rankCounts(s, dp2), "the new view shares the endpoint's counts")
	s.EndRank(dp2, r)
	require.Equal(t, []int{0, 0}, rankCounts(s, dp2))
	// A rebuilt table's set inherits them too.
	next := NewSet([]endpoint.Endpoint{dp2}, Options{Inherit: s})
	r = next.BeginRank(dp2)
	require.Equal(t, []int{1, 0}, rankCounts(s, dp2), "the turn goes on too")
	next.EndRank(dp2, r)
	require.Equal(t, []int{0, 0}, rankCounts(s, dp2))
}

func TestBeginRankConcurrent(t *testing.T) {
	const size, workers, rounds = 4, 8, 500
	ep := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: size}
	s := NewSet([]endpoint.Endpoint{ep}, Options{})

	// Requests held at once: each rank gets one. (The pick whose turn
	// starts at rank k sees it free unless another took it.)
	held := make([]endpoint.Rank, workers)
	var wg sync.WaitGroup
	for i := range held {
		wg.Go(func() { held[i] = s.BeginRank(ep) })
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
				r := s.BeginRank(ep)
				if n, ok := r.Get(); !ok || n >= size {
					t.Errorf("rank %v of %d", r, size)
					return
				}
				s.EndRank(ep, r)
			}
		})
	}
	wg.Wait()
	require.Equal(t, counts, rankCounts(s, ep), "every request that came and went released its rank")
	for _, r := range held {
		s.EndRank(ep, r)
	}
	require.Equal(t, []int{0, 0, 0, 0}, rankCounts(s, ep))
}

func TestBeginRankDoesNotAllocate(t *testing.T) {
	ep := endpoint.Endpoint{Address: "10.0.0.1:8000", DPSize: 8}
	s := NewSet([]endpoint.Endpoint{ep}, Options{})
	allocs := testing.AllocsPerRun(1000, func() {
		s.EndRank(ep, s.BeginRank(ep))
	})
	require.Zero(t, allocs)
}
