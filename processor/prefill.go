package processor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/routing"
)

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
func (r *request) prefillWithRetries(ctx context.Context, pool *routing.Pool, creq *connectors.Request) (connectors.Decode, error) {
	// The context of all attempts. A concurrent prefill outlives this call,
	// so the request cancels it (close); a sequential one ends here.
	r.prefillCtx, r.cancelPrefill = context.WithTimeoutCause(ctx, pool.PrefillTimeout, errPrefillTimeout)
	r.prefillPool = pool
	var tried []endpoint.Endpoint
	var last error       // decides the client's status
	var earlier []string // for the message
	for n := range pool.Attempts {
		ep, err := pool.PickPrefill(creq.Decode, tried...)
		if err != nil {
			if last == nil {
				last = err // no attempt: say why (e.g. the decode's group has no prefill)
			}
			break // every endpoint the decode pairs with has been tried
		}
		if n > 0 {
			if sleep(r.prefillCtx, retryBackoff(n)) != nil {
				break
			}
		}
		tried = append(tried, ep)
		creq.Prefill = ep
		decode, err := r.attempt(ctx, pool, creq)
		if err == nil {
			if decode.Prefill == nil {
				r.cancelPrefill()
			} else {
				r.prefillOn = ep
			}
			return decode, nil
		}
		if last != nil {
			earlier = append(earlier, last.Error())
		}
		last = r.prefillErr(pool, ep, err)
		if !retryable(ctx, r.prefillCtx, last) {
			break
		}
		r.log.LogAttrs(ctx, slog.LevelInfo, "prefill attempt failed", slog.String("error", last.Error()))
	}
	r.cancelPrefill()
	switch {
	case context.Cause(r.prefillCtx) == errPrefillTimeout && !errors.Is(last, errPrefillTimeout):
		// The budget ran out between attempts.
		if last != nil {
			earlier = append(earlier, last.Error())
		}
		last = fmt.Errorf("pool %s: %w after %s", pool.Name, errPrefillTimeout, pool.PrefillTimeout)
	case last == nil:
		return connectors.Decode{}, fmt.Errorf("%w: pool %s has no prefill endpoint to try", errNoEndpoint, pool.Name)
	}
	return connectors.Decode{}, withEarlier(last, earlier)
}

// attempt is one prefill on creq.Prefill. Its outcome feeds the endpoint's
// passive health; a concurrent prefill's is reported when it arrives.
func (r *request) attempt(ctx context.Context, pool *routing.Pool, creq *connectors.Request) (connectors.Decode, error) {
	if pool.Traits.Concurrent {
		decode, err := pool.Connector.Prepare(r.startAttempt(r.prefillCtx, pool, creq.Prefill), r.env, creq)
		if err != nil {
			r.report(ctx, pool, creq.Prefill, err)
		}
		return decode, err
	}
	actx, cancel := context.WithTimeoutCause(r.prefillCtx, pool.AttemptTimeout, errAttemptTimeout)
	defer cancel()
	decode, err := pool.Connector.Prepare(r.startAttempt(actx, pool, creq.Prefill), r.env, creq)
	if err != nil && context.Cause(actx) == errAttemptTimeout && r.prefillCtx.Err() == nil {
		err = fmt.Errorf("%w after %s", errAttemptTimeout, pool.AttemptTimeout)
	}
	r.report(ctx, pool, creq.Prefill, err)
	return decode, err
}

// report tells the pool's picker whether ep served the prefill. Only the
// endpoint's faults count: a request the engine rejected, or a client that
// went away, says nothing about the endpoint. Metrics and the attempt's
// span record every outcome.
func (r *request) report(ctx context.Context, pool *routing.Pool, ep endpoint.Endpoint, err error) {
	r.attemptDone(pool, ep, err)
	if err != nil && (ctx.Err() != nil || !endpointFault(err)) {
		return
	}
	pool.Prefill.Report(ep, err == nil)
	if err != nil && !pool.Prefill.Set.Healthy(ep) {
		r.log.LogAttrs(ctx, slog.LevelWarn, "prefill endpoint ejected", slog.String("pool", pool.Name), slog.String("endpoint", ep.Address))
	}
}

// prefillErr says which prefill failed, and names the overall timeout as
// such rather than as the context error it surfaces as.
func (r *request) prefillErr(pool *routing.Pool, ep endpoint.Endpoint, err error) error {
	if context.Cause(r.prefillCtx) == errPrefillTimeout {
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
