package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// sglangProtocol is SGLang's PD disaggregation: the router sends the same
// request, with bootstrap_host, bootstrap_port and a random bootstrap_room,
// to a prefill and a decode engine at the same time. The prefill registers
// its KV under the room at its bootstrap server; the decode finds the
// prefill's bootstrap server from bootstrap_host:bootstrap_port and waits
// there for the room.
//
// Requests have SGLang's request ids (rid) and can be aborted by them with
// POST /abort_request, which frees what they hold.
type sglangProtocol struct {
	s     *Server
	boot  *sideServer // nil on a decode engine
	rooms *handoffs

	mu       sync.Mutex
	inflight map[string]*sglangReq // by rid: requests whose handler runs
	aborted  int                   // requests and held KV aborted by /abort_request
	gone     int                   // requests whose client left and which SGLang has not noticed yet (for tests)
}

func newSGLangProtocol(ctx context.Context, s *Server) (*sglangProtocol, error) {
	p := &sglangProtocol{s: s, rooms: newHandoffs("bootstrap_room", s.cfg.KVTTL), inflight: make(map[string]*sglangReq)}
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

func (p *sglangProtocol) addRoutes(mux *http.ServeMux) []string {
	mux.HandleFunc("POST /abort_request", p.handleAbort)
	return []string{"/abort_request"}
}

func (p *sglangProtocol) report(st *State, now time.Time) {
	st.addHandoffs(p.rooms, now)
	p.mu.Lock()
	defer p.mu.Unlock()
	st.Aborted += p.aborted
}

// sglangLeg is what classify parsed of a request for its serve method.
type sglangLeg struct {
	boot bootstrap
	req  *sglangReq
	// prefillRank is a decode's disagg_prefill_dp_rank, if prefillRanked.
	prefillRank   int
	prefillRanked bool
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
	m := modePlain // without disaggregation SGLang ignores the bootstrap fields
	switch p.s.cfg.Role {
	case RolePrefill:
		if !present {
			return modePlain, badRequest("missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang prefill engine serves only disaggregated requests")
		}
		m = modePrefill
	case RoleDecode:
		if !present {
			return modePlain, badRequest("missing bootstrap_host, bootstrap_port and bootstrap_room: an SGLang decode engine needs them to find the prefill's KV")
		}
		m = modeDecode
	}
	rid, given, err := parseRID(x.req)
	if err != nil {
		return modePlain, err
	}
	if given {
		x.rec.RID = rid
	}
	pr, ranked, err := prefillRank(x.req)
	if err != nil {
		return modePlain, err
	}
	q, err := p.register(x, rid, given)
	if err != nil {
		return modePlain, err
	}
	x.leg = &sglangLeg{boot: b, req: q, prefillRank: pr, prefillRanked: ranked}
	return m, nil
}

// parseRID reads the request id SGLang's OpenAI requests take in the body
// (rid: Optional[Union[List[str], str]], protocol.py); without one SGLang
// makes one up (GenerateReqInput normalization). The simulator serves one
// request a body, so a list must hold one rid.
func parseRID(req *inferenceRequest) (string, bool, error) {
	if !req.has("rid") {
		return randomHex(16), false, nil
	}
	var rid string
	if err := json.Unmarshal(req.fields["rid"], &rid); err == nil {
		return rid, true, nil
	}
	var rids []string
	if err := json.Unmarshal(req.fields["rid"], &rids); err != nil {
		return "", false, badRequest("rid must be a string or a list of strings, got %s", req.fields["rid"])
	}
	if len(rids) != 1 {
		return "", false, badRequest("rid lists %d request ids; the simulator serves one request a body", len(rids))
	}
	return rids[0], true, nil
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
	leg := x.leg.(*sglangLeg)
	b := leg.boot
	if b.port != p.boot.port {
		s.reject(x, badRequest("bootstrap_port %d does not name this prefill engine's bootstrap server (port %d)", b.port, p.boot.port))
		return
	}
	ctx := x.workContext()
	if err := s.computePrompt(ctx, x.req); err != nil {
		s.interrupted(x, ctx, nil)
		return
	}
	a := kvAnswer{Fingerprint: x.rec.Fingerprint, RequestID: x.rec.RequestID, Source: s.addr, Rank: x.rank}
	if err := p.hold(leg.req, s.rankedKey(b.room, x.rank), a); err != nil {
		if errors.Is(err, errAborted) {
			s.interrupted(x, ctx, nil)
			return
		}
		s.reject(x, err)
		return
	}
	s.answerPrefill(x, "length")
}

// hold registers the KV of a finished prefill under its room, held for its
// decode. The engine answers the prefill at once, but SGLang's prefill
// request stays in flight until its KV is sent, so the rid stays in use
// (and abortable) as long as the KV is held.
func (p *sglangProtocol) hold(q *sglangReq, room string, a kvAnswer) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if q.aborted {
		return errAborted
	}
	if ae := p.rooms.putOwned(room, q.rid, a, time.Now()); ae != nil {
		return ae
	}
	return nil
}

