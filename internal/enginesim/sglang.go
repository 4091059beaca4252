package enginesim

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// sglangProtocol is SGLang's PD disaggregation: the router sends the same
// request, with bootstrap_host, bootstrap_port and a random bootstrap_room,
// to a prefill and a decode engine at the same time. The prefill registers
// its KV under the room at its bootstrap server; the decode finds the
// prefill's bootstrap server from bootstrap_host:bootstrap_port and waits
// there for the room.
type sglangProtocol struct {
	s     *Server
	boot  *sideServer // nil on a decode engine
	rooms *handoffs
}

func newSGLangProtocol(ctx context.Context, s *Server) (*sglangProtocol, error) {
	p := &sglangProtocol{s: s, rooms: newHandoffs("bootstrap_room", s.cfg.KVTTL)}
	if s.cfg.Role == RoleDecode {
		return p, nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /sim/room", p.handleRoom)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	fallbackRoutes(mux, "/sim/room", "/health")
	boot, err := s.listenSide(ctx, sideBootstrap, s.cfg.BootstrapAddr, mux)
	if err != nil {
		return nil, err
	}
	p.boot = boot
	return p, nil
}

// bootstrap is a request's bootstrap fields; room is kept as its exact
// decimal text, never as a float.
type bootstrap struct {
	host string
	port int
	room string
}

func (b bootstrap) addr() string { return net.JoinHostPort(b.host, strconv.Itoa(b.port)) }

func (p *sglangProtocol) classify(x *exchange) (mode, error) {
	if err := foreignFields(x.req, ConnectorSGLang, "bootstrap_host", "bootstrap_port", "bootstrap_room"); err != nil {
		return modePlain, err
	}
	b, present, err := parseBootstrap(x.req)
	if err != nil {
		return modePlain, err
	}
	switch p.s.cfg.Role {
	case RolePrefill:
		if !present {
			return modePlain, badRequest("missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang prefill engine serves only disaggregated requests")
		}
		x.leg = b
		return modePrefill, nil
	case RoleDecode:
		if !present {
			return modePlain, badRequest("missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang decode engine needs them to find the prefill's KV")
		}
		x.leg = b
		return modeDecode, nil
	}
	// Without disaggregation SGLang ignores the bootstrap fields.
	return modePlain, nil
}

// parseBootstrap reads the bootstrap fields: all three or none (present
// false). bootstrap_room must be a JSON integer in [0, 2^64); it is parsed
// exactly, so a room beyond 2^53 keeps every digit.
func parseBootstrap(req *inferenceRequest) (bootstrap, bool, error) {
	var b bootstrap
	names := []string{"bootstrap_host", "bootstrap_port", "bootstrap_room"}
	var missing []string
	for _, name := range names {
		if !req.has(name) {
			missing = append(missing, name)
		}
	}
	switch len(missing) {
	case len(names):
		return b, false, nil
	case 0:
	default:
		return b, false, badRequest("bootstrap fields are incomplete: missing %s", strings.Join(missing, ", "))
	}
	var problems []string
	if err := json.Unmarshal(req.fields["bootstrap_host"], &b.host); err != nil || b.host == "" {
		problems = append(problems, "bootstrap_host must be a non-empty string, got "+string(req.fields["bootstrap_host"]))
	}
	if port, err := req.intField("bootstrap_port"); err != nil || port < 1 || port > 65535 {
		problems = append(problems, "bootstrap_port must be an integer port, got "+string(req.fields["bootstrap_port"]))
	} else {
		b.port = int(port)
	}
	if room, ok := uintText(req.fields["bootstrap_room"]); ok {
		b.room = room
	} else {
		problems = append(problems, "bootstrap_room must be an integer in [0, 2^64), got "+string(req.fields["bootstrap_room"]))
	}
	if len(problems) > 0 {
		return b, false, badRequest("invalid bootstrap fields: %s", strings.Join(problems, "; "))
	}
	return b, true, nil
}

// uintText returns the canonical decimal text of a JSON integer in
// [0, 2^64), without going through float64.
func uintText(raw json.RawMessage) (string, bool) {
	num, ok := jsonNumber(raw)
	if !ok {
		return "", false
	}
	n, err := strconv.ParseUint(num, 10, 64)
	if err != nil {
		return "", false
	}
	return strconv.FormatUint(n, 10), true
}

// jsonNumber returns the text of raw if it is a JSON number.
func jsonNumber(raw json.RawMessage) (string, bool) {
	var v any
	if err := decodeJSON(raw, &v); err != nil {
		return "", false
	}
	num, ok := v.(json.Number)
	return num.String(), ok
}

func (p *sglangProtocol) prefill(x *exchange) {
	s := p.s
	x.rec.Kind = KindPrefill
	b := x.leg.(bootstrap)
	if b.port != p.boot.port {
		s.reject(x, badRequest("bootstrap_port %d does not name this prefill engine's bootstrap server (port %d)", b.port, p.boot.port))
		return
	}
	if err := sleep(x.r.Context(), s.prefillTime(x.req)); err != nil {
		s.abandon(x, err)
		return
	}
	a := kvAnswer{Fingerprint: x.rec.Fingerprint, RequestID: x.rec.RequestID, Source: s.addr}
	if err := p.rooms.put(b.room, a, time.Now()); err != nil {
		s.reject(x, err)
		return
	}
	s.answerPrefill(x, "length")
}

// roomRequest is the body of POST /sim/room on a bootstrap server: the
// stand-in for the decode's handshake with the prefill for one room.
type roomRequest struct {
	Room   string `json:"room"`
	WaitMS int64  `json:"wait_ms"`
}

// decode waits for the room's KV and generates from it. A streaming decode
// answers 200 at once, as SGLang's server starts its streaming response
// before the request reaches the scheduler: X-Pdx-Sim-Kv and
// X-Pdx-Sim-Kv-Source come as trailers, and a failure to get the KV is an
// SSE error event.
func (p *sglangProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	b := x.leg.(bootstrap)
	if x.req.stream {
		if err := x.openStream(HeaderKV, HeaderKVSource); err != nil {
			s.abandon(x, err)
			return
		}
	}
	ctx, cancel := s.waitContext(x.r.Context())
	defer cancel()
	wait := s.cfg.KVWaitTimeout
	ctx, cancelWait := context.WithTimeout(ctx, wait+sideGrace)
	defer cancelWait()
	var got kvAnswer
	what := "KV pull of bootstrap_room " + b.room + " from the bootstrap server at " + b.addr()
	err := s.sideCall(ctx, s.waitClient(), what, "http://"+b.addr()+"/sim/room", x.rec.RequestID,
		roomRequest{Room: b.room, WaitMS: wait.Milliseconds()}, &got)
	s.finishDecode(x, "bootstrap_room "+b.room, got, err)
}

// sideGrace is how much longer than the wait a waiting side call may take
// before the caller gives up on the peer.
const sideGrace = 5 * time.Second

func (p *sglangProtocol) handleRoom(w http.ResponseWriter, r *http.Request) {
	s := p.s
	sr := s.startSide(r, KindKVPull)
	var rr roomRequest
	if ae := sr.readSide(w, r, &rr); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	room, ok := uintText(json.RawMessage(rr.Room))
	if !ok {
		s.answerSide(w, r, sr, nil, badRequest("room %q is not an integer in [0, 2^64)", rr.Room))
		return
	}
	ctx, cancel := s.waitContext(r.Context())
	defer cancel()
	a, err := p.rooms.take(ctx, room, sr.rec.RequestID, sideWait(rr.WaitMS))
	sr.rec.Fingerprint = a.Fingerprint
	s.answerSide(w, r, sr, a, err)
}
