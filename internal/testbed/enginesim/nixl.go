package enginesim

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// kvTransferParams is vLLM NixlConnector's kv_transfer_params object. Pointer
// and raw fields tell "absent or null" apart from a zero value, which the
// validation needs.
type kvTransferParams struct {
	DoRemoteDecode  bool            `json:"do_remote_decode"`
	DoRemotePrefill bool            `json:"do_remote_prefill"`
	RemoteEngineID  *string         `json:"remote_engine_id"`
	RemoteRequestID *string         `json:"remote_request_id"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	RemoteHost      *string         `json:"remote_host"`
	RemotePort      *int            `json:"remote_port"`
}

// issuedKVParams is what a prefill hands back for the decode engine: the
// members, in their order, of vLLM 0.32's answer (NixlConnectorScheduler
// .request_finished), as the real-engine tier saw them.
type issuedKVParams struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteBlockIDs  [][]int `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
	DCPSize         int     `json:"dcp_size"`
	PPSize          int     `json:"pp_size"`
	// RemoteNumTokens is the prompt's length in tokens.
	RemoteNumTokens int `json:"remote_num_tokens"`
	// RemoteBlocksExpiryTime is null on vLLM 0.32 (CPU buffers).
	RemoteBlocksExpiryTime *float64 `json:"remote_blocks_expiry_time"`
	TransferMode           string   `json:"transfer_mode"`
	// RemotePrefillCachedTokens: the prefill's prefix-cache hits on the
	// prompt; the simulator says 0 (it does not count them per request).
	RemotePrefillCachedTokens int `json:"remote_prefill_cached_tokens"`
}

// eosMarker in a prompt makes the prefill finish on EOS, in which case vLLM
// has nothing to transfer and returns null kv_transfer_params.
const eosMarker = "[sim:eos]"

// validatePrefill checks the hand-off fields of a NixlConnector prefill,
// listing every problem. vLLM checks neither: these are the engine
// detecting a wrong hand-off. The decode checks that it shares the
// prefill's X-Request-Id, so a prefill needs one; remote_* members come
// only from another hand-off's answer (vLLM's prefill ignores them,
// NixlConnectorScheduler.update_state_after_alloc). What a prefill
// generates (its limit, stream) is vLLM's business: see prefillOutput.
func validatePrefill(req *inferenceRequest, requestID string) error {
	var problems []string
	if requestID == "" {
		problems = append(problems, "missing X-Request-Id header (prefill and decode must share one)")
	}
	kv := req.kv
	for name, isSet := range map[string]bool{
		"remote_engine_id":  kv.RemoteEngineID != nil,
		"remote_request_id": kv.RemoteRequestID != nil,
		"remote_block_ids":  !isNull(kv.RemoteBlockIDs),
		"remote_host":       kv.RemoteHost != nil,
		"remote_port":       kv.RemotePort != nil,
	} {
		if isSet {
			problems = append(problems, "kv_transfer_params."+name+" must be null on a prefill request")
		}
	}
	if len(problems) == 0 {
		return nil
	}
	slices.Sort(problems) // map order must not make messages flaky
	return badRequest("invalid prefill request: %s", strings.Join(problems, "; "))
}

// pullSource checks a decode request's kv_transfer_params and returns the
// host:port to pull from.
func pullSource(kv kvTransferParams) (string, error) {
	var missing []string
	if kv.RemoteEngineID == nil || *kv.RemoteEngineID == "" {
		missing = append(missing, "remote_engine_id")
	}
	if kv.RemoteRequestID == nil || *kv.RemoteRequestID == "" {
		missing = append(missing, "remote_request_id")
	}
	if isNull(kv.RemoteBlockIDs) {
		missing = append(missing, "remote_block_ids")
	}
	if kv.RemoteHost == nil || *kv.RemoteHost == "" {
		missing = append(missing, "remote_host")
	}
	if kv.RemotePort == nil {
		missing = append(missing, "remote_port")
	}
	if len(missing) > 0 {
		return "", badRequest("kv_transfer_params with do_remote_prefill=true is missing %s", strings.Join(missing, ", "))
	}
	if p := *kv.RemotePort; p < 1 || p > 65535 {
		return "", badRequest("kv_transfer_params.remote_port %d is not a valid port", p)
	}
	return net.JoinHostPort(*kv.RemoteHost, strconv.Itoa(*kv.RemotePort)), nil
}

