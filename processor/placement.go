package processor

import (
	"context"

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
func (r *request) place(ctx context.Context, pool *routing.Pool, creq *connectors.Request, model string) (string, error) {
	text := prompt(creq.Body)
	r.blocks = picker.Blocks(r.blocks[:0], text, pool.BlockTokens)
	r.blockTokens = pool.BlockTokens
	r.tokens, r.promptBytes = len(text)/picker.BytesPerToken, len(text)
	r.tokenBlocks = r.tokenBlocks[:0]
	r.rendered, r.tokenBlockSize = r.tokenize(ctx, pool, creq, model), pool.KVBlockSize
	r.flow.Tokens = r.tokens // token-usage fairness counts them
	t, err := r.awaitRoom(ctx, pool, pool.Decode.Set, "", "decode")
	if err != nil {
		return "", err
	}
	lease, err := pool.PickDecode(r.pick())
	t.Release()
	if err != nil {
		return "", err
	}
	r.obs.picked(pool, "decode", lease.LoRA())
	r.decode = lease
	ep := lease.Endpoint()
	creq.Decode = ep
	r.named(pool, ep)
	creq.DecodeRank = r.decode.Rank()
	if !pool.Traits.Prefills {
		return "", nil
	}
	if d := pool.Decider; d.MinUncachedTokens > 0 && r.tokens-r.decodeCached() < d.MinUncachedTokens {
		return reasonShort, nil
	}
	if d := pool.Decider; d.WhenPrefillSaturated && r.priority(pool) >= d.SaturatedMinPriority && pool.Prefill.Set.Saturated(ep.Group) {
		return reasonPrefillSaturated, nil
	}
	t, err = r.awaitRoom(ctx, pool, pool.Prefill.Set, ep.Group, "prefill")
	if err != nil {
		return "", err
	}
	// Released once the prefill pick counts (prefillWithRetries, handoff).
	r.prefillTicket = t
	return reasonDisaggregated, nil
}

// priority is the request's priority in pool: its objective's, 0 in a
// pool without flow control.
func (r *request) priority(pool *routing.Pool) int {
	if pool.Saturated == nil {
		return 0
	}
	return pool.Saturated.Flow.Priority(r.flow.Objective)
}

// decodeCached is how many of the prompt's tokens the decode engine held
// before this request added to it, as the decider counts them: the
// engine's own word where its events were read. What pdx sent there
// counts only without them: it is a byte estimate, and counting too much
// would serve a long new turn decode-alone (its TPOT), where counting too
// little costs only a prefill leg.
func (r *request) decodeCached() int {
	if held, ok := r.decode.Held(); ok {
		return held
	}
	return r.decode.Cached()
}

// pick is what the request's picks know of it.
func (r *request) pick() picker.Request {
	req := picker.Request{Blocks: r.blocks, BlockTokens: r.blockTokens, Tokens: r.tokens, Subset: r.subset, Session: r.session, Adapter: r.adapter}
	if r.rendered {
		req.TokenBlocks, req.TokenBlockSize, req.PromptBytes = r.tokenBlocks, r.tokenBlockSize, r.promptBytes
	}
	return req
}
