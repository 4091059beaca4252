package connectors

import (
	"context"
	"fmt"
	"net"

	"github.com/pdx-router/pdx/internal/jsonedit"
)

// NIXL is vLLM's NixlConnector protocol: a sequential prefill, then a decode
// that pulls the prefilled KV blocks named by the prefill's kv_transfer_params.
// The "mooncake" connector with mooncake_protocol "nixl" (Kthena,
// vllm-ascend) is this connector too.
type NIXL struct{}

// nixlPrefillParams asks the prefill engine to keep the KV for a remote
// decode. It is only ever read (see stateless_test.go).
var nixlPrefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// Prepare implements [Connector].
func (NIXL) Prepare(ctx context.Context, engine Engine, req *Request) (Decode, error) {
	answer, err := engine.Post(ctx, req.Prefill, req.Path, req.ID, nixlPrefillBody(req.Body))
	if err != nil {
		return Decode{}, engineFailure(req.Prefill, err)
	}
	params, err := kvTransferParams(answer)
	if err != nil {
		return Decode{}, &EngineError{Endpoint: req.Prefill, Message: "reading kv_transfer_params", Err: err}
	}
	// params == nil (the prefill ended on EOS/stop) deletes the key: the
	// decode engine then recomputes from the plain client body. Either way a
	// client-sent kv_transfer_params never reaches the decode engine.
	return Decode{Body: nixlDecodeBody(req.Body, params)}, nil
}

func nixlPrefillBody(client jsonedit.Object) net.Buffers {
	var buf [maxEdits]jsonedit.Edit
	edits := prefillOnlyEdits(buf[:0], client)
	return enginePieces(client, append(edits, jsonedit.Set(keyKVTransferParams, nixlPrefillParams))...)
}

// nixlDecodeBody sets the prefill's kv_transfer_params; nil params leave the
// key out.
func nixlDecodeBody(client jsonedit.Object, params []byte) []byte {
	if params == nil {
		return engineBody(client)
	}
	return engineBody(client, jsonedit.Set(keyKVTransferParams, params))
}

// prefillOnlyEdits appends to dst the edits that turn a client body into a
// one-token, non-streaming request: the prefill's output is thrown away, only
// its KV matters. Callers pass a stack buffer (of maxEdits) as dst.
func prefillOnlyEdits(dst []jsonedit.Edit, client jsonedit.Object) []jsonedit.Edit {
	dst = append(dst,
		jsonedit.Set("stream", jsonFalse),
		jsonedit.Delete("stream_options"),
		jsonedit.Delete("min_tokens"),
		jsonedit.Delete("min_completion_tokens"),
	)
	// Limit the key the client used. Engines reject both set to 1, and vLLM
	// reads max_completion_tokens first when both are present.
	if client.Has("max_completion_tokens") {
		return append(dst,
			jsonedit.Set("max_completion_tokens", jsonOne),
			jsonedit.Delete("max_tokens"))
	}
	return append(dst, jsonedit.Set("max_tokens", jsonOne))
}

// kvTransferParams returns the raw kv_transfer_params object of a prefill
// answer, or nil when it is absent or null.
func kvTransferParams(answer []byte) ([]byte, error) {
	obj, err := jsonedit.Parse(answer)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadAnswer, err)
	}
	raw, ok := obj.Raw(keyKVTransferParams)
	if !ok || string(raw) == "null" {
		return nil, nil
	}
	if raw[0] != '{' {
		return nil, fmt.Errorf("%w: kv_transfer_params is %.40s, not an object", ErrBadAnswer, raw)
	}
	return raw, nil
}