// pullRequest is the body of POST /sim/kv/pull, the stand-in for NIXL's
// handshake and read: the decode names the blocks it was told about and the
// request it is serving.
type pullRequest struct {
	RemoteEngineID  string          `json:"remote_engine_id"`
	RemoteRequestID string          `json:"remote_request_id"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	RequestID       string          `json:"request_id"`
}

// pullResponse is what the pulled blocks "contain": whose prompt they hold.
type pullResponse struct {
	Fingerprint string `json:"fingerprint"`
	RequestID   string `json:"request_id"`
	Rank        int    `json:"dp_rank"` // the prefill's DP rank that held the blocks
}

// pullKV fetches KV from the prefill engine at src. An error is either the
// request context's (the client went away) or an *apiError fit to return.
func (s *Server) pullKV(ctx context.Context, src string, kv kvTransferParams, requestID string) (pullResponse, error) {
	body, err := json.Marshal(pullRequest{
		RemoteEngineID:  *kv.RemoteEngineID,
		RemoteRequestID: *kv.RemoteRequestID,
		RemoteBlockIDs:  kv.RemoteBlockIDs,
		RequestID:       requestID,
	})
	if err != nil {
		return pullResponse{}, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+src+"/sim/kv/pull", bytes.NewReader(body))
	if err != nil {
		return pullResponse{}, badRequest("KV pull from %s failed: %v", src, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set(headerReqID, requestID)
	// A NIXL read is idempotent and no HTTP request: with the key,
	// net/http resends a pull whose kept connection the prefill's keep-alive
	// closed as it was sent (on two loaded cores the pool's own 4 s does
	// not always win that race), instead of failing the decode.
	hreq.Header.Set("Idempotency-Key", requestID)
	resp, err := s.client.Do(hreq)
	if err != nil {
		if ctx.Err() != nil {
			return pullResponse{}, ctx.Err()
		}
		return pullResponse{}, badRequest("KV pull from %s failed: %v", src, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		if ctx.Err() != nil {
			return pullResponse{}, ctx.Err()
		}
		return pullResponse{}, badRequest("KV pull from %s failed reading the answer: %v", src, err)
	}
	if resp.StatusCode != http.StatusOK {
		return pullResponse{}, badRequest("KV pull from %s failed with %d: %s", src, resp.StatusCode, errorMessage(data))
	}
	var pr pullResponse
	if err := json.Unmarshal(data, &pr); err != nil {
		return pullResponse{}, badRequest("KV pull from %s returned an invalid answer: %v", src, err)
	}
	return pr, nil
}

// handlePull serves the prefill side of a KV pull.
func (s *Server) handlePull(w http.ResponseWriter, r *http.Request) {
	seq := s.arrive()
	rec := Record{RequestID: r.Header.Get(headerReqID), Path: r.URL.Path, Kind: KindKVPull}
	resp, ae := s.servePull(w, r, &rec)
	if ae != nil {
		rec.Status, rec.Error = ae.status, ae.msg
		s.commit(seq, rec)
		writeError(w, ae)
		return
	}
	rec.Status = http.StatusOK
	s.commit(seq, rec)
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) servePull(w http.ResponseWriter, r *http.Request, rec *Record) (pullResponse, *apiError) {
	body, err := readBody(w, r)
	rec.Body = s.recordBody(body)
	if err != nil {
		return pullResponse{}, badRequest("reading KV pull request: %v", err)
	}
	var pr pullRequest
	if err := decodeJSON(body, &pr); err != nil {
		return pullResponse{}, badRequest("invalid KV pull request: %v", err)
	}
	rank, ok := s.rankOfEngineID(pr.RemoteEngineID)
	if !ok {
		return pullResponse{}, badRequest("remote_engine_id mismatch: KV was requested from engine %q but this engine is %s",
			pr.RemoteEngineID, s.engineIDs())
	}
	entry, ae := s.kv.take(pr, rank, time.Now())
	rec.Fingerprint = entry.fingerprint
	if ae != nil {
		return pullResponse{}, ae
	}
	return pullResponse{Fingerprint: entry.fingerprint, RequestID: entry.requestID, Rank: entry.rank}, nil
}

// releaseRequest is the body of POST /sim/kv/release, the stand-in for the
// NIXL notification "<remote_request_id>:<tp_size>" that a decode sends
// without reading a block, to make the prefill free the KV.
type releaseRequest struct {
	RemoteEngineID  string `json:"remote_engine_id"`
	RemoteRequestID string `json:"remote_request_id"`
	RequestID       string `json:"request_id"` // X-Request-Id of the aborted decode
}

// handleRelease serves the prefill side of a release notification.
func (s *Server) handleRelease(w http.ResponseWriter, r *http.Request) {
	sr := s.startSide(r, KindKVRelease)
	var rr releaseRequest
	if ae := sr.readSide(w, r, &rr); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	if _, ok := s.rankOfEngineID(rr.RemoteEngineID); !ok {
		s.answerSide(w, r, sr, nil, badRequest("remote_engine_id mismatch: a KV release was sent for engine %q but this engine is %s",
			rr.RemoteEngineID, s.engineIDs()))
		return
	}
	e, ae := s.kv.release(rr.RemoteRequestID, rr.RequestID, time.Now())
	sr.rec.Fingerprint = e.fingerprint
	if ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	s.answerSide(w, r, sr, struct{}{}, nil)
}

// kvEntry is the KV a prefill left behind for a decode to pull.
type kvEntry struct {
	fingerprint string // of the prompt whose KV the blocks hold
	requestID   string // X-Request-Id of the prefill
	rank        int    // the DP rank whose blocks hold it
	blockIDs    [][]int
	created     time.Time
	consumedBy  string // X-Request-Id of the decode that pulled it, "" until then
	releasedBy  string // X-Request-Id of the decode whose abort notification freed it
}

// held reports whether the blocks are still pinned for a decode.
func (e *kvEntry) held() bool { return e.consumedBy == "" && e.releasedBy == "" }

const (
	blockSize       = 16 // vLLM's default tokens per KV block
	maxBlocksIssued = 64 // the simulator needs block ids, not a real block table
)

// kvStore holds the prefilled KV of one engine, keyed by remote_request_id.
// Like vLLM's NixlConnector on the prefill side, it pins an entry's blocks
// until a decode reads them, a decode's notification frees them, or
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT (the ttl) passes.
type kvStore struct {
	ttl time.Duration

	mu        sync.Mutex
	nextBlock int
	entries   map[string]*kvEntry
	freed     kvFreed
}

// kvFreed counts how held KV was freed.
type kvFreed struct {
	pulled, released, expired int
}

func (f kvFreed) add(o kvFreed) kvFreed {
	return kvFreed{pulled: f.pulled + o.pulled, released: f.released + o.released, expired: f.expired + o.expired}
}

func newKVStore(ttl time.Duration) *kvStore {
	return &kvStore{ttl: ttl, nextBlock: 1, entries: make(map[string]*kvEntry)}
}

// expire drops the entry under id if its time is up, counting it as
// expired if it was still held; it reports whether it did. k.mu is held.
func (k *kvStore) expire(id string, e *kvEntry, now time.Time) bool {
	if now.Sub(e.created) <= k.ttl {
		return false
	}
	if e.held() {
		k.freed.expired++
	}
	delete(k.entries, id)
	return true
}

// sweep drops expired entries. k.mu is held.
func (k *kvStore) sweep(now time.Time) {
	for id, e := range k.entries {
		k.expire(id, e, now)
	}
}

// allocate remembers the KV of a finished prefill and returns its
// remote_request_id and block ids. Expired entries are swept here, which
// bounds the store without a background goroutine.
func (k *kvStore) allocate(fingerprint, requestID string, rank, tokens int, now time.Time) (string, [][]int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.sweep(now)
	n := min(tokens/blockSize+1, maxBlocksIssued)
	blocks := make([]int, n)
	for i := range blocks {
		blocks[i] = k.nextBlock
		k.nextBlock++
	}
	id := randomHex(16)
	ids := [][]int{blocks}
	k.entries[id] = &kvEntry{fingerprint: fingerprint, requestID: requestID, rank: rank, blockIDs: ids, created: now}
	return id, ids
}

// lookup finds the live entry under id. k.mu is held.
func (k *kvStore) lookup(id string, now time.Time) (*kvEntry, *apiError) {
	e, ok := k.entries[id]
	if ok && k.expire(id, e, now) {
		ok = false
	}
	if !ok {
		return nil, &apiError{status: http.StatusNotFound,
			msg: fmt.Sprintf("no KV for remote_request_id %q (unknown or expired)", id)}
	}
	return e, nil
}

// gone explains why a known entry can no longer be had, or is nil while it
// is held. k.mu is held.
func gone(id string, e *kvEntry) *apiError {
	switch {
	case e.consumedBy != "":
		return &apiError{status: http.StatusConflict,
			msg: fmt.Sprintf("KV of remote_request_id %q was already pulled by request %q", id, e.consumedBy)}
	case e.releasedBy != "":
		return &apiError{status: http.StatusConflict,
			msg: fmt.Sprintf("KV of remote_request_id %q was released: the decode of request %q was aborted before it pulled and notified this engine", id, e.releasedBy)}
	}
	return nil
}

// take hands out the KV named by a pull, once. Freed entries stay until
// they expire so that a second pull is told why it fails (409, not 404).
// The blocks are those of one DP rank, whose engine the pull must name
// (rank): another rank's NIXL agent has no such request.
func (k *kvStore) take(pr pullRequest, rank int, now time.Time) (kvEntry, *apiError) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e, ae := k.lookup(pr.RemoteRequestID, now)
	if ae != nil {
		return kvEntry{}, ae
	}
	if e.rank != rank {
		return *e, &apiError{status: http.StatusNotFound,
			msg: fmt.Sprintf("no KV for remote_request_id %q on engine %q: it is held by DP rank %d", pr.RemoteRequestID, pr.RemoteEngineID, e.rank)}
	}
	var blocks [][]int
	if err := json.Unmarshal(pr.RemoteBlockIDs, &blocks); err != nil || !slices.EqualFunc(blocks, e.blockIDs, slices.Equal) {
		return *e, &apiError{status: http.StatusBadRequest,
			msg: fmt.Sprintf("remote_block_ids mismatch for remote_request_id %q: issued %s, got %s",
				pr.RemoteRequestID, mustJSON(e.blockIDs), bytes.TrimSpace(pr.RemoteBlockIDs))}
	}
	if ae := gone(pr.RemoteRequestID, e); ae != nil {
		return *e, ae
	}
	e.consumedBy = orNoID(pr.RequestID)
	k.freed.pulled++
	return *e, nil
}

// release frees the KV of a decode that was aborted before it pulled, as
// NIXL's notification "<remote_request_id>:<tp_size>" without a read does.
func (k *kvStore) release(id, by string, now time.Time) (kvEntry, *apiError) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e, ae := k.lookup(id, now)
	if ae != nil {
		return kvEntry{}, ae
	}
	if ae := gone(id, e); ae != nil {
		return *e, ae
	}
	e.releasedBy = orNoID(by)
	k.freed.released++
	return *e, nil
}

// stats is the number of entries held and how many were freed, and how.
func (k *kvStore) stats(now time.Time) (int, kvFreed) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.sweep(now)
	held := 0
	for _, e := range k.entries {
		if e.held() {
			held++
		}
	}
	return held, k.freed
}

// orNoID names a request without an X-Request-Id in messages.
func orNoID(id string) string {
	if id == "" {
		return "(no request id)"
	}
	return id
}

// headerTimeout bounds how long the simulator's servers wait for a request's
// headers once a connection is open. The server starts that clock when it
// accepts, so a peer whose goroutines a loaded machine starved for the
// bound before it wrote the request got the connection closed unanswered
// (a KV pull failed with a bare EOF under -race in CI at 10 s). Peers here
// are loopback processes, not slow clients to shed: the bound matches the
// pull client's.
const headerTimeout = 60 * time.Second

// newPullClient is the default KV pull client. It only dials loopback
// addresses: remote_host comes from the request, and a test fixture must not
// be talked into sending traffic anywhere else.
func newPullClient() *http.Client {
	// Under a thousand concurrent hand-offs a loaded machine drops SYNs, and
	// the kernel's retry comes after a second or three: the dial timeout
	// leaves room for it, as an engine's own retries would.
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: loopbackOnly}
	return &http.Client{
		// A NIXL transfer has no short bound in vLLM (the prefill frees
		// unpulled blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s); at
		// 2,048 clients on two cores a pull's answer took over 10 s, and
		// the decode's refusal then was the simulator's, not vLLM's.
		Timeout: 60 * time.Second,
		Transport: &http.Transport{
			Proxy:               nil, // pulls are engine-to-engine, never via a proxy
			DialContext:         dialer.DialContext,
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 1024,
			// Below the engines' keep-alive (Config.KeepAlive's default),
			// so the pool drops an idle connection before the prefill
			// closes it; pullKV's Idempotency-Key covers the race left.
			IdleConnTimeout: defaultKeepAlive - time.Second,
		},
	}
}

// loopbackOnly refuses to connect a socket to a non-loopback address; it runs
// after name resolution and before any packet is sent.
func loopbackOnly(_, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return err
	}
	if !ip.IsLoopback() {
		return fmt.Errorf("refusing to pull KV from non-loopback address %s", address)
	}
	return nil
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		return []byte(err.Error())
	}
	return b
}
