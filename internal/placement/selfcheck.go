package placement

import (
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/picker"
)

// What a prefill's answer said of placement's prediction (Check.Result).
const (
	// CheckMatch: the engine computed the prompt placement expected.
	CheckMatch = "match"
	// CheckTokens: the engine counted other prompt tokens than the render
	// gave: the render server's chat template or tokenizer is not the
	// engines'.
	CheckTokens = "tokens_mismatch"
	// CheckCached: the engine found another part of the prompt cached
	// than its KV events said it held (beyond a block): its events are
	// late or gone quiet, or their blocks are not kv_events.block_size.
	CheckCached = "cached_mismatch"
	// CheckUntrusted: the request was placed by what pdx sent, the
	// engines' word being untrusted for the while (Pool.Trusted).
	CheckUntrusted = "untrusted"
)

// Self-check window: the last checkWindow precise placements judged; when
// at least checkMin of them are judged and half mismatched, the pool's
// precise placement is untrusted for untrustFor.
const (
	checkWindow = 32
	checkMin    = 16
	untrustFor  = time.Minute
)

// Check is one prefill's prediction against what its engine said, for the
// metrics and the log: placement predicted Cached of the prompt's Tokens
// held on Endpoint; the engine said it computed a prompt of
// ReportedTokens, of which ReportedCached were cached.
type Check struct {
	Endpoint                       string
	Tokens, Cached                 int
	ReportedTokens, ReportedCached int
	// Reports: the engine is known to report its cached tokens (vLLM's
	// --enable-prompt-tokens-details), so Cached and ReportedCached
	// compare.
	Reports bool
	// Result is the verdict on a precise placement (CheckMatch,
	// CheckTokens, CheckCached), or CheckUntrusted; "" when there is none
	// (placed by the estimate, or an answer without usage).
	Result string
	// Untrusted: this answer turned the pool's precise placement
	// untrusted (log it: it happens once a while).
	Untrusted bool
}

// selfCheck is a pool's record of how its precise predictions fared.
type selfCheck struct {
	mu sync.Mutex
	// window holds the last judgements, a bit each (1: mismatched), n of
	// them so far (up to checkWindow).
	window uint64
	n      int
	// until (Unix nanoseconds) is when precise placement is trusted
	// again; 0: trusted.
	until atomic.Int64
	// details are the prefill engines known to report cached tokens
	// (vLLM's --enable-prompt-tokens-details): one that says nothing of
	// them then cached none.
	details sync.Map
}

// Trusted reports whether placement uses the engines' word (rendered
// tokens, KV events) now: the self-check has not found it wrong lately.
func (p *Pool) Trusted() bool {
	until := p.check.until.Load()
	return until == 0 || time.Now().UnixNano() >= until
}

// Prefilled tells the placement what the engine of a prefill attempt
// (lease, one of this placement's) said of the prompt when it answered:
// the lease learns from it (picker.Lease.Observe), and the pool's
// self-check judges a precise placement's prediction. Check reports both.
func (pl *Placement) Prefilled(lease *picker.Lease, got connectors.Prefilled) Check {
	lease.Observe(got.PromptTokens, got.CachedTokens)
	p := pl.pool
	ep := lease.Endpoint().Address
	c := Check{Endpoint: ep, Tokens: pl.prompt.Tokens, Cached: lease.Cached(), ReportedTokens: got.PromptTokens, ReportedCached: got.CachedTokens}
	held, precise := lease.Held()
	if precise {
		c.Cached = held
	}
	if got.PromptTokens > 0 {
		if got.Details {
			p.check.details.Store(ep, struct{}{})
		}
		_, c.Reports = p.check.details.Load(ep)
	}
	switch {
	case !pl.rendered:
		if pl.Source == TokensEstimate && !p.Trusted() {
			c.Result = CheckUntrusted
		}
		return c
	case got.PromptTokens == 0:
		return c // the answer had no usage
	case got.PromptTokens != pl.prompt.Tokens:
		c.Result = CheckTokens
	case precise && c.Reports && abs(held-got.CachedTokens) > p.KVBlockSize:
		c.Result = CheckCached
	default:
		c.Result = CheckMatch
	}
	c.Untrusted = p.check.judge(c.Result)
	return c
}

// judge records a judgement and reports whether it made the pool's
// precise placement untrusted.
func (s *selfCheck) judge(result string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.window <<= 1
	if result != CheckMatch {
		s.window |= 1
	}
	s.n = min(s.n+1, checkWindow)
	bad := bits.OnesCount64(s.window & (1<<checkWindow - 1))
	if s.n < checkMin || 2*bad < s.n {
		return false
	}
	s.window, s.n = 0, 0
	s.until.Store(time.Now().Add(untrustFor).UnixNano())
	return true
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}
