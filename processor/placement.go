package processor

import (
	"context"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/routing"
)

// place places the request in pool (package placement) and records how:
// the placement is the request's, whatever the outcome, for its leases to
// end with it.
func (r *request) place(ctx context.Context, pool *routing.Pool, creq *connectors.Request, model string) error {
	var err error
	r.placed, err = pool.Place(ctx, placement.Request{
		ID: r.id, Path: r.path, Body: creq.Body, Model: model,
		Subset: r.subset, Session: r.session, Adapter: r.adapter, Priority: r.priority(pool),
		Engine: r.env.Engine, Log: r.log,
		Admit: func(ctx context.Context, set *picker.Set, group, leg string, tokens int) (flowcontrol.Ticket, error) {
			r.flow.Tokens = tokens // token-usage fairness counts them
			return r.awaitRoom(ctx, pool, set, group, leg)
		},
	}, creq)
	if s := r.placed.Source; s != "" {
		r.obs.tokenized(pool, s)
	}
	if f := r.placed.RenderFailure; f != "" {
		r.obs.renderFailed(pool, f)
	}
	if r.placed.Decode.Endpoint().Address != "" {
		r.obs.picked(pool, "decode", r.placed.Decode.LoRA())
	}
	return err
}

// priority is the request's priority in pool: its objective's, 0 in a
// pool without flow control.
func (r *request) priority(pool *routing.Pool) int {
	if pool.Saturated == nil {
		return 0
	}
	return pool.Saturated.Flow.Priority(r.flow.Objective)
}
