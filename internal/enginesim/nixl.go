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

// issuedKVParams is what a prefill hands back for the decode engine.
type issuedKVParams struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteBlockIDs  [][]int `json:"remote_block_ids"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
}

// eosMarker in a prompt makes the prefill finish on EOS, in which case vLLM
// has nothing to transfer and returns null kv_transfer_params.
const eosMarker = "[sim:eos]"

// validatePrefill checks that a request is a faithful derivation of a client
// request into a NixlConnector prefill. It lists every problem, since each
// one points at a bug in the router's derivation.
func validatePrefill(req *inferenceRequest, requestID string) error {
	var problems []string
	if requestID == "" {
		problems = append(problems, "missing X-Request-Id header (prefill and decode must share one)")
	}
	problems = append(problems, prefillEditProblems(req, false)...)
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
	if pr.RemoteEngineID != s.cfg.EngineID {
		return pullResponse{}, badRequest("remote_engine_id mismatch: KV was requested from engine %q but this engine is %q",
			pr.RemoteEngineID, s.cfg.EngineID)
	}
	entry, ae := s.kv.take(pr, time.Now())
	rec.Fingerprint = entry.fingerprint
	if ae != nil {
		return pullResponse{}, ae
	}
	return pullResponse{Fingerprint: entry.fingerprint, RequestID: entry.requestID}, nil
}

// kvEntry is the KV a prefill left behind for a decode to pull.
type kvEntry struct {
	fingerprint string // of the prompt whose KV the blocks hold
	requestID   string // X-Request-Id of the prefill
	blockIDs    [][]int
	created     time.Time
	consumedBy  string // X-Request-Id of the decode that pulled it, "" until then
}

const (
	blockSize       = 16 // vLLM's default tokens per KV block
	maxBlocksIssued = 64 // the simulator needs block ids, not a real block table
)

// kvStore holds the prefilled KV of one engine, keyed by remote_request_id.
type kvStore struct {
	ttl time.Duration

	mu        sync.Mutex
	nextBlock int
	entries   map[string]*kvEntry
}

func newKVStore(ttl time.Duration) *kvStore {
	return &kvStore{ttl: ttl, nextBlock: 1, entries: make(map[string]*kvEntry)}
}

// allocate remembers the KV of a finished prefill and returns its
// remote_request_id and block ids. Expired entries are swept here, which
// bounds the store without a background goroutine.
func (k *kvStore) allocate(fingerprint, requestID string, tokens int, now time.Time) (string, [][]int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for id, e := range k.entries {
		if now.Sub(e.created) > k.ttl {
			delete(k.entries, id)
		}
	}
	n := min(tokens/blockSize+1, maxBlocksIssued)
	blocks := make([]int, n)
	for i := range blocks {
		blocks[i] = k.nextBlock
		k.nextBlock++
	}
	id := randomHex(16)
	ids := [][]int{blocks}
	k.entries[id] = &kvEntry{fingerprint: fingerprint, requestID: requestID, blockIDs: ids, created: now}
	return id, ids
}

// take hands out the KV named by a pull, once. Consumed entries stay until
// they expire so that a second pull is told why it fails (409, not 404).
func (k *kvStore) take(pr pullRequest, now time.Time) (kvEntry, *apiError) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e, ok := k.entries[pr.RemoteRequestID]
	if ok && now.Sub(e.created) > k.ttl {
		delete(k.entries, pr.RemoteRequestID)
		ok = false
	}
	if !ok {
		return kvEntry{}, &apiError{status: http.StatusNotFound,
			msg: fmt.Sprintf("no KV for remote_request_id %q (unknown or expired)", pr.RemoteRequestID)}
	}
	var blocks [][]int
	if err := json.Unmarshal(pr.RemoteBlockIDs, &blocks); err != nil || !slices.EqualFunc(blocks, e.blockIDs, slices.Equal) {
		return *e, &apiError{status: http.StatusBadRequest,
			msg: fmt.Sprintf("remote_block_ids mismatch for remote_request_id %q: issued %s, got %s",
				pr.RemoteRequestID, mustJSON(e.blockIDs), bytes.TrimSpace(pr.RemoteBlockIDs))}
	}
	if e.consumedBy != "" {
		return *e, &apiError{status: http.StatusConflict,
			msg: fmt.Sprintf("KV of remote_request_id %q was already pulled by request %q", pr.RemoteRequestID, e.consumedBy)}
	}
	e.consumedBy = pr.RequestID
	if e.consumedBy == "" {
		e.consumedBy = "(no request id)"
	}
	return *e, nil
}

// newPullClient is the default KV pull client. It only dials loopback
// addresses: remote_host comes from the request, and a test fixture must not
// be talked into sending traffic anywhere else.
func newPullClient() *http.Client {
	// Under a thousand concurrent hand-offs a loaded machine drops SYNs, and
	// the kernel's retry comes after a second or three: the dial timeout
	// leaves room for it, as an engine's own retries would.
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second, Control: loopbackOnly}
	return &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{
			Proxy:               nil, // pulls are engine-to-engine, never via a proxy
			DialContext:         dialer.DialContext,
			MaxIdleConns:        4096,
			MaxIdleConnsPerHost: 1024,
			IdleConnTimeout:     30 * time.Second,
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
