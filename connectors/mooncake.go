package connectors

import (
	"context"
	"fmt"
	"net"
	"strconv"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
)

// Mooncake protocols (a pool's mooncake_protocol).
const (
	// MooncakeNIXL is the NIXL-style protocol Kthena and vllm-ascend use
	// with Mooncake: exactly the "nixl" connector. The default.
	MooncakeNIXL = "nixl"
	// MooncakeVLLM is upstream vLLM's MooncakeConnector protocol.
	MooncakeVLLM = "vllm"
)

var _ Connector = MooncakeVLLMConnector{}

func mooncakeSpec() Spec {
	return Spec{
		Names:      []string{"mooncake"},
		Fields:     []string{FieldMooncakeProtocol, FieldKVAddress, FieldDPSize},
		ClientKeys: []string{keyKVTransferParams},
		Defaults: func(p *configv1.Pool) {
			if p.MooncakeProtocol == "" {
				p.MooncakeProtocol = MooncakeNIXL
			}
		},
		Validate: mooncakeValidate,
		Traits: func(p *configv1.Pool) Traits {
			vllm := p.GetMooncakeProtocol() == MooncakeVLLM
			// The nixl protocol is NIXL's: any decode reads the prefill's
			// KV. vLLM's concurrent protocol has the prefill send its KV
			// to the decode that asked, under a transfer id: a second
			// decode cannot have it.
			return Traits{Prefills: true, Concurrent: vllm, DecodeFallback: !vllm}
		},
		New: func(p *configv1.Pool) (Connector, error) {
			switch p.GetMooncakeProtocol() {
			case "", MooncakeNIXL:
				return NIXL{}, nil
			case MooncakeVLLM:
				return MooncakeVLLMConnector{}, nil
			}
			return nil, fmt.Errorf("unknown mooncake protocol %q (known: %s, %s)", p.GetMooncakeProtocol(), MooncakeNIXL, MooncakeVLLM)
		},
	}
}

// mooncakeValidate checks the protocol, and that only the NIXL one, which
// reads KV sources from prefill answers, gets kv_address.
func mooncakeValidate(p *configv1.Pool, path string) []error {
	switch mp := p.GetMooncakeProtocol(); mp {
	case MooncakeNIXL:
		return nil
	case MooncakeVLLM:
		var errs []error
		paths, values := kvAddresses(p, path)
		for i, v := range values {
			if v != "" {
				errs = append(errs, fieldError(paths[i], `not valid with mooncake_protocol "vllm", which pdx gives the bootstrap address itself`))
			}
		}
		if p.GetKubernetes().GetKvPort() != 0 {
			errs = append(errs, fieldError(path+".kubernetes.kv_port", `not valid with mooncake_protocol "vllm"`))
		}
		return errs
	default:
		return []error{fieldError(path+".mooncake_protocol", "%q is not %q or %q", mp, MooncakeNIXL, MooncakeVLLM)}
	}
}

// MooncakeVLLMConnector is upstream vLLM's MooncakeConnector protocol, as its
// example proxy (mooncake_connector_proxy.py) drives it. Prefill and decode
// run at the same time and meet on a transfer id: the prefill engine keeps
// the KV under it, the decode engine asks the prefill's bootstrap server for
// it. The decode needs the prefill engine's id, which pdx reads from that
// bootstrap server's /query before it starts either leg.
type MooncakeVLLMConnector struct{}

