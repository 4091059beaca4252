package picker

import (
	"fmt"
	"math"
	"slices"
	"sync"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// PrefixAffinityPolicy names PrefixAffinity in the config.
const PrefixAffinityPolicy = "prefix_affinity"

// DefaultLoadFactor is PrefixAffinity's default bound: no endpoint takes
// more than 1.25 times the mean load (Mirrokni, Thorup and Zadimoghaddam,
// "Consistent Hashing with Bounded Loads", 2016, use 1+ε with ε 0.25 in
// their experiments, as does Vimeo's deployment of it).
const DefaultLoadFactor = 1.25

func prefixAffinitySpec() Spec {
	return Spec{
		Name:   PrefixAffinityPolicy,
		Fields: []string{"load_factor"},
		Defaults: func(p *configv1.Picker, _ Role) {
			if p.LoadFactor == 0 {
				p.LoadFactor = DefaultLoadFactor
			}
		},
		Validate: func(p *configv1.Picker, path string) []error {
			if lf := p.GetLoadFactor(); lf <= 1 || lf > 100 {
				return []error{fmt.Errorf("%s.load_factor: %v is not in (1, 100]", path, lf)}
			}
			return nil
		},
		New: func(p *configv1.Picker, _ Role) Policy { return newPrefixAffinity(p.GetLoadFactor()) },
	}
}

// PrefixAffinity sends prompts that share a prefix to the same endpoint, so
// that its prefix cache serves them, without any state shared between pdx
// replicas: the endpoint is chosen by rendezvous hashing of the prompt's key
// (see branches) over the endpoints' addresses, which every replica
// computes alike, bounded by load (consistent hashing with bounded loads):
// an endpoint with more than LoadFactor times the mean load is passed over
// for the next in the key's order. Adding or removing an endpoint moves only
// the keys it gains or loses. A request without a prompt goes to the least
// loaded endpoint.
//
// Load is what least_request counts: the engine's waiting and running
// requests by its fresh metrics (the same for every replica) or pdx's
// in-flight count, the larger.
type PrefixAffinity struct {
	loadFactor float64
	branches   branches
}

var _ Policy = (*PrefixAffinity)(nil)

// newPrefixAffinity returns a prefix affinity policy bounding loads by
// loadFactor (1 or less: DefaultLoadFactor).
func newPrefixAffinity(loadFactor float64) *PrefixAffinity {
	if loadFactor <= 1 {
		loadFactor = DefaultLoadFactor
	}
	return &PrefixAffinity{loadFactor: loadFactor, branches: newBranches()}
}

// Choose implements [Policy]: the first usable candidate in the key's
// rendezvous order within the load bound.
func (p *PrefixAffinity) Choose(c *Candidates) int {
	if len(c.blocks) == 0 {
		return leastRequest(c)
	}
	key := p.branches.key(c.blocks)
	n := c.Len()
	total, usable := 0, 0
	for k := range n {
		if g := c.signal(k); g.usable {
			total += g.queue()
			usable++
		}
	}
	if usable == 0 {
		return -1
	}
	bound := int(math.Ceil(p.loadFactor * float64(total+1) / float64(usable)))
	best, bestWeight := -1, uint64(0)
	for k := range n {
		if g := c.signal(k); !g.usable || g.queue()+1 > bound {
			continue
		}
		if w := mix(key ^ c.seed(k)); best < 0 || w > bestWeight {
			best, bestWeight = k, w
		}
	}
	return best
}

// mix is SplitMix64's finalizer: a rendezvous weight from a key and an
// endpoint's seed.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// branches chooses a prompt's affinity key: the hash of its shallowest
// prefix that is not a branching point, i.e. that has been followed by
// fewer than branchOut different next blocks. A branching point (a system
// prompt every conversation starts with) says nothing about where a prompt
// should go, since every endpoint soon caches it; the first prefix past it
// is what a conversation's turns, or the users of one document, share, and
// stays the same as the conversation grows. Every replica sees branching
// points branch, so they agree on keys without talking. What it remembers
// is bounded by two generations of maxBranches prefixes, the older dropped
// when the newer is full.
type branches struct {
	mu       sync.Mutex
	cur, old map[uint64]successors
}

const (
	// branchOut is how many different next blocks make a prefix a
	// branching point: more than a regenerated answer or two.
	branchOut = 4
	// branchDepth bounds how deep a key goes: a prompt whose first
	// branchDepth prefixes all branch is keyed by the last of them.
	branchDepth = 64
	// maxBranches is the size of a generation.
	maxBranches = 1 << 16
)

// successors are the first branchOut different blocks seen after a prefix.
type successors struct {
	next [branchOut]uint64
	n    int
}

func newBranches() branches {
	return branches{cur: map[uint64]successors{}}
}

// key notes blocks' branches and returns the prompt's key (blocks not
// empty).
func (x *branches) key(blocks []uint64) uint64 {
	blocks = blocks[:min(len(blocks), branchDepth)]
	x.mu.Lock()
	defer x.mu.Unlock()
	for k, b := range blocks[:len(blocks)-1] {
		s, ok := x.cur[b]
		if !ok {
			s = x.old[b]
		}
		s.note(blocks[k+1])
		if !ok && len(x.cur) >= maxBranches {
			x.old, x.cur = x.cur, make(map[uint64]successors, maxBranches)
		}
		x.cur[b] = s
		if s.n < branchOut {
			return b
		}
	}
	return blocks[len(blocks)-1]
}

// note adds next to s unless it has it or is full.
func (s *successors) note(next uint64) {
	if s.n == branchOut || slices.Contains(s.next[:s.n], next) {
		return
	}
	s.next[s.n] = next
	s.n++
}
