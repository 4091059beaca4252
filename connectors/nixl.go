package connectors

import (
	"context"
	"fmt"
	"net"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// NIXL is vLLM's NixlConnector protocol: a sequential prefill, then a decode
// that pulls the prefilled KV blocks named by the prefill's kv_transfer_params.
// The "mooncake" connector with mooncake_protocol "nixl" (Kthena,
// vllm-ascend) is this connector too.
type NIXL struct{}

var (
	_ Connector = NIXL{}
	_ Held      = (*nixlHeld)(nil)
)

func nixlSpec() Spec {
	traits, build := fixed(NIXL{}, Traits{Prefills: true,
		// Any decode engine can read the prefill's blocks: the decode body's
		// kv_transfer_params name the prefill engine and its blocks, not a
		// decode. A decode that read them and then failed leaves the next
		// one nothing to read (the prefill frees blocks once read): vLLM's
		// kv_load_failure_policy says whether that one recomputes or fails.
		DecodeFallback: true})
	return Spec{Names: []string{"nixl"}, Fields: []string{FieldKVAddress, FieldDPSize}, ClientKeys: []string{keyKVTransferParams}, Traits: traits, New: build}
}

// nixlPrefillParams asks the prefill engine to keep the KV for a remote
// decode. It is only ever read (see stateless_test.go).
var nixlPrefillParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// Prepare implements [Connector].
func (NIXL) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	held := &nixlHeld{req: req}
	prefill := nixlPrefillBody(held.pieces[:0], APIOf(req.Path), req.Body, nixlPrefillParams)
	answer, err := env.Engine.Post(ctx, req.Prefill, req.Path, req.ID, req.PrefillRank, prefill)
	if err != nil {
		return Handoff{}, engineFailure(req.Prefill, err)
	}
	params, used, err := kvTransferParams(answer)
	if err == nil && params != nil {
		err = nixlKVSource(req, params)
	}
	if err != nil {
		return Handoff{}, &engines.Error{Endpoint: req.Prefill, Message: "reading kv_transfer_params", Err: err}
	}
	// params == nil (the prefill ended on EOS/stop) deletes the key: the
	// decode engine then recomputes from the plain client body, and the
	// prefill keeps nothing. Either way a client-sent kv_transfer_params
	// never reaches the decode engine.
	h := Handoff{Decode: Decode{Body: nixlDecodeBody(req.Body, params), Rank: req.DecodeRank}, Prefilled: used}
	if params != nil {
		held.params = params
		h.Held = held
	}
	return h, nil
}

// nixlKVSource checks the NIXL side channel that params name, the one the
// decode engine will pull the blocks from (see checkKVSource). Other
// members are passed on unchecked: vLLM versions keep adding some
// (dcp_size, pp_size, remote_num_tokens, ...).
func nixlKVSource(req *Request, params []byte) error {
	obj, err := jsonedit.Parse(params)
	if err != nil {
		return fmt.Errorf("%w: %w", engines.ErrBadAnswer, err)
	}
	rawHost, _ := obj.Raw("remote_host")
	host, ok := jsonString(rawHost)
	if !ok || len(host) == 0 {
		return fmt.Errorf("%w: kv_transfer_params.remote_host is %.40s, not a host name", engines.ErrBadAnswer, orAbsent(rawHost))
	}
	rawPort, _ := obj.Raw("remote_port")
	port, ok := jsonPort(rawPort)
	if !ok {
		return fmt.Errorf("%w: kv_transfer_params.remote_port is %.40s, not a port", engines.ErrBadAnswer, orAbsent(rawPort))
	}
	return checkKVSource(req, host, port)
}

// nixlPieces is how many pieces of a prefill body nixlHeld has room for:
// enough for a client body of up to 12 members, as many as jsonedit parses
// without allocating (EditedPieces' bound: 3 per member, 2 braces, 5 per
// value set).
const nixlPieces = 3*12 + 2 + 5*4

// nixlHeld is the KV blocks a NIXL prefill engine keeps for a decode: what
// the decode engine must be sent to free them. Prepare allocates it first,
// with room for the prefill body's pieces, so that a request costs one
// allocation besides its decode body.
// It keeps the request (the decode endpoint and rank, the path, the id and
// the client's body), which its stream keeps unchanged until the release.
type nixlHeld struct {
	req    *Request
	params []byte // the prefill answer's kv_transfer_params
	pieces [nixlPieces][]byte
}

