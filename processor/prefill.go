package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

// prefillRun is a request's prefill: its attempts' context and, for a
// concurrent connector, the prefill still running while Envoy sends the
// decode.
type prefillRun struct {
	// ctx bounds all attempts (the pool's prefill_timeout); cancel ends
	// them. nil until the first attempt.
	ctx    context.Context
	cancel context.CancelFunc
	pool   *routing.Pool
	// on is the endpoint of the concurrent prefill that pending reports.
	on endpoint.Endpoint
	// pending delivers a concurrent connector's prefill outcome, which the
	// request waits for while it is prefilling (see state.prefilling).
	pending <-chan error
	// heldAfter are the answers to the response phases that came after
	// the held response headers (stateHoldingResponse: a
	// FULL_DUPLEX_STREAMED response body streams without waiting for
	// them): Envoy takes answers in order, so they follow the headers'.
	heldAfter []*extprocv3.ProcessingResponse
	// prepared is the decode a connector prepared, kept until pdx knows
	// that the engines need not let go of what they hold for it: Envoy
	// has the decode and its prefill is over (see stop).
	prepared *prepared
	// counted is the attempt running on a prefill endpoint.
	counted picker.Lease
	// answeredAt is when an attempt last succeeded: the hand-off starts
	// there.
	answeredAt time.Time
}

// prepared is a decode for which the engines hold work: what they hold,
// to release should the decode never come.
type prepared struct {
	held connectors.Held
	req  *connectors.Request // for the log
}

// errAttemptTimeout ends one prefill attempt that ran past the pool's
// prefill_attempt_timeout; the next endpoint may still make it.
var errAttemptTimeout = errors.New("prefill attempt timed out")

// retryBackoff is the pause before the n-th retry: enough for a restarting
// endpoint's neighbour to be a better bet, short against a prefill.
func retryBackoff(n int) time.Duration { return time.Duration(n) * 20 * time.Millisecond }

// prefillWithRetries runs the pool's connector against up to pool.Attempts
// different prefill endpoints until one succeeds. All attempts share the
// pool's prefill_timeout; each is bounded by prefill_attempt_timeout. Nothing
// has reached the client or the decode engine while this runs, so a retry is
// always safe; a concurrent connector's prefill that fails after its decode
// was sent is not retried (see prefillDone).
func (r *request) prefillWithRetries(ctx context.Context, pool *routing.Pool, creq *connectors.Request) (connectors.Handoff, error) {
	// The context of all attempts. A concurrent prefill outlives this call,
	// so the request cancels it (close); a sequential one ends here.
	pf := &r.prefill
	pf.ctx, pf.cancel = context.WithTimeoutCause(ctx, pool.PrefillTimeout, errPrefillTimeout)
	pf.pool = pool
	var tried []endpoint.Endpoint
	var last error       // decides the client's status
	var earlier []string // for the message
	for n := range pool.Attempts {
		lease, err := r.placed.Prefill(pf.ctx, tried...)
		if err != nil {
			// No attempt: say why (e.g. the decode's group has no
			// prefill), but for a budget that ran out before the pick
			// (its wait, peers.pick_jitter), which the switch below says.
			if last == nil && context.Cause(pf.ctx) != errPrefillTimeout {
				last = err
			}
			break // every endpoint the decode pairs with has been tried
		}
		r.obs.picked(pool, "prefill", lease.LoRA())
		pf.counted = lease
		r.obs.session(pool, picker.RolePrefill, lease.Session())
		if n > 0 {
			if sleep(pf.ctx, retryBackoff(n)) != nil {
				pf.counted.End(picker.Released)
				break
			}
		}
		ep := lease.Endpoint()
		tried = append(tried, ep)
		creq.Prefill = ep
		h, err := r.attempt(ctx, pool, creq)
		if err == nil {
			if h.Prefill == nil {
				pf.cancel()
			} else {
				pf.on = ep
			}
			return h, nil
		}
		if last != nil {
			earlier = append(earlier, last.Error())
		}
		last = r.prefillErr(pool, ep, err)
		if !retryable(ctx, pf.ctx, last) {
			break
		}
		r.log.LogAttrs(ctx, slog.LevelInfo, "prefill attempt failed", slog.String("error", last.Error()))
	}
	pf.cancel()
	switch {
	case context.Cause(pf.ctx) == errPrefillTimeout && !errors.Is(last, errPrefillTimeout):
		// The budget ran out between attempts.
		if last != nil {
			earlier = append(earlier, last.Error())
		}
		last = fmt.Errorf("pool %s: %w after %s", pool.Name, errPrefillTimeout, pool.PrefillTimeout)
	case last == nil:
		return connectors.Handoff{}, fmt.Errorf("%w: pool %s has no prefill endpoint to try", errNoEndpoint, pool.Name)
	}
	return connectors.Handoff{}, withEarlier(last, earlier)
}

