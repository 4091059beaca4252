package enginesim

import (
	"context"
	"fmt"
	"net/http"
	"regexp"
	"time"
)

// p2pProtocol is vLLM's P2pNcclConnector as its xPyD proxy drives it: the
// request id, sent on both legs, names the prefill's and the decode's KV
// (ZMQ) addresses. The router calls the prefill and then the decode; the
// prefill sends the KV to the decode's KV listener, where the decode takes it
// by request id.
type p2pProtocol struct {
	s        *Server
	listener *sideServer
	received *handoffs // KV sent to this engine, by request id
}

func newP2PProtocol(ctx context.Context, s *Server) (*p2pProtocol, error) {
	p := &p2pProtocol{s: s, received: newHandoffs("request id", s.cfg.KVTTL)}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /sim/p2p/kv", p.handleKV)
	fallbackRoutes(mux, "/sim/p2p/kv")
	l, err := s.listenSide(ctx, sideKV, s.cfg.KVAddr, mux)
	if err != nil {
		return nil, err
	}
	p.listener = l
	return p, nil
}

// p2pRequestID is the request id format of vLLM's
// disagg_proxy_p2p_nccl_xpyd.py: "___prefill_addr_" + prefill KV address +
// "___decode_addr_" + decode KV address + "_" + uuid4().hex.
var p2pRequestID = regexp.MustCompile(`^___prefill_addr_(.+:\d+)___decode_addr_(.+:\d+)_([0-9a-f]{32})$`)

const p2pIDFormat = "___prefill_addr_<ip:port>___decode_addr_<ip:port>_<32 lowercase hex digits>"

// p2pLeg is what a P2P NCCL request id names.
type p2pLeg struct {
	prefillAddr, decodeAddr string
}

// engineRequestID is the id vLLM runs the request under, which the
// connector reads the addresses from: the X-Request-Id, but for the
// Responses API, which runs a request under its body's request_id
// (resp_<uuid> by default).
func (x *exchange) engineRequestID() string {
	if x.req.api != apiResponses {
		return x.rec.RequestID
	}
	var id string
	if err := x.req.field("request_id", &id); err != nil || id == "" {
		return "resp_" + randomHex(16)
	}
	return id
}

func parseP2PRequestID(id string) (p2pLeg, error) {
	if id == "" {
		return p2pLeg{}, badRequest("missing X-Request-Id header: P2P NCCL names the engines' KV addresses in it (%s)", p2pIDFormat)
	}
	m := p2pRequestID.FindStringSubmatch(id)
	if m == nil {
		return p2pLeg{}, badRequest("X-Request-Id %q is not a P2P NCCL request id (want %s)", id, p2pIDFormat)
	}
	return p2pLeg{prefillAddr: m[1], decodeAddr: m[2]}, nil
}

func (p *p2pProtocol) report(st *State, now time.Time) { st.addHandoffs(p.received, now) }

func (p *p2pProtocol) classify(x *exchange) (mode, error) {
	if err := foreignFields(x.req, ConnectorP2PNCCL); err != nil {
		return modePlain, err
	}
	id := x.engineRequestID()
	leg, err := parseP2PRequestID(id)
	if err != nil && x.req.api == apiResponses {
		err = badRequest("request_id %q of the Responses request is not a P2P NCCL request id (want %s)", id, p2pIDFormat)
	}
	if err != nil {
		return modePlain, err
	}
	x.leg = leg
	own := p.listener.addr
	switch p.s.cfg.Role {
	case RolePrefill:
		return modePrefill, nil
	case RoleDecode:
		return modeDecode, nil
	}
	// A kv_both engine plays the leg whose address is its own.
	switch {
	case leg.prefillAddr == own && leg.decodeAddr != own:
		return modePrefill, nil
	case leg.decodeAddr == own && leg.prefillAddr != own:
		return modeDecode, nil
	}
	return modePlain, badRequest("neither or both of prefill_addr %s and decode_addr %s in the request id are this engine's KV address %s",
		leg.prefillAddr, leg.decodeAddr, own)
}

