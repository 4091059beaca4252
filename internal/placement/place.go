package placement

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/picker"
)

// Why a request skips its pool's prefill leg, or does not
// (Placement.Reason, metrics' decision reasons).
const (
	ReasonDisaggregated    = "disaggregated"
	ReasonShort            = "short_uncached"
	ReasonPrefillSaturated = "prefill_saturated"
)

// Request is what placement knows of a request when its body is in.
type Request struct {
	// ID is the X-Request-Id the engines get; Path the API's path
	// (without the query).
	ID, Path string
	Body     jsonedit.Object
	Model    string
	// Subset is the gateway's subset hint (nil: any decode endpoint);
	// Session the request's session key (0: none); Adapter its LoRA
	// adapter in the pool ("" for the base model).
	Subset  []string
	Session uint64
	Adapter string
	// Priority is the request's priority in the pool's flow control,
	// which the decider compares with its SaturatedMinPriority.
	Priority int
	// Engine renders the prompt; Log is the request's logger.
	Engine connectors.Engine
	Log    *slog.Logger
	// Admit, when not nil, waits for room on a leg of the pool (flow
	// control), the prompt's tokens counting for token-usage fairness.
	// The ticket is released once the leg's pick counts.
	Admit func(ctx context.Context, set *picker.Set, group, leg string, tokens int) (flowcontrol.Ticket, error)
}

// Placement is one request's placement: where its decode goes and
// whether, and where, it takes the prefill leg. Its stream owns it; it
// is never shared.
type Placement struct {
	pool *Pool
	// Decode counts the request on its decode endpoint until it ends
	// (picker.Lease); Decodes are the decode endpoints the request names,
	// Decode's first, then those Envoy may retry it on.
	Decode  picker.Lease
	Decodes []endpoint.Endpoint
	// Reason is the decider's: ReasonDisaggregated takes the prefill leg;
	// "" for a pool without one.
	Reason string
	// Source is where the prompt's token count came from: TokensRendered,
	// TokensEstimate, or "" where the pool does not render; RenderFailure
	// why a render failed (RenderForbidden, RenderError), "" when none did.
	Source, RenderFailure string
	// prompt is the request as its picks know it.
	prompt picker.Request
	// rendered: prompt has the engines' tokens.
	rendered bool
	// ticket admits the request to the prefill leg until its first pick
	// there counts.
	ticket flowcontrol.Ticket
}

// Pool is the pool the request was placed in, nil before.
func (pl *Placement) Pool() *Pool { return pl.pool }

// Tokens is the prompt's length in tokens: the engines' count when
// rendered, else the byte estimate.
func (pl *Placement) Tokens() int { return pl.prompt.Tokens }

// BlockTokens is the size of the blocks a prompt's bytes are hashed in
// (picker.Blocks): prefix_block_tokens, or unset the KV block of the
// prefill engines, whose cache decides the hit (of the decode engines in
// a pool without a prefill leg), DefaultPrefixBlockTokens until they say
// (picker.Set.BlockTokens).
func (p *Pool) BlockTokens() int {
	if p.Prefills {
		return p.Prefill.Set.BlockTokens()
	}
	return p.Decode.Set.BlockTokens()
}

// Place places a request for which the pool's connector prepares creq:
// it tokenizes the prompt, waits for room on the decode leg, picks the
// decode endpoint and its fallbacks, and decides whether the request takes
// the prefill leg, waiting for room there when it does (Reason). The
// prefill endpoint is picked by Prefill, once per attempt. creq gets the
// decode endpoint and its rank. An error is the client's answer (a pick
// that finds no endpoint wraps picker's; flow control's refusals are
// Admit's); the Placement then holds whatever it leased, for the request
// to end.
func (p *Pool) Place(ctx context.Context, req Request, creq *connectors.Request) (Placement, error) {
	pl := Placement{pool: p}
	text := prompt(creq.Path, creq.Body)
	bt := p.BlockTokens()
	pl.prompt = picker.Request{
		Blocks:      picker.Blocks(nil, text, bt),
		BlockTokens: bt,
		Tokens:      len(text) / picker.BytesPerToken,
		Subset:      req.Subset, Session: req.Session, Adapter: req.Adapter,
	}
	pl.Source = p.tokenize(ctx, &req, &pl)
	if pl.rendered {
		pl.prompt.PromptBytes = len(text)
	}
	t, err := p.admit(ctx, &req, p.Decode.Set, "", "decode", pl.prompt.Tokens)
	if err != nil {
		return pl, err
	}
	first := pl.pick()
	first.Tentative = p.LateDecode
	lease, err := p.PickDecode(first)
	t.Release()
	if err != nil {
		return pl, err
	}
	pl.named(lease)
	ep := lease.Endpoint()
	creq.Decode, creq.DecodeRank = ep, lease.Rank()
	if !p.Prefills {
		return pl, nil
	}
	d := p.Decider
	switch {
	case d.MinUncachedTokens > 0 && pl.prompt.Tokens-pl.decodeCached() < d.MinUncachedTokens:
		pl.Reason = ReasonShort
		return pl, nil
	case d.WhenPrefillSaturated && req.Priority >= d.SaturatedMinPriority && p.Prefill.Set.Saturated(ep.Group):
		pl.Reason = ReasonPrefillSaturated
		return pl, nil
	}
	if pl.ticket, err = p.admit(ctx, &req, p.Prefill.Set, ep.Group, "prefill", pl.prompt.Tokens); err != nil {
		return pl, err
	}
	pl.Reason = ReasonDisaggregated
	return pl, nil
}