// attempt is one prefill on creq.Prefill, whose lease is r.prefill.counted.
// Its outcome feeds the endpoint's passive health; that of a concurrent
// prefill still running is reported when it arrives (prefillDone).
func (r *request) attempt(ctx context.Context, pool *routing.Pool, creq *connectors.Request) (connectors.Handoff, error) {
	creq.PrefillRank = r.prefill.counted.Rank()
	if pool.Traits.Concurrent {
		h, err := pool.Connector.Prepare(r.obs.attemptStarted(r.prefill.ctx, pool, creq.Prefill), r.env, creq)
		if err != nil || h.Prefill == nil {
			r.report(ctx, pool, creq.Prefill, err)
		}
		return h, err
	}
	actx, cancel := context.WithTimeoutCause(r.prefill.ctx, pool.AttemptTimeout, errAttemptTimeout)
	defer cancel()
	h, err := pool.Connector.Prepare(r.obs.attemptStarted(actx, pool, creq.Prefill), r.env, creq)
	if err != nil && context.Cause(actx) == errAttemptTimeout && r.prefill.ctx.Err() == nil {
		err = fmt.Errorf("%w after %s", errAttemptTimeout, pool.AttemptTimeout)
	}
	if err == nil {
		r.checked(ctx, pool, r.placed.Prefilled(&r.prefill.counted, h.Prefilled))
	}
	r.report(ctx, pool, creq.Prefill, err)
	return h, err
}

// report ends the attempt's lease on ep with whether ep served the
// prefill, for the pool's prefill leg to hear. Only the endpoint's faults
// count: a request the engine rejected, or a client that went away, says
// nothing about the endpoint. The record has every outcome.
func (r *request) report(ctx context.Context, pool *routing.Pool, ep endpoint.Endpoint, err error) {
	result, outcome := metrics.ResultOK, picker.Succeeded
	if err != nil {
		result, outcome = toAPIError(r.prefillErr(pool, ep, err)).code, picker.Released
		if ctx.Err() == nil && endpointFault(err) {
			outcome = picker.Failed
		}
	} else {
		r.prefill.answeredAt = time.Now()
	}
	r.obs.attemptEnded(pool, ep, result, err)
	r.prefill.counted.End(outcome)
	if outcome == picker.Failed && !pool.Prefill.Set.Healthy(ep) {
		r.log.LogAttrs(ctx, slog.LevelWarn, "prefill endpoint ejected", slog.String("pool", pool.Name), slog.String("endpoint", ep.Address))
	}
}

// checked records placement's self-check of a prefill, and says once in a
// while, when it stops trusting the engines' word, why.
func (r *request) checked(ctx context.Context, pool *routing.Pool, c placement.Check) {
	r.obs.checked(pool, c)
	if !c.Untrusted {
		return
	}
	why := "the prefill engines found other parts of the prompts cached than their KV events said they held: events late or gone quiet, or blocks of another size than kv_events.block_size"
	if c.Result == placement.CheckTokens {
		why = "the prefill engines counted other prompt tokens than the render gave: the render server's chat template or tokenizer is not the engines'"
	}
	r.log.LogAttrs(ctx, slog.LevelWarn, "placement self-check: most of the last precise placements mismatched, placing by what pdx sent for a while",
		slog.String("pool", pool.Name), slog.String("why", why), slog.String("endpoint", c.Endpoint),
		slog.Int("rendered_tokens", c.Tokens), slog.Int("engine_tokens", c.ReportedTokens),
		slog.Int("held_tokens", c.Cached), slog.Int("engine_cached_tokens", c.ReportedCached))
}

