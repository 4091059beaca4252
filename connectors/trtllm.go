package connectors

import (
	"context"
	"encoding/json"
	"fmt"
	"net"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// TRTLLM is TensorRT-LLM's disaggregated serving protocol, as its disagg
// server drives it (context first): a context_only request to the context
// server, whose answer carries disaggregated_params (the context request id,
// the first generated tokens, an opaque transfer state), then a
// generation_only request carrying those params to the generation server.
type TRTLLM struct{}

// trtllmContextParams marks a request as context only. It is only ever read
// (see stateless_test.go).
var trtllmContextParams = []byte(`{"request_type":"context_only"}`)

// trtllmGenerationOnly is the request_type of the generation leg.
var trtllmGenerationOnly = []byte(`"generation_only"`)

// Prepare implements [Connector].
func (TRTLLM) Prepare(ctx context.Context, engine Engine, req *Request) (Decode, error) {
	answer, err := engine.Post(ctx, req.Prefill, req.Path, req.ID, trtllmContextBody(req.Body))
	if err != nil {
		return Decode{}, engineFailure(req.Prefill, err)
	}
	params, err := trtllmGenerationParams(answer)
	if err != nil {
		return Decode{}, &EngineError{Endpoint: req.Prefill, Message: "reading disaggregated_params", Err: err}
	}
	if params == nil {
		// The context server finished the request (EOS or a stop string on
		// the first token). Upstream's disagg server then answers with the
		// context response; pdx cannot, so the generation server computes
		// the request in full from the plain client body.
		return Decode{Body: engineBody(req.Body)}, nil
	}
	return Decode{Body: engineBody(req.Body, jsonedit.Set(keyDisaggregatedParams, params))}, nil
}

// trtllmContextBody is the client body as a context-only, non-streaming
// request. Like upstream's disagg server, pdx leaves the output limit alone.
func trtllmContextBody(client jsonedit.Object) net.Buffers {
	return enginePieces(client,
		jsonedit.Set("stream", []byte("false")),
		jsonedit.Delete("stream_options"),
		jsonedit.Set(keyDisaggregatedParams, trtllmContextParams))
}

// trtllmGenerationParams returns the context answer's
// choices[0].disaggregated_params with request_type "generation_only", every
// other member's bytes unchanged (ctx_request_id is a 64-bit integer). It
// returns nil params when the context server finished the request.
func trtllmGenerationParams(answer []byte) ([]byte, error) {
	resp, err := jsonedit.Parse(answer)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadAnswer, err)
	}
	rawChoices, ok := resp.Raw("choices")
	if !ok {
		return nil, fmt.Errorf("%w: no choices", ErrBadAnswer)
	}
	// RawMessage keeps each choice's bytes; nothing goes through float64.
	var choices []json.RawMessage
	if err := json.Unmarshal(rawChoices, &choices); err != nil || len(choices) != 1 {
		return nil, fmt.Errorf("%w: choices is %.40s, not an array of one choice", ErrBadAnswer, rawChoices)
	}
	choice, err := jsonedit.Parse(choices[0])
	if err != nil {
		return nil, fmt.Errorf("%w: choices[0] is %.40s, not an object", ErrBadAnswer, choices[0])
	}
	raw, ok := choice.Raw(keyDisaggregatedParams)
	if !ok || string(raw) == "null" {
		return nil, fmt.Errorf("%w: choices[0] has no disaggregated_params", ErrBadAnswer)
	}
	params, err := jsonedit.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: disaggregated_params is %.40s, not an object", ErrBadAnswer, raw)
	}
	if id, ok := params.Raw("ctx_request_id"); !ok || !isJSONNumber(id) {
		return nil, fmt.Errorf("%w: disaggregated_params has no ctx_request_id", ErrBadAnswer)
	}
	if trtllmFinished(choice) {
		return nil, nil
	}
	edit := jsonedit.Set("request_type", trtllmGenerationOnly)
	return params.AppendEdited(make([]byte, 0, params.EditedLen(edit)), edit), nil
}

// trtllmFinished reports whether a context answer's choice ended the request:
// upstream's disagg server skips the generation leg unless finish_reason is
// "length" or "not_finished". pdx is lenient where upstream is strict: a
// missing or null finish_reason counts as not finished.
func trtllmFinished(choice jsonedit.Object) bool {
	raw, ok := choice.Raw("finish_reason")
	if !ok || raw[0] != '"' {
		return false
	}
	var reason string
	if json.Unmarshal(raw, &reason) != nil {
		return false
	}
	return reason != "length" && reason != "not_finished"
}

// isJSONNumber reports whether raw, a valid JSON value, is a number.
func isJSONNumber(raw []byte) bool {
	return raw[0] == '-' || raw[0] >= '0' && raw[0] <= '9'
}