// Settle ends the decode pick of a request about to go to its decode
// endpoint. In a pool whose decode is picked late (LateDecode) the pick
// at Place was tentative: when again, the prefill has answered and the
// decode body names no engine, so the decode is picked once more
// (picker.Leg.PickAgain), by what the engines say now (a sequence waits
// for KV on the engine it is sent to, and the engines' KV changes while
// the prompt is computed), within the first pick's group, where the
// prefill engine hands the KV over; ties keep the first pick. When the
// decode moves, creq gets the new endpoint and its rank, and the
// fallbacks follow it. Otherwise the first pick stands. It reports
// whether the decode moved.
func (pl *Placement) Settle(creq *connectors.Request, again bool) (moved bool) {
	if pl.pool == nil || !pl.pool.LateDecode {
		return false
	}
	if !again {
		pl.Decode.Confirm()
		return false
	}
	req := pl.pick()
	req.Group = pl.Decode.Endpoint().Group
	if !pl.pool.Decode.PickAgain(req, &pl.Decode) {
		return false
	}
	pl.nameDecodes()
	creq.Decode, creq.DecodeRank = pl.Decode.Endpoint(), pl.Decode.Rank()
	return true
}

// PlaceDecode places a request that goes to a decode endpoint as it is
// (a pass-through path): the decode pick and its fallbacks, nothing of a
// prompt.
func (p *Pool) PlaceDecode(subset []string, session uint64) (Placement, error) {
	pl := Placement{pool: p, prompt: picker.Request{Subset: subset, NoRank: true, Session: session}}
	lease, err := p.PickDecode(pl.prompt)
	if err != nil {
		return pl, err
	}
	pl.named(lease)
	return pl, nil
}

// admit waits for room on a leg when the request has flow control.
func (p *Pool) admit(ctx context.Context, req *Request, set *picker.Set, group, leg string, tokens int) (flowcontrol.Ticket, error) {
	if req.Admit == nil {
		return flowcontrol.Ticket{}, nil
	}
	return req.Admit(ctx, set, group, leg, tokens)
}

// named keeps the decode lease and names the endpoints the request's
// decode goes to (nameDecodes).
func (pl *Placement) named(lease picker.Lease) {
	pl.Decode = lease
	pl.nameDecodes()
}

// nameDecodes names the endpoints the request's decode goes to: the
// decode lease's, then the pool's fallbacks for it.
func (pl *Placement) nameDecodes() {
	first := pl.Decode.Endpoint()
	pl.Decodes = pl.pool.PickFallbacks(append(pl.Decodes[:0], first), pl.pick(), first)
}

// Prefill leases the prefill endpoint of the request's next attempt: one
// of its decode endpoint's group, other than those tried. The first call
// ends the request's wait for room on the leg; it picks after a random
// wait up to the pool's PickJitter, so that replicas given a burst's
// requests at once do not all pick before any hears of the others'
// leases (with none of them counted, they would pick alike). The error
// of a wait cut short is ctx's cause.
func (pl *Placement) Prefill(ctx context.Context, tried ...endpoint.Endpoint) (picker.Lease, error) {
	defer pl.ticket.Release()
	if j := pl.pool.PickJitter; j > 0 && len(tried) == 0 {
		t := time.NewTimer(rand.N(j))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return picker.Lease{}, context.Cause(ctx)
		}
	}
	return pl.pool.PickPrefill(pl.Decode.Endpoint(), pl.pick(), tried...)
}

// Release ends the request's wait for room on the prefill leg, if it
// still holds one (a concurrent connector picks in its Prepare).
func (pl *Placement) Release() { pl.ticket.Release() }

// decodeCached is how many of the prompt's tokens the decode engine held
// before this request added to it, as the decider counts them: the
// engine's own word where its events were read. What pdx sent there
// counts only without them: it is a byte estimate, and counting too much
// would serve a long new turn decode-alone (its TPOT), where counting too
// little costs only a prefill leg.
func (pl *Placement) decodeCached() int {
	if held, ok := pl.Decode.Held(); ok {
		return held
	}
	return pl.Decode.Cached()
}

// pick is what the request's picks know of it.
func (pl *Placement) pick() picker.Request {
	req := pl.prompt
	if !pl.rendered {
		req.TokenBlocks, req.TokenBlockSize, req.PromptBytes = nil, 0, 0
	}
	return req
}

