package enginesim

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// mooncakeProtocol is upstream vLLM's MooncakeConnector (Connector
// "mooncake", MooncakeProtocol "vllm"). The router reads the prefill
// engine's id from its bootstrap server's GET /query, then sends the prefill
// (do_remote_decode, transfer_id) and the decode (do_remote_prefill,
// remote_bootstrap_addr, remote_engine_id, transfer_id) at the same time.
// The decode asks the bootstrap server for the engine's worker and pulls the
// KV of the transfer id from it, waiting for a prefill still running.
type mooncakeProtocol struct {
	s         *Server
	boot      *sideServer // nil on a decode engine
	transfers *handoffs

	mu            sync.Mutex
	queries       int                                  // GET /query calls, but those of simulated decode engines
	engineQueries int                                  // GET /query calls of simulated decode engines
	engines       map[string]map[string]mooncakeEngine // a decode's /query answers, by bootstrap host:port
}

func (p *mooncakeProtocol) report(st *State, now time.Time) {
	st.addHandoffs(p.transfers, now)
	p.mu.Lock()
	defer p.mu.Unlock()
	st.BootstrapQueries += p.queries
}

const mooncakeName = "mooncake (vllm)"

func newMooncakeProtocol(ctx context.Context, s *Server) (*mooncakeProtocol, error) {
	p := &mooncakeProtocol{s: s, transfers: newHandoffs("transfer_id", s.cfg.KVTTL), engines: make(map[string]map[string]mooncakeEngine)}
	if s.cfg.Role == RoleDecode {
		return p, nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /query", p.handleQuery)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	fallbackRoutes(mux, "/query", "/health")
	boot, err := s.listenSide(ctx, sideBootstrap, s.cfg.BootstrapAddr, mux)
	if err != nil {
		return nil, err
	}
	p.boot = boot
	return p, nil
}

// mooncakeParams are the kv_transfer_params members of the upstream vLLM
// Mooncake protocol.
type mooncakeParams struct {
	DoRemoteDecode      bool    `json:"do_remote_decode"`
	DoRemotePrefill     bool    `json:"do_remote_prefill"`
	TransferID          *string `json:"transfer_id"`
	RemoteBootstrapAddr *string `json:"remote_bootstrap_addr"`
	RemoteEngineID      *string `json:"remote_engine_id"`
}

func (p *mooncakeProtocol) classify(x *exchange) (mode, error) {
	if err := foreignFields(x.req, mooncakeName, "kv_transfer_params"); err != nil {
		return modePlain, err
	}
	if x.req.mode == modePlain {
		return modePlain, nil
	}
	var kv mooncakeParams
	if err := x.req.field("kv_transfer_params", &kv); err != nil {
		return modePlain, err
	}
	x.leg = kv
	switch {
	case x.req.mode == modePrefill && p.s.cfg.Role == RoleDecode:
		return modePlain, badRequest("engine is a KV consumer (role decode) and cannot serve a do_remote_decode prefill request")
	case x.req.mode == modeDecode && p.s.cfg.Role == RolePrefill:
		return modePlain, badRequest("engine is a KV producer (role prefill) and cannot serve a do_remote_prefill decode request")
	}
	return x.req.mode, nil
}

// checkTransferID checks that a leg's transfer_id is the one the protocol
// derives from its X-Request-Id.
func checkTransferID(kv mooncakeParams, requestID string) []string {
	if requestID == "" {
		return []string{"missing X-Request-Id header (prefill and decode must share one)"}
	}
	want := "xfer-" + requestID
	switch {
	case kv.TransferID == nil || *kv.TransferID == "":
		return []string{fmt.Sprintf("kv_transfer_params.transfer_id is missing (want %q)", want)}
	case *kv.TransferID != want:
		return []string{fmt.Sprintf("kv_transfer_params.transfer_id must be %q (\"xfer-\" + X-Request-Id), got %q", want, *kv.TransferID)}
	}
	return nil
}

func (p *mooncakeProtocol) prefill(x *exchange) {
	s := p.s
	x.rec.Kind = KindPrefill
	kv := x.leg.(mooncakeParams)
	problems := checkTransferID(kv, x.rec.RequestID)
	for name, isSet := range map[string]bool{
		"remote_bootstrap_addr": kv.RemoteBootstrapAddr != nil,
		"remote_engine_id":      kv.RemoteEngineID != nil,
	} {
		if isSet {
			problems = append(problems, "kv_transfer_params."+name+" must be absent on a prefill request")
		}
	}
	if len(problems) > 0 {
		slices.Sort(problems)
		s.reject(x, badRequest("invalid %s prefill request: %s", mooncakeName, strings.Join(problems, "; ")))
		return
	}
	if err := s.computePrompt(x.r.Context(), x.req); err != nil {
		s.abandon(x, err)
		return
	}
	// MooncakeConnector's request_finished sends the KV of a length-capped
	// request whatever its limit; the decode names the transfer itself, so
	// a streamed prefill hands off too.
	toks, finish := prefillOutput(x, false)
	if !s.awaitPrefillTokens(x, toks) {
		return
	}
	a := kvAnswer{Fingerprint: x.rec.Fingerprint, RequestID: x.rec.RequestID, Source: s.addr, Rank: x.rank}
	if err := p.transfers.put(s.rankedKey(*kv.TransferID, x.rank), a, time.Now()); err != nil {
		s.reject(x, err)
		return
	}
	s.answerVLLMPrefill(x, toks, finish, nil)
}

// mooncakeEngine is one data parallel rank in a bootstrap server's /query
// answer, which maps dp rank -> engine: {"0": {"engine_id": ..., "worker_addr":
// {tp rank: {pp rank: worker address}}}}.
type mooncakeEngine struct {
	EngineID   string                       `json:"engine_id"`
	WorkerAddr map[string]map[string]string `json:"worker_addr"`
}

// headerQueryingEngine marks the /query calls of simulated decode engines,
// so that BootstrapQueries counts the router's alone.
const headerQueryingEngine = "X-Pdx-Sim-Querying-Engine"

func (p *mooncakeProtocol) handleQuery(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if r.Header.Get(headerQueryingEngine) == "" {
		p.queries++
	} else {
		p.engineQueries++
	}
	p.mu.Unlock()
	// One engine per DP rank, each named as vLLM's DP engine cores name
	// themselves; the simulator's ranks share its one worker address.
	engines := map[string]mooncakeEngine{}
	for r := range p.s.dpSize() {
		engines[strconv.Itoa(r)] = mooncakeEngine{EngineID: p.s.engineID(r), WorkerAddr: map[string]map[string]string{"0": {"0": p.s.addr}}}
	}
	writeJSON(w, http.StatusOK, engines)
}

// transferRequest is the body of POST /sim/kv/transfer on a prefill
// engine's worker: the stand-in for the Mooncake transfer of one transfer id.
type transferRequest struct {
	TransferID string `json:"transfer_id"`
	EngineID   string `json:"engine_id"`
	WaitMS     int64  `json:"wait_ms"`
}

func (p *mooncakeProtocol) addRoutes(mux *http.ServeMux) []string {
	mux.HandleFunc("POST /sim/kv/transfer", p.handleTransfer)
	return []string{"/sim/kv/transfer"}
}

func (p *mooncakeProtocol) handleTransfer(w http.ResponseWriter, r *http.Request) {
	s := p.s
	sr := s.startSide(r, KindKVPull)
	var tr transferRequest
	if ae := sr.readSide(w, r, &tr); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	rank, ok := s.rankOfEngineID(tr.EngineID)
	if !ok {
		s.answerSide(w, r, sr, nil, badRequest("remote_engine_id mismatch: KV was requested from engine %q but this engine is %s",
			tr.EngineID, s.engineIDs()))
		return
	}
	if s.cfg.Role == RoleDecode {
		s.answerSide(w, r, sr, nil, badRequest("engine is a KV consumer (role decode) and holds no KV to transfer"))
		return
	}
	ctx, cancel := s.waitContext(r.Context())
	defer cancel()
	// Only the rank's engine has the transfer: asked of another, the
	// decode waits for KV that never comes there.
	a, err := p.transfers.take(ctx, s.rankedKey(tr.TransferID, rank), sr.rec.RequestID, sideWait(tr.WaitMS))
	sr.rec.Fingerprint = a.Fingerprint
	s.answerSide(w, r, sr, a, err)
}

func (p *mooncakeProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	kv := x.leg.(mooncakeParams)
	problems := checkTransferID(kv, x.rec.RequestID)
	var boot string
	switch {
	case kv.RemoteBootstrapAddr == nil || *kv.RemoteBootstrapAddr == "":
		problems = append(problems, "kv_transfer_params.remote_bootstrap_addr is missing")
	default:
		var err error
		if boot, err = bootstrapHostPort(*kv.RemoteBootstrapAddr); err != nil {
			problems = append(problems, err.Error())
		}
	}
	if kv.RemoteEngineID == nil || *kv.RemoteEngineID == "" {
		problems = append(problems, "kv_transfer_params.remote_engine_id is missing")
	}
	if len(problems) > 0 {
		s.reject(x, badRequest("invalid %s decode request: %s", mooncakeName, strings.Join(problems, "; ")))
		return
	}
	ctx, cancel := s.waitContext(x.r.Context())
	defer cancel()

	engines, err := p.query(ctx, boot)
	if err != nil {
		s.finishDecode(x, "transfer_id "+*kv.TransferID, kvAnswer{}, err)
		return
	}
	worker, ae := workerOf(engines, *kv.RemoteEngineID, boot)
	if ae != nil {
		s.reject(x, ae)
		return
	}

	wait := s.cfg.KVWaitTimeout
	ctx, cancelWait := context.WithTimeout(ctx, wait+sideGrace)
	defer cancelWait()
	var got kvAnswer
	what := "KV transfer of transfer_id " + *kv.TransferID + " from Mooncake worker " + worker
	// The scheduled decode holds its allocated blocks while it waits for
	// the remote KV (WAITING_FOR_REMOTE_KVS).
	release := s.holdSlot()
	err = s.sideCall(ctx, s.waitClient(), what, "http://"+worker+"/sim/kv/transfer", x.rec.RequestID,
		transferRequest{TransferID: *kv.TransferID, EngineID: *kv.RemoteEngineID, WaitMS: wait.Milliseconds()}, &got)
	release()
	x.rec.KVSourceRank = got.Rank
	s.finishDecode(x, "transfer_id "+*kv.TransferID, got, err)
}

// query asks the bootstrap server at boot (host:port) which engines it
// serves, once: like upstream's decode (_connect_to_prefiller_bootstrap,
// mooncake_connector.py), it keeps the answer for later requests.
func (p *mooncakeProtocol) query(ctx context.Context, boot string) (map[string]mooncakeEngine, error) {
	p.mu.Lock()
	engines, ok := p.engines[boot]
	p.mu.Unlock()
	if ok {
		return engines, nil
	}
	what := "querying the Mooncake bootstrap server at " + boot
	hreq, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+boot+"/query", nil)
	if err != nil {
		return nil, badRequest("%s failed: %v", what, err)
	}
	hreq.Header.Set(headerQueryingEngine, p.s.addr)
	if err := p.s.roundTrip(ctx, p.s.client, what, hreq, &engines); err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.engines[boot] = engines
	p.mu.Unlock()
	return engines, nil
}