// Release implements [Held]. It makes the prefill engine free the KV blocks
// it keeps for a decode that pdx will not send. vLLM offers no call for
// that (an abort that reaches a finished prefill is ignored, vLLM PR
// #25067); what frees them is a decode that reads them, or one aborted
// before it was scheduled (the decode then notifies the prefill, PR
// #19223). So the decode engine gets a one-token decode carrying the
// blocks, whose answer is thrown away. Left alone, the blocks stay until
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s), or the 30 s lease of newer vLLM.
func (h *nixlHeld) Release(ctx context.Context, env Env) error {
	r := h.req
	_, err := env.Engine.Post(ctx, r.Decode, r.Path, r.ID, r.DecodeRank, nixlPrefillBody(nil, APIOf(r.Path), r.Body, h.params))
	return err
}

// orAbsent is raw, or "nothing" for a missing value, for messages.
func orAbsent(raw []byte) []byte {
	if raw == nil {
		return []byte("nothing")
	}
	return raw
}

// nixlPrefillBody appends to dst the pieces of a one-token request carrying
// params: the prefill's (nixlPrefillParams), or a release's (the blocks).
func nixlPrefillBody(dst net.Buffers, api API, client jsonedit.Object, params []byte) net.Buffers {
	var buf [maxEdits]jsonedit.Edit
	edits := prefillOnlyEdits(buf[:0], api, client)
	return enginePieces(dst, client, append(edits, jsonedit.Set(keyKVTransferParams, params))...)
}

// nixlDecodeBody sets the prefill's kv_transfer_params; nil params leave the
// key out.
func nixlDecodeBody(client jsonedit.Object, params []byte) []byte {
	if params == nil {
		return engineBody(client)
	}
	return engineBody(client, jsonedit.Set(keyKVTransferParams, params))
}

// prefillOnlyEdits appends to dst the edits that turn a client body of api
// into a one-token, non-streaming request: the prefill's output is thrown
// away, only its KV matters. The limit must be 1 as vLLM reads it on each
// API:
//   - completions read only max_tokens (default 16), chat reads
//     max_completion_tokens first. So max_tokens is always 1, and
//     max_completion_tokens too when the client set it, as vLLM's own
//     proxy does;
//   - Responses reads only max_output_tokens (ResponsesRequest
//     .to_sampling_params; max_tokens is an extra field there, ignored);
//   - Messages reads only max_tokens, which it requires
//     (AnthropicMessagesRequest), and a thinking budget of type "enabled"
//     must be below it unless the request is a do_remote_decode prefill
//     (validate_thinking_budget): the budget only bounds sampling
//     (thinking_token_budget), so the prefill leaves it out.
//
// Callers pass a stack buffer (of maxEdits) as dst.
func prefillOnlyEdits(dst []jsonedit.Edit, api API, client jsonedit.Object) []jsonedit.Edit {
	dst = append(dst, jsonedit.Set("stream", jsonFalse), jsonedit.Delete("stream_options"))
	switch api {
	case APIResponses:
		return append(dst, jsonedit.Set("max_output_tokens", jsonOne))
	case APIMessages:
		dst = append(dst, jsonedit.Set("max_tokens", jsonOne))
		if thinkingBudget(client) {
			dst = append(dst, jsonedit.Delete("thinking"))
		}
		return dst
	}
	dst = append(dst,
		jsonedit.Delete("min_tokens"),
		jsonedit.Delete("min_completion_tokens"),
		jsonedit.Set("max_tokens", jsonOne),
	)
	if present(client, "max_completion_tokens") {
		dst = append(dst, jsonedit.Set("max_completion_tokens", jsonOne))
	}
	return dst
}

// thinkingBudget reports whether a Messages body asks for thinking with a
// token budget (thinking.type "enabled").
func thinkingBudget(client jsonedit.Object) bool {
	raw, ok := client.Raw("thinking")
	if !ok || len(raw) == 0 || raw[0] != '{' {
		return false
	}
	t, err := jsonedit.Parse(raw)
	if err != nil {
		return false
	}
	typ, _ := t.Raw("type")
	return string(typ) == `"enabled"`
}

// kvTransferParams returns the raw kv_transfer_params object of a prefill
// answer, or nil when it is absent or null.
func kvTransferParams(answer []byte) ([]byte, Prefilled, error) {
	obj, err := jsonedit.Parse(answer)
	if err != nil {
		return nil, Prefilled{}, fmt.Errorf("%w: %w", engines.ErrBadAnswer, err)
	}
	used := prefilled(obj)
	raw, ok := obj.Raw(keyKVTransferParams)
	if !ok || string(raw) == "null" {
		return nil, used, nil
	}
	if raw[0] != '{' {
		return nil, used, fmt.Errorf("%w: kv_transfer_params is %.40s, not an object", engines.ErrBadAnswer, raw)
	}
	return raw, used, nil
}