// roomRequest is the body of POST /sim/room on a bootstrap server: the
// stand-in for the decode's handshake with the prefill for one room.
type roomRequest struct {
	Room   string `json:"room"`
	WaitMS int64  `json:"wait_ms"`
	// Rank is the prefill DP rank the decode connects to: its
	// disagg_prefill_dp_rank. nil: the decode asks the bootstrap server
	// which rank has the room (decode.py, _resolve_pending_reqs).
	Rank *int `json:"dp_rank,omitempty"`
}

// decode waits for the room's KV and generates from it. A streaming decode
// answers 200 at once, as SGLang's server starts its streaming response
// before the request reaches the scheduler: X-Pdx-Sim-Kv and
// X-Pdx-Sim-Kv-Source come as trailers, and a failure to get the KV is an
// SSE error event.
//
// While it waits the decode holds its pre-allocated KV pages (a slot):
// until the KV arrives, it is aborted, or SGLANG_DISAGGREGATION_WAITING_TIMEOUT
// (KVWaitTimeout) passes. A client that goes away meanwhile is noticed only
// at SGLang's next disconnect check.
func (p *sglangProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	leg := x.leg.(*sglangLeg)
	b := leg.boot
	if x.req.stream {
		if err := x.openStream(HeaderKV, HeaderKVSource); err != nil {
			s.abandon(x, err)
			return
		}
	}
	work := x.workContext()
	wait := s.cfg.KVWaitTimeout
	ctx, cancelWait := context.WithTimeout(work, wait+sideGrace)
	defer cancelWait()
	var got kvAnswer
	what := "KV pull of bootstrap_room " + b.room + " from the bootstrap server at " + b.addr()
	rr := roomRequest{Room: b.room, WaitMS: wait.Milliseconds()}
	if leg.prefillRanked {
		rr.Rank = &leg.prefillRank
		what += " for prefill DP rank " + strconv.Itoa(leg.prefillRank)
	}
	release := s.holdSlot()
	err := s.sideCall(ctx, s.waitClient(), what, "http://"+b.addr()+"/sim/room", x.rec.RequestID, rr, &got)
	release()
	switch cause := context.Cause(work); {
	case errors.Is(cause, errAborted):
		// decode.py pop_transferred: a failed receiver aborts the request
		// with status 500; kv_receiver.abort() records "Aborted by AbortReq.".
		s.reject(x, &apiError{status: http.StatusInternalServerError, msg: transferFailed(leg, "Aborted by AbortReq.")})
		return
	case errors.Is(cause, errClientNoticed):
		s.abandon(x, cause)
		return
	}
	if ae, ok := errors.AsType[*apiError](err); ok && ae.status == http.StatusGatewayTimeout {
		// The receiver's WaitingForInput timeout fails the request like an
		// abort does: status 500, not a gateway timeout.
		err = &apiError{status: http.StatusInternalServerError,
			msg: transferFailed(leg, fmt.Sprintf("timed out after %.1fs in KVPoll.WaitingForInput (%s)", wait.Seconds(), ae.msg))}
	}
	x.rec.KVSourceRank = got.Rank
	s.finishDecode(x, "bootstrap_room "+b.room, got, err)
}

// transferFailed is SGLang's message for a decode whose KV transfer failed
// (decode.py DecodeTransferQueue.pop_transferred).
func transferFailed(leg *sglangLeg, reason string) string {
	return fmt.Sprintf("Decode transfer failed for request rank=0 decode_req.req.rid='%s' decode_req.req.bootstrap_room=%s with exception %s",
		leg.req.rid, leg.boot.room, reason)
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
	// Each DP rank registers the rooms it prefills. A decode told a rank
	// waits on that rank's registration alone: told the wrong one, it
	// waits for KV that never comes there, until its timeout.
	keys := make([]string, 0, s.dpSize())
	if rr.Rank != nil {
		keys = append(keys, s.rankedKey(room, *rr.Rank))
	} else {
		for r := range s.dpSize() {
			keys = append(keys, s.rankedKey(room, r))
		}
	}
	ctx, cancel := s.waitContext(r.Context())
	defer cancel()
	a, err := p.rooms.takeAny(ctx, keys, sr.rec.RequestID, sideWait(rr.WaitMS))
	sr.rec.Fingerprint = a.Fingerprint
	s.answerSide(w, r, sr, a, err)
}

// sglangReq is a request in flight on an SGLang engine.
type sglangReq struct {
	p       *sglangProtocol
	rid     string
	given   bool // the client set the rid
	arrived time.Time
	// work is the request's context while it computes or waits: detached
	// from the client, whose going away SGLang notices only at its checks;
	// run, the context of generation, ends with the client.
	work, run             context.Context
	cancelWork, cancelRun context.CancelCauseFunc
	stops                 []func() bool
	aborted               bool // guarded by p.mu

	mu    sync.Mutex
	over  bool        // the handler returned
	check *time.Timer // the disconnect check that will notice the gone client
}