// Prepare implements [Connector].
func (MooncakeVLLMConnector) Prepare(ctx context.Context, env Env, req *Request) (Handoff, error) {
	host := req.Prefill.Host()
	if host == "" {
		return Handoff{}, &engines.Error{Endpoint: req.Prefill, Message: "address is not ip:port"}
	}
	bootstrap := net.JoinHostPort(host, strconv.Itoa(req.Prefill.Bootstrap()))
	// The bootstrap server lists an engine per DP rank: the decode pulls
	// from the one of the rank the prefill runs on.
	rank, key := 0, bootstrap
	if r, ok := req.PrefillRank.Get(); ok {
		rank, key = r, bootstrap+"/dp"+strconv.Itoa(r)
	}
	engineID, err := env.EngineIDs.get(ctx, key, func(ctx context.Context) ([]byte, error) {
		return queryEngineID(ctx, env.Engine, req.Prefill, bootstrap, rank)
	})
	if err != nil {
		return Handoff{}, err
	}
	// As upstream's proxy does, both legs carry a fresh request id and the
	// transfer id "xfer-<id>", under which both engines name the KV. Fresh
	// per attempt: a client's X-Request-Id may repeat, and two requests on
	// one transfer id would hand each other's KV over.
	id := uuidHex()
	transferID := appendJSONString(nil, "xfer-"+id)
	var buf [maxEdits]jsonedit.Edit
	prefill := enginePieces(nil, req.Body, append(prefillOnlyEdits(buf[:0], APIOf(req.Path), req.Body),
		jsonedit.Set(keyKVTransferParams, mooncakePrefillParams(transferID)))...)
	decode := engineBody(req.Body,
		jsonedit.Set(keyKVTransferParams, mooncakeDecodeParams(transferID, "http://"+bootstrap, engineID)))
	failed := func() { env.EngineIDs.forget(key, engineID) } // the engine may have restarted
	return Handoff{Decode: Decode{Body: decode, RequestID: id, Rank: req.DecodeRank},
		Prefill: startPrefill(ctx, env.Engine, req.Prefill, req.Path, id, req.PrefillRank, prefill, failed)}, nil
}

// queryEngineID asks the bootstrap server at addr for the engine id of DP
// rank rank of the prefill engine ep.
func queryEngineID(ctx context.Context, engine Engine, ep endpoint.Endpoint, addr string, rank int) ([]byte, error) {
	answer, err := engine.Get(ctx, addr, "/query")
	if err != nil {
		// Status 0: whatever the bootstrap server said, the client's request
		// is not at fault; the prefill engine is unavailable.
		return nil, &engines.Error{Endpoint: ep, Message: "querying Mooncake bootstrap server " + addr, Err: err}
	}
	id, err := mooncakeEngineID(answer, rank)
	if err != nil {
		return nil, &engines.Error{Endpoint: ep, Message: "reading Mooncake bootstrap server " + addr + " /query", Err: err}
	}
	return id, nil
}

// mooncakePrefillParams asks the prefill engine to keep the KV for a remote
// decode under transferID (a JSON string).
func mooncakePrefillParams(transferID []byte) []byte {
	b := make([]byte, 0, 64+len(transferID))
	b = append(b, `{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":`...)
	b = append(b, transferID...)
	return append(b, '}')
}

// mooncakeDecodeParams asks the decode engine to pull the KV kept under
// transferID by engineID (a JSON string) from the bootstrap server at
// bootstrapURL.
func mooncakeDecodeParams(transferID []byte, bootstrapURL string, engineID []byte) []byte {
	b := make([]byte, 0, 128+len(transferID)+len(bootstrapURL)+len(engineID))
	b = append(b, `{"do_remote_decode":false,"do_remote_prefill":true,"remote_bootstrap_addr":`...)
	b = appendJSONString(b, bootstrapURL)
	b = append(b, `,"remote_engine_id":`...)
	b = append(b, engineID...)
	b = append(b, `,"transfer_id":`...)
	b = append(b, transferID...)
	return append(b, '}')
}

// mooncakeEngineID returns the engine id of data-parallel rank rank, as a
// JSON string, from a bootstrap server's /query answer. The answer maps each
// dp rank to its engine: {"0":{"engine_id":"...","worker_addr":{...}}, ...}.
// Upstream's proxy pins each prefill to a rank with an X-data-parallel-rank
// header, as pdx does when the endpoint has a dp_size; without one, the
// engine has one rank, 0.
func mooncakeEngineID(answer []byte, rank int) ([]byte, error) {
	ranks, err := jsonedit.Parse(answer)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", engines.ErrBadAnswer, err)
	}
	raw, ok := ranks.Raw(strconv.Itoa(rank))
	if !ok {
		return nil, fmt.Errorf("%w: no dp rank %d registered (answer %.80s)", engines.ErrBadAnswer, rank, answer)
	}
	entry, err := jsonedit.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("%w: dp rank %d is %.40s, not an object", engines.ErrBadAnswer, rank, raw)
	}
	id, ok := entry.Raw("engine_id")
	if !ok || id[0] != '"' || len(id) == 2 {
		return nil, fmt.Errorf("%w: dp rank %d has no engine_id string", engines.ErrBadAnswer, rank)
	}
	return id, nil
}