// PickDecode leases the decode endpoint of a request (req.Group and Tried
// are not used: a decode is picked first, once), within req.Subset when
// the gateway gave one; the lease tells what the endpoint had cached when
// the pool's decider needs it. It fails, wrapping ErrNoEndpoint,
// when the pool has none at the moment (a discovered pool whose decode
// pods are all gone or not ready, or none in the subset).
func (p *Pool) PickDecode(req picker.Request) (picker.Lease, error) {
	req.Group, req.Tried = "", nil
	req.NeedCached = p.Decider.MinUncachedTokens > 0
	lease, ok := p.Decode.Pick(req)
	switch {
	case ok:
		return lease, nil
	case req.Subset != nil:
		return picker.Lease{}, fmt.Errorf("%w: none of the %d endpoints of the gateway's subset hint is a decode endpoint of pool %s",
			ErrNoEndpoint, len(req.Subset), p.Name)
	}
	return picker.Lease{}, fmt.Errorf("%w: pool %s has no ready decode endpoint", ErrNoEndpoint, p.Name)
}

// PickFallbacks appends to out up to DecodeFallbacks decode endpoints other
// than first, a request's decode pick, in the decode picker's order of
// preference (each a pick with the ones before it tried): where Envoy
// retries the request's decode when first fails. They are of first's
// Group: the request's prefill hands its KV over within it. Fewer when
// the pool (or group) has fewer endpoints.
func (p *Pool) PickFallbacks(out []endpoint.Endpoint, req picker.Request, first endpoint.Endpoint) []endpoint.Endpoint {
	if p.DecodeFallbacks == 0 {
		return out
	}
	req.Group = first.Group
	req.Tried = append(make([]endpoint.Endpoint, 0, 1+p.DecodeFallbacks), first)
	for range p.DecodeFallbacks {
		ep, ok := p.Decode.Next(req)
		if !ok {
			break
		}
		out = append(out, ep)
		req.Tried = append(req.Tried, ep)
	}
	return out
}

// PickPrefill leases a prefill endpoint for a request (req: its prompt)
// whose decode endpoint is decode, other than those in tried. A decode
// endpoint with a Group pairs only with the prefill endpoints of that group;
// when none is left the pick fails rather than use another group's, whose
// engines cannot hand the KV over. It fails, wrapping ErrNoEndpoint,
// when no endpoint is left to try.
func (p *Pool) PickPrefill(decode endpoint.Endpoint, req picker.Request, tried ...endpoint.Endpoint) (picker.Lease, error) {
	// The subset hint names where the gateway may send the request: the
	// decode. pdx calls the prefill itself.
	req.Group, req.Tried, req.Subset = decode.Group, tried, nil
	lease, ok := p.Prefill.Pick(req)
	switch {
	case ok:
		return lease, nil
	case len(tried) > 0:
		return picker.Lease{}, fmt.Errorf("%w: pool %s has no prefill endpoint left to try", ErrNoEndpoint, p.Name)
	case decode.Group != "":
		return picker.Lease{}, fmt.Errorf("%w: pool %s has no ready prefill endpoint in group %q of decode endpoint %s",
			ErrNoEndpoint, p.Name, decode.Group, decode.Address)
	}
	return picker.Lease{}, fmt.Errorf("%w: pool %s has no ready prefill endpoint", ErrNoEndpoint, p.Name)
}

// prompt returns the part of body that placement hashes: the raw JSON of
// "messages" (chat) or "prompt" (completions); for Responses its
// "instructions", "tools" and "input", for Messages its "system", "tools"
// and "messages", in the order the engines' chat templates render them
// (the system part, with the tools, first); nil when there is none. Raw
// bytes keep their order, so a conversation's next turn starts with its
// previous turn's bytes. The two APIs' parts are copied together when
// there is more than one (one allocation of the prompt's size); a single
// part is the body's own bytes.
func prompt(path string, body jsonedit.Object) []byte {
	var keys [3]string
	switch connectors.APIOf(path) {
	case connectors.APIResponses:
		keys = [...]string{"instructions", "tools", "input"}
	case connectors.APIMessages:
		keys = [...]string{"system", "tools", "messages"}
	default:
		if raw, ok := body.Raw("messages"); ok {
			return raw
		}
		raw, _ := body.Raw("prompt")
		return raw
	}
	var parts [len(keys)][]byte
	n, size := 0, 0
	for _, k := range keys {
		if raw, ok := body.Raw(k); ok && string(raw) != "null" {
			parts[n] = raw
			n++
			size += len(raw)
		}
	}
	switch n {
	case 0:
		return nil
	case 1:
		return parts[0]
	}
	text := make([]byte, 0, size)
	for _, p := range parts[:n] {
		text = append(text, p...)
	}
	return text
}

// ErrNoEndpoint is the error of a pick that finds no endpoint to use.
var ErrNoEndpoint = errors.New("no endpoint available")
