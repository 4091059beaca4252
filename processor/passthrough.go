package processor

import (
	"bytes"
	"encoding/json"
	"fmt"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// The requests pdx sends on without a prefill: pass-through paths, which a
// pool's decode endpoints serve as they are, and GET /v1/models, which pdx
// answers itself.

// passHeaders routes a request on a pass-through path that has no body,
// at its headers.
func (r *request) passHeaders(pool *routing.Pool) (*extprocv3.ProcessingResponse, error) {
	r.obs.pool(pool)
	r.session = r.sessionIn(pool)
	r.pool = pool
	pl, err := pool.PlaceDecode(r.subset, r.session)
	r.placed = pl
	if err != nil {
		return nil, err
	}
	r.obs.session(pool, picker.RoleDecode, pl.Decode.Session())
	r.enter(statePassThrough)
	return r.answer(decision{decode: pl.Decode.Endpoint(), atHeaders: true}), nil
}

// passBody decides where a request on a pass-through path goes once its
// body is in: to the pool of the model it names, with protocol fields
// stripped from a JSON body. Bodies that are not JSON (a form, an audio
// file) carry no protocol fields an engine reads and pass unchanged; one
// that looks like JSON but does not parse could hide them, and is refused.
func (r *request) passBody(raw []byte) (decision, error) {
	body, model := raw, ""
	if t := bytes.TrimLeft(raw, " \t\r\n"); len(t) > 0 && (t[0] == '{' || t[0] == '[') {
		obj, err := jsonedit.Parse(raw)
		if err != nil {
			return decision{}, bodyError(err)
		}
		if model, err = modelOf(obj); err != nil {
			return decision{}, err
		}
		body = connectors.Plain(obj)
	}
	pool, ok := r.table.PassThrough(r.path, model)
	switch {
	case !ok && model != "" && pool == nil:
		return decision{}, modelNotFound(model)
	case !ok:
		return decision{}, &apiError{status: 404, typ: typeInvalidRequest, code: "not_found",
			msg: fmt.Sprintf("no API at %s for model %q", r.path, model)}
	}
	r.obs.pool(pool)
	r.session = r.sessionIn(pool)
	r.pool = pool
	pl, err := pool.PlaceDecode(r.subset, r.session)
	r.placed = pl
	if err != nil {
		return decision{}, err
	}
	r.obs.session(pool, picker.RoleDecode, pl.Decode.Session())
	return decision{decode: pl.Decode.Endpoint(), body: body, unchanged: bytes.Equal(body, raw)}, nil
}

// models answers GET /v1/models with the models the pools serve.
func (r *request) models() *extprocv3.ProcessingResponse {
	names, created := r.table.Models()
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
	}
	list := struct {
		Object string  `json:"object"`
		Data   []model `json:"data"`
	}{Object: "list", Data: make([]model, len(names))}
	for i, n := range names {
		list.Data[i] = model{ID: n, Object: "model", Created: created.Unix(), OwnedBy: "pdx"}
	}
	body, _ := json.Marshal(list) // strings and numbers only
	r.enter(stateAnswered)
	return immediate(200, "application/json", body, "pdx_models", r.clientID)
}