// bootstrapHostPort checks remote_bootstrap_addr, "http://host:port" as
// upstream's proxy writes it (the decode appends "/query"), and returns
// host:port.
func bootstrapHostPort(addr string) (string, error) {
	hostPort, ok := strings.CutPrefix(addr, "http://")
	bad := fmt.Errorf("kv_transfer_params.remote_bootstrap_addr must be \"http://<host>:<port>\", got %q", addr)
	if !ok {
		return "", bad
	}
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil || host == "" {
		return "", bad
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", bad
	}
	return hostPort, nil
}

// workerOf finds the worker address of engineID (tp rank 0, pp rank 0) in a
// /query answer.
func workerOf(engines map[string]mooncakeEngine, engineID, boot string) (string, *apiError) {
	var ids []string
	for _, e := range engines {
		if e.EngineID == engineID {
			if addr := e.WorkerAddr["0"]["0"]; addr != "" {
				return addr, nil
			}
			return "", badRequest("the Mooncake bootstrap server at %s lists engine %q without a worker at tp rank 0, pp rank 0", boot, engineID)
		}
		ids = append(ids, e.EngineID)
	}
	slices.Sort(ids)
	return "", badRequest("remote_engine_id mismatch: the Mooncake bootstrap server at %s reports engine ids %q, the request names %q",
		boot, ids, engineID)
}
