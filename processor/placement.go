package processor

import (
	"context"
	"fmt"
	"time"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// Why a request skips its pool's prefill leg, or does not (metrics'
// decision reasons).
const (
	reasonDisaggregated    = "disaggregated"
	reasonShort            = "short_uncached"
	reasonPrefillSaturated = "prefill_saturated"
)

// inFlight is a request counted on an endpoint of a leg (picker.Set.Begin)
// until end, and on the DP rank it was given there (beginRank), if any.
type inFlight struct {
	set    *picker.Set
	ep     endpoint.Endpoint
	tokens int
	rank   endpoint.Rank
}

func (f *inFlight) begin(set *picker.Set, ep endpoint.Endpoint, blocks []uint64, tokens int) {
	f.end()
	set.Begin(ep, blocks, tokens)
	f.set, f.ep, f.tokens = set, ep, tokens
}

// beginRank picks the DP rank of the endpoint begin counted the request
// on, for engines that serve several (none otherwise), and counts it there
// until end: the leg's Set spreads its requests over the ranks.
func (f *inFlight) beginRank() endpoint.Rank {
	f.rank = f.set.BeginRank(f.ep)
	return f.rank
}

// endRank ends the count on the rank alone: the request goes to the
// endpoint without naming one, and the engine places it itself.
func (f *inFlight) endRank() {
	if f.set != nil {
		f.set.EndRank(f.ep, f.rank)
	}
	f.rank = endpoint.Rank{}
}

// end ends the count, if any; it may be called more than once.
func (f *inFlight) end() {
	if f.set != nil {
		f.set.EndRank(f.ep, f.rank)
		f.set.End(f.ep, f.tokens)
		f.set, f.rank = nil, endpoint.Rank{}
	}
}

// named notes the decode endpoints a request names: first, pdx's pick,
// then the pool's fallbacks for it.
func (r *request) named(pool *routing.Pool, first endpoint.Endpoint) {
	r.decodePool = pool
	r.decodes = pool.PickFallbacks(append(r.decodes[:0], first), r.pick(), first)
}

// prompt returns the part of body that placement hashes: the raw JSON of
// "messages" (chat) or "prompt" (completions), nil when there is neither.
// Raw bytes keep their order, so a conversation's next turn starts with its
// previous turn's bytes.
func prompt(body jsonedit.Object) []byte {
	if raw, ok := body.Raw("messages"); ok {
		return raw
	}
	raw, _ := body.Raw("prompt")
	return raw
}

// place picks the decode endpoint of a request and decides whether it takes
// the prefill leg, waiting while the pool's legs are saturated. It returns
// the reason of the decision (reasonDisaggregated: take it).
func (r *request) place(ctx context.Context, pool *routing.Pool, creq *connectors.Request, body jsonedit.Object) (string, error) {
	text := prompt(body)
	r.blocks = picker.Blocks(r.blocks[:0], text, pool.BlockTokens)
	r.blockTokens = pool.BlockTokens
	r.tokens = len(text) / picker.BytesPerToken
	if err := r.awaitRoom(ctx, pool, pool.Decode.Set, "", "decode"); err != nil {
		return "", err
	}
	ep, err := pool.PickDecode(r.pick())
	if err != nil {
		return "", err
	}
	creq.Decode = ep
	// What the decode engine holds before this request adds to it.
	cached := 0
	if pool.Decider.MinUncachedTokens > 0 {
		cached = pool.Decode.Set.Matched(ep, r.blocks) * pool.BlockTokens
	}
	r.decode.begin(pool.Decode.Set, ep, r.blocks, r.tokens)
	r.named(pool, ep)
	creq.DecodeRank = r.decode.beginRank()
	if !pool.Traits.Prefills {
		return "", nil
	}
	if d := pool.Decider; d.MinUncachedTokens > 0 && r.tokens-cached < d.MinUncachedTokens {
		return reasonShort, nil
	}
	if pool.Prefill.Set.Saturated(ep.Group) {
		if pool.Decider.WhenPrefillSaturated {
			return reasonPrefillSaturated, nil
		}
		if err := r.awaitRoom(ctx, pool, pool.Prefill.Set, ep.Group, "prefill"); err != nil {
			return "", err
		}
	}
	return reasonDisaggregated, nil
}

// pick is what the request's picks know of it.
func (r *request) pick() picker.Request {
	return picker.Request{Blocks: r.blocks, BlockTokens: r.blockTokens, Tokens: r.tokens, Subset: r.subset}
}

// roomPoll is how often a request waiting for a saturated leg looks again:
// in-flight counts change at once, engines' metrics every scrape.
const roomPoll = 10 * time.Millisecond

// awaitRoom waits until some endpoint of set (in group) is not saturated,
// for up to the pool's queueing time, and fails with 429 if none is by
// then. It returns at once when saturation is off or the leg has room.
func (r *request) awaitRoom(ctx context.Context, pool *routing.Pool, set *picker.Set, group, leg string) error {
	shed := pool.Saturated
	if shed == nil || !set.Saturated(group) {
		return nil
	}
	if shed.MaxWait > 0 {
		deadline := time.NewTimer(shed.MaxWait)
		defer deadline.Stop()
		tick := time.NewTicker(roomPoll)
		defer tick.Stop()
		for set.Saturated(group) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-deadline.C:
				return overloaded(pool, leg, shed.MaxWait)
			case <-tick.C:
			}
		}
		return nil
	}
	return overloaded(pool, leg, 0)
}

// overloaded is the 429 of a request shed because every endpoint of a leg
// is saturated.
func overloaded(pool *routing.Pool, leg string, waited time.Duration) *apiError {
	msg := fmt.Sprintf("every %s engine of pool %s is saturated", leg, pool.Name)
	if waited > 0 {
		msg += fmt.Sprintf(" and none had room within %s", waited)
	}
	return &apiError{status: 429, typ: typeServer, code: "overloaded", msg: msg + "; retry later", retryAfter: 1}
}
