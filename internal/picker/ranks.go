package picker

import (
	"sync/atomic"

	"github.com/pdx-router/pdx/internal/endpoint"
)

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

// end uncounts a request begin counted on r.
func (rs *ranks) end(r endpoint.Rank) {
	if n, ok := r.Get(); ok {
		rs.inFlight[n].Add(-1)
	}
}

// RankInFlight returns how many of the requests whose leases took DP rank
// rank of ep have not ended (or dropped it).
func (s *Set) RankInFlight(ep endpoint.Endpoint, rank int) int {
	if h := s.view.Load().lookup(ep); h != nil && h.ranks != nil && rank >= 0 && rank < len(h.ranks.inFlight) {
		return int(h.ranks.inFlight[rank].Load())
	}
	return 0
}