// errClientNoticed ends the work of a request whose gone client SGLang's
// tokenizer manager noticed at a disconnect check, aborting it.
var errClientNoticed = errors.New("noticed at SGLang's disconnect check, which aborted the request")

// register puts a request in flight under its rid. SGLang's tokenizer
// manager refuses a rid already in flight: `raise ValueError(f"Duplicate
// request ID detected: {rid}")` in _init_req_state (tokenizer_manager.py),
// which its OpenAI server answers with 400.
func (p *sglangProtocol) register(x *exchange, rid string, given bool) (*sglangReq, error) {
	s := p.s
	r := x.r
	q := &sglangReq{p: p, rid: rid, given: given, arrived: time.Now()}
	p.mu.Lock()
	defer p.mu.Unlock()
	_, dup := p.inflight[rid]
	if given && !dup {
		dup = p.holds(rid, q.arrived)
	}
	if dup {
		return nil, badRequest("Duplicate request ID detected: %s", rid)
	}
	q.work, q.cancelWork = context.WithCancelCause(context.WithoutCancel(r.Context()))
	q.run, q.cancelRun = context.WithCancelCause(r.Context())
	// The callbacks run in goroutines of their own, so they may take p.mu.
	q.stops = []func() bool{
		context.AfterFunc(s.waitsDone, func() { q.cancelWork(context.Canceled) }),
		context.AfterFunc(r.Context(), q.clientGone),
	}
	p.inflight[rid] = q
	x.work, x.run = q.work, q.run
	x.onDone(q.finish)
	return q, nil
}

// holds reports whether a prefill's KV held for its decode is owned by rid.
// p.mu is held.
func (p *sglangProtocol) holds(rid string, now time.Time) bool {
	for _, owner := range p.rooms.owners(now) {
		if owner == rid {
			return true
		}
	}
	return false
}

// clientGone runs when the client has gone away: SGLang's tokenizer
// manager, waiting with asyncio.wait_for(state.event.wait(), timeout=4),
// notices it at the end of the current wait and aborts the request.
func (q *sglangReq) clientGone() {
	every := q.p.s.cfg.DisconnectCheckInterval
	next := every - time.Since(q.arrived)%every
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.over {
		return
	}
	q.p.countGone(1)
	q.check = time.AfterFunc(next, func() {
		q.p.countGone(-1)
		q.cancelWork(errClientNoticed)
	})
}

func (p *sglangProtocol) countGone(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gone += n
}

// finish takes the request out of flight once its handler returns.
func (q *sglangReq) finish() {
	q.mu.Lock()
	q.over = true
	if q.check != nil && q.check.Stop() {
		q.p.countGone(-1)
	}
	q.mu.Unlock()
	for _, stop := range q.stops {
		stop()
	}
	q.cancelWork(nil)
	q.cancelRun(nil)
	q.p.mu.Lock()
	delete(q.p.inflight, q.rid)
	q.p.mu.Unlock()
}

// abort aborts the requests /abort_request names and returns how many. The
// tokenizer manager forwards an abort only for a rid it has in flight
// (abort_request: `if not abort_all and rid not in self.rid_to_state:
// return`); the scheduler then aborts every request whose rid starts with it
// (`req.rid.startswith(recv_req.rid)`), freeing a waiting decode's
// pre-allocated KV and a prefill's KV held for its decode.
func (p *sglangProtocol) abort(rid string, all bool) int {
	now := time.Now()
	p.mu.Lock()
	if !all {
		if _, ok := p.inflight[rid]; !ok && !p.holds(rid, now) {
			p.mu.Unlock()
			return 0
		}
	}
	match := func(r string) bool { return all || strings.HasPrefix(r, rid) }
	var hit []*sglangReq
	for r, q := range p.inflight {
		if match(r) && !q.aborted {
			q.aborted = true
			hit = append(hit, q)
		}
	}
	n := len(hit) + p.rooms.drop(match, now)
	p.aborted += n
	p.mu.Unlock()
	for _, q := range hit {
		q.cancelWork(errAborted)
		q.cancelRun(errAborted)
	}
	return n
}

// abortRequest is the body of POST /abort_request: SGLang's AbortReq (rid:
// Optional[str], null meaning "", and abort_all: bool = False).
type abortRequest struct {
	RID      *string `json:"rid"`
	AbortAll bool    `json:"abort_all"`
}

// handleAbort serves SGLang's POST /abort_request (http_server.py), which
// answers 200 with no body whether or not the rid named a request; a body
// that fails validation gets 400.
func (p *sglangProtocol) handleAbort(w http.ResponseWriter, r *http.Request) {
	s := p.s
	sr := s.startSide(r, KindAbort)
	var ar abortRequest
	if ae := sr.readSide(w, r, &ar); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	if ar.RID != nil {
		sr.rec.RID = *ar.RID
	}
	p.abort(sr.rec.RID, ar.AbortAll)
	sr.rec.Status = http.StatusOK
	s.commit(sr.seq, sr.rec)
	w.WriteHeader(http.StatusOK)
}
