package processor

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// The headers a request names its objective, its flow and its TTFT SLO
// in: llm-d's, and the Gateway API Inference Extension's older spellings,
// which llm-d still accepts (the newer wins when both come).
const (
	ObjectiveHeader    = "x-llm-d-inference-objective"
	objectiveHeaderOld = "x-gateway-inference-objective"
	FairnessHeader     = "x-llm-d-inference-fairness-id"
	fairnessHeaderOld  = "x-gateway-inference-fairness-id"
	SLOTTFTHeader      = "x-llm-d-slo-ttft-ms"
)

// flowHeaders reads what flow control knows of the request from its
// headers, in one pass.
func (r *request) flowHeaders(h *extprocv3.HttpHeaders) error {
	var objOld, flowOld, slo string
	for _, hv := range h.GetHeaders().GetHeaders() {
		var dst *string
		switch hv.GetKey() {
		case ObjectiveHeader:
			dst = &r.flow.Objective
		case objectiveHeaderOld:
			dst = &objOld
		case FairnessHeader:
			dst = &r.flow.Flow
		case fairnessHeaderOld:
			dst = &flowOld
		case SLOTTFTHeader:
			dst = &slo
		default:
			continue
		}
		if raw := hv.GetRawValue(); raw != nil {
			*dst = string(raw)
		} else {
			*dst = hv.GetValue()
		}
	}
	if r.flow.Objective == "" {
		r.flow.Objective = objOld
	}
	if r.flow.Flow == "" {
		r.flow.Flow = flowOld
	}
	if slo != "" {
		ms, err := strconv.ParseUint(slo, 10, 31)
		if err != nil || ms == 0 {
			return &apiError{status: 400, typ: typeInvalidRequest, code: "invalid_header",
				msg: fmt.Sprintf("%s must be a positive whole number of milliseconds, got %.40q", SLOTTFTHeader, slo)}
		}
		r.flow.Deadline = r.start.Add(time.Duration(ms) * time.Millisecond)
	}
	return nil
}

// awaitRoom admits the request to a leg (set, in group): at once while the
// leg has room and nobody waits for it, else in its turn by the pool's
// flow control, or fails with 429. The ticket is to be released once the
// request's pick on the leg counts.
func (r *request) awaitRoom(ctx context.Context, pool *routing.Pool, set *picker.Set, group, leg string) (flowcontrol.Ticket, error) {
	shed := pool.Saturated
	if shed == nil {
		return flowcontrol.Ticket{}, nil
	}
	t, err := shed.Flow.Wait(ctx, set, group, &r.flow)
	if err == nil && t.Waited() == 0 {
		return t, nil // admitted at once: nothing to record
	}
	priority := r.priority(pool)
	r.obs.waited(pool, leg, priority, t.Waited(), err)
	if err == nil || !errors.Is(err, flowcontrol.ErrTimedOut) && !errors.Is(err, flowcontrol.ErrFull) && !errors.Is(err, flowcontrol.ErrDisplaced) {
		return t, err
	}
	why := ""
	switch {
	case errors.Is(err, flowcontrol.ErrFull):
		why = " and its queue is full"
	case errors.Is(err, flowcontrol.ErrDisplaced):
		why = " and a request of a higher priority took this one's place in its queue"
	case shed.Flow.MaxWait(priority) > 0:
		why = fmt.Sprintf(" and none had room within %s", shed.Flow.MaxWait(priority))
	}
	msg := fmt.Sprintf("every %s engine of pool %s is saturated%s", leg, pool.Name, why)
	if priority != 0 {
		msg += fmt.Sprintf(" (objective %q, priority %d)", r.flow.Objective, priority)
	}
	return t, &apiError{status: 429, typ: typeServer, code: "overloaded", msg: msg + "; retry later", retryAfter: 1}
}