// prefillDone takes a concurrent prefill's outcome. On failure the client
// gets pdx's error instead of the decode's answer: Envoy is still waiting for
// the decode's response headers, either with pdx holding its answer to them
// or before they arrived, and an ImmediateResponse then resets the decode.
// Neither a retry nor the fallback is possible any more: the decode is on
// its way, waiting for this prefill's KV, and its engine is told to let go.
func (r *request) prefillDone(ctx context.Context, err error) *extprocv3.ProcessingResponse {
	pf := &r.prefill
	pf.cancel()
	r.report(ctx, pf.pool, pf.on, err)
	if err != nil {
		r.release("the prefill failed after its decode was sent")
		return r.fail(ctx, r.prefillErr(pf.pool, pf.on, err))
	}
	pf.prepared = nil
	r.log.LogAttrs(ctx, slog.LevelDebug, "prefill done", slog.Duration("elapsed", time.Since(r.start)))
	held := r.state == stateHoldingResponse
	r.enter(stateRouted)
	if held {
		r.body.queued = append(r.body.queued, pf.heldAfter...)
		pf.heldAfter = nil
		return r.responseHeaders()
	}
	return nil
}

// stop ends the prefill's attempts. A prepared decode still kept (Envoy
// never got it, or the request did not wait for its concurrent prefill:
// the client went away) leaves work on the engines: they are told to let
// go of it.
func (pf *prefillRun) stop(r *request) {
	if pf.cancel != nil {
		pf.cancel()
	}
	pf.counted.End(picker.Released)
	if pf.prepared != nil {
		r.release("the request ended before its decode")
	}
}

// releaseTimeout bounds a release, which runs after the request is over.
const releaseTimeout = 5 * time.Second

// release tells the engines to let go of the prepared decode's work, in the
// background: the request has no one to wait for it.
func (r *request) release(why string) {
	p := r.prefill.prepared
	r.prefill.prepared = nil
	if p == nil {
		return
	}
	log, env := r.log, r.env
	r.bg.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		if err := p.held.Release(ctx, env); err != nil {
			log.LogAttrs(ctx, slog.LevelWarn, "releasing the engines' work failed", slog.String("why", why), slog.String("error", err.Error()))
			return
		}
		log.LogAttrs(ctx, slog.LevelInfo, "released the engines' work", slog.String("why", why),
			slog.String("prefill", p.req.Prefill.Address), slog.String("decode", p.req.Decode.Address))
	})
}

// prefillErr says which prefill failed, and names the overall timeout as
// such rather than as the context error it surfaces as.
func (r *request) prefillErr(pool *routing.Pool, ep endpoint.Endpoint, err error) error {
	if context.Cause(r.prefill.ctx) == errPrefillTimeout {
		err = fmt.Errorf("%w after %s", errPrefillTimeout, pool.PrefillTimeout)
	}
	if ee, ok := errors.AsType[*engines.Error](err); ok && ee.Endpoint.Address == ep.Address {
		return fmt.Errorf("pool %s: %w", pool.Name, err) // it names the endpoint
	}
	return fmt.Errorf("pool %s, prefill on %s: %w", pool.Name, ep.Address, err)
}

// withEarlier appends the earlier attempts' failures to the last one's, which
// decides the client's status.
func withEarlier(last error, earlier []string) error {
	if len(earlier) == 0 {
		return last
	}
	return fmt.Errorf("%w (earlier attempts: %s)", last, strings.Join(earlier, "; "))
}

// endpointFault reports whether err says the endpoint is unwell: it could not
// be reached, failed (5xx), broke the protocol or was too slow.
func endpointFault(err error) bool {
	if errors.Is(err, errAttemptTimeout) || errors.Is(err, errPrefillTimeout) {
		return true
	}
	ee, ok := errors.AsType[*engines.Error](err)
	if !ok {
		return false
	}
	return ee.Status == 0 || ee.Status >= 500 || errors.Is(err, engines.ErrBadAnswer)
}

// retryable reports whether another endpoint may succeed where this one
// failed: faults of the endpoint, and 429 (this one is overloaded). Not the
// client's own errors, and not once the request or its budget is over.
func retryable(ctx, prefillCtx context.Context, err error) bool {
	if ctx.Err() != nil || prefillCtx.Err() != nil {
		return false
	}
	if ee, ok := errors.AsType[*engines.Error](err); ok && ee.Status == 429 {
		return true
	}
	return endpointFault(err) && !errors.Is(err, errPrefillTimeout)
}

// fallbackable reports whether a failed prefill may give way to a decode
// that computes the prompt itself: not when the client went away or when
// the engine refused the request as such (it would refuse the decode too).
func fallbackable(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	ee, ok := errors.AsType[*engines.Error](err)
	return !ok || ee.Status == 0 || ee.Status == 429 || ee.Status >= 500 || errors.Is(err, engines.ErrBadAnswer)
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
