package connectors

import (
	"context"
	"fmt"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// P2PNCCL is vLLM's P2pNcclConnector protocol, as its xPyD proxy
// (disagg_proxy_p2p_nccl_xpyd.py) drives it: the request id names both
// engines' KV (ZMQ) addresses; the prefill engine sends the KV to the decode
// engine named in the id, which takes it by the same id. The prefill runs to
// its end before the decode is sent. It takes no dp_size: each rank of a
// vLLM engine has a ZMQ port of its own (P2pNcclEngine: kv_port plus the
// worker's rank), which the id would have to name.
type P2PNCCL struct{}

var _ Connector = P2PNCCL{}

func p2pNCCLSpec() Spec {
	// No decode fallback: the request id names the decode's address, to
	// which the prefill sends its KV.
	traits, build := fixed(P2PNCCL{}, Traits{Prefills: true})
	return Spec{Names: []string{"p2p-nccl"}, Fields: []string{FieldKVAddress}, Traits: traits, New: build, Validate: p2pNCCLValidate}
}

// p2pNCCLValidate requires every engine's ZMQ address: the request id
// names both legs' engines by it.
func p2pNCCLValidate(p *configv1.Pool, path string) []error {
	if k := p.GetKubernetes(); k != nil {
		if k.GetKvPort() == 0 {
			return []error{fieldError(path+".kubernetes.kv_port", `required with connector "p2p-nccl" (the engines' ZMQ kv_port)`)}
		}
		return nil
	}
	var errs []error
	paths, values := kvAddresses(p, path)
	for i, v := range values {
		if v == "" {
			errs = append(errs, fieldError(paths[i], `required with connector "p2p-nccl" (the engine's ZMQ kv_ip:kv_port)`))
		}
	}
	return errs
}

// Prepare implements [Connector].
func (P2PNCCL) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	if req.Prefill.KVAddress == "" || req.Decode.KVAddress == "" {
		// Config validation requires kv_address with p2p-nccl; this is a
		// configuration error, not an engine failure.
		return Handoff{}, fmt.Errorf("p2p-nccl: prefill %s or decode %s has no kv_address", req.Prefill.Address, req.Decode.Address)
	}
	id := p2pRequestID(req.Prefill.KVAddress, req.Decode.KVAddress)
	api := APIOf(req.Path)
	var buf [maxEdits]jsonedit.Edit
	edits := prefillOnlyEdits(buf[:0], api, req.Body)
	var decode []byte
	if api == APIResponses {
		// vLLM's Responses API runs a request under the body's request_id
		// (ResponsesRequest.request_id, which _create_responses passes to
		// the engine), not under X-Request-Id as chat does: the connector
		// reads the addresses from that id.
		rid := jsonedit.Set(keyResponsesRequestID, appendJSONString(nil, id))
		edits = append(edits, rid)
		decode = engineBody(req.Body, rid)
	} else {
		decode = engineBody(req.Body)
	}
	answer, err := env.Engine.Post(ctx, req.Prefill, req.Path, id, endpoint.Rank{}, enginePieces(nil, req.Body, edits...))
	if err != nil {
		return Handoff{}, engineFailure(req.Prefill, err)
	}
	return Handoff{Decode: Decode{Body: decode, RequestID: id}, Prefilled: prefilledOf(answer)}, nil
}

// keyResponsesRequestID is the member of a Responses body that names the
// request to the engine.
const keyResponsesRequestID = "request_id"

// p2pRequestID returns
// "___prefill_addr_<prefill kv>___decode_addr_<decode kv>_<uuid4 hex>".
// The fresh uuid keeps the KV of concurrent requests between the same two
// engines apart (the engines key the KV by the whole id).
func p2pRequestID(prefillKV, decodeKV string) string {
	return "___prefill_addr_" + prefillKV + "___decode_addr_" + decodeKV + "_" + uuidHex()
}