// p2pKV is the body of POST /sim/p2p/kv on a decode engine's KV listener:
// the stand-in for the NCCL send of a request's KV.
type p2pKV struct {
	RequestID   string `json:"request_id"`
	Sender      string `json:"sender"` // the prefill's KV address
	Fingerprint string `json:"fingerprint"`
	Source      string `json:"source"` // the prefill's HTTP address
}

func (p *p2pProtocol) prefill(x *exchange) {
	s := p.s
	x.rec.Kind = KindPrefill
	leg := x.leg.(p2pLeg)
	if leg.prefillAddr != p.listener.addr {
		s.reject(x, badRequest("prefill_addr %s in the request id is not this prefill engine's KV address %s", leg.prefillAddr, p.listener.addr))
		return
	}
	ctx := x.r.Context()
	if err := s.computePrompt(ctx, x.req); err != nil {
		s.abandon(x, err)
		return
	}
	send := p2pKV{RequestID: x.rec.RequestID, Sender: p.listener.addr, Fingerprint: x.rec.Fingerprint, Source: s.addr}
	var ok struct{}
	what := "sending KV to decode_addr " + leg.decodeAddr
	if err := s.sideCall(ctx, s.client, what, "http://"+leg.decodeAddr+"/sim/p2p/kv", x.rec.RequestID, send, &ok); err != nil {
		if ctx.Err() != nil {
			s.abandon(x, ctx.Err())
			return
		}
		s.reject(x, &apiError{status: http.StatusBadGateway, msg: asAPIError(err).msg})
		return
	}
	// P2pNcclConnector sends the KV layer by layer as the prompt is
	// computed, whatever the request generates after it.
	toks, finish := prefillOutput(x, false)
	if s.awaitPrefillTokens(x, toks) {
		s.answerVLLMPrefill(x, toks, finish, nil)
	}
}

// handleKV receives the KV a prefill sends to this engine.
func (p *p2pProtocol) handleKV(w http.ResponseWriter, r *http.Request) {
	s := p.s
	sr := s.startSide(r, KindKVPush)
	var kv p2pKV
	if ae := sr.readSide(w, r, &kv); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	sr.rec.RequestID, sr.rec.Fingerprint = kv.RequestID, kv.Fingerprint
	leg, err := parseP2PRequestID(kv.RequestID)
	switch {
	case err != nil:
	case s.cfg.Role == RolePrefill:
		err = badRequest("engine is a KV producer (role prefill) and does not receive KV")
	case leg.decodeAddr != p.listener.addr:
		err = badRequest("KV for decode_addr %s was sent to the KV listener %s", leg.decodeAddr, p.listener.addr)
	case leg.prefillAddr != kv.Sender:
		err = badRequest("KV of request id %q came from %s, not from its prefill_addr %s", kv.RequestID, kv.Sender, leg.prefillAddr)
	default:
		if ae := p.received.put(kv.RequestID, kvAnswer{Fingerprint: kv.Fingerprint, RequestID: kv.RequestID, Source: kv.Source}, time.Now()); ae != nil {
			err = ae
		}
	}
	s.answerSide(w, r, sr, struct{}{}, err)
}

func (p *p2pProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	leg := x.leg.(p2pLeg)
	if leg.decodeAddr != p.listener.addr {
		s.reject(x, badRequest("decode_addr %s in the request id is not this decode engine's KV address %s", leg.decodeAddr, p.listener.addr))
		return
	}
	ctx, cancel := s.waitContext(x.r.Context())
	defer cancel()
	release := s.holdSlot()
	got, err := p.received.take(ctx, x.rec.RequestID, x.rec.RequestID, s.cfg.KVWaitTimeout)
	release()
	if ae, ok := err.(*apiError); ok && ae.status == http.StatusGatewayTimeout {
		err = &apiError{status: ae.status, msg: fmt.Sprintf("no KV arrived at KV listener %s for request id %q within %v (no prefill at %s sent it)",
			p.listener.addr, x.rec.RequestID, s.cfg.KVWaitTimeout, leg.prefillAddr)}
	}
	s.finishDecode(x, "request id "+x.rec.RequestID, got, err)
}
