package enginesim

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Values of Config.Connector.
const (
	ConnectorNIXL     = "nixl"
	ConnectorHTTP     = "http"
	ConnectorLMCache  = "lmcache" // alias of ConnectorHTTP
	ConnectorMooncake = "mooncake"
	ConnectorSGLang   = "sglang"
	ConnectorP2PNCCL  = "p2p-nccl"
	ConnectorTRTLLM   = "trtllm"
)

// Values of Config.MooncakeProtocol.
const (
	MooncakeNIXL = "nixl"
	MooncakeVLLM = "vllm"
)

// protocols are the connector protocols the simulator speaks, by
// Config.Connector: a protocol is its file and a line here.
var protocols = []struct {
	connector string
	start     func(context.Context, *Server) (protocol, error)
}{
	{ConnectorNIXL, startNIXL},
	{ConnectorHTTP, startLMCache},
	{ConnectorLMCache, startLMCache},
	{ConnectorMooncake, func(ctx context.Context, s *Server) (protocol, error) {
		if s.cfg.MooncakeProtocol == MooncakeVLLM {
			return newMooncakeProtocol(ctx, s)
		}
		return startNIXL(ctx, s)
	}},
	{ConnectorSGLang, func(ctx context.Context, s *Server) (protocol, error) { return newSGLangProtocol(ctx, s) }},
	{ConnectorP2PNCCL, func(ctx context.Context, s *Server) (protocol, error) { return newP2PProtocol(ctx, s) }},
	{ConnectorTRTLLM, func(_ context.Context, s *Server) (protocol, error) { return newTRTLLMProtocol(s), nil }},
}

func startNIXL(_ context.Context, s *Server) (protocol, error)    { return nixlProtocol{s: s}, nil }
func startLMCache(_ context.Context, s *Server) (protocol, error) { return &lmcacheProtocol{s: s}, nil }

// Connectors lists the values of Config.Connector the simulator speaks.
func Connectors() []string {
	names := make([]string, len(protocols))
	for i, p := range protocols {
		names[i] = p.connector
	}
	return names
}

// UsesStore reports whether engines of connector share a KV store
// (LMCache's), which StartStore runs and Config.StoreAddr names.
func UsesStore(connector string) bool {
	return connector == ConnectorHTTP || connector == ConnectorLMCache
}

// Names of side channel listeners.
const (
	sideBootstrap = "bootstrap"
	sideKV        = "kv"
)

// protocol is the KV connector protocol an engine speaks. The engine parses
// and validates the OpenAI request; the protocol decides which leg it is and
// serves it, answering and recording through the engine.
type protocol interface {
	// classify tells what a parsed request asks of this engine, or refuses
	// it. It may leave what it parsed in x.leg for the serve methods.
	classify(x *exchange) (mode, error)
	prefill(x *exchange)
	decode(x *exchange)
}

// newProtocol returns the protocol of s.cfg.Connector, with its listeners
// opened (but not yet served).
func newProtocol(ctx context.Context, s *Server) (protocol, error) {
	for _, p := range protocols {
		if p.connector == s.cfg.Connector {
			return p.start(ctx, s)
		}
	}
	return nixlProtocol{s: s}, nil
}

// nixlProtocol is vLLM's NixlConnector, which Mooncake's "nixl" flavour
// speaks too.
type nixlProtocol struct{ s *Server }

func (p nixlProtocol) classify(x *exchange) (mode, error) { return x.req.mode, nil }
func (p nixlProtocol) prefill(x *exchange)                { p.s.servePrefill(x) }
func (p nixlProtocol) decode(x *exchange)                 { p.s.serveDecode(x) }

// protocolFields are the request fields of all the KV connector protocols. A
// router strips the client's copies and writes only those of its connector,
// so an engine refuses those of another protocol: their presence means a
// client-sent field leaked through.
var protocolFields = []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disaggregated_params"}

// foreignFields refuses protocol fields that protocol name does not use.
func foreignFields(req *inferenceRequest, name string, own ...string) error {
	var found []string
	for _, f := range protocolFields {
		if req.has(f) && !slices.Contains(own, f) {
			found = append(found, f)
		}
	}
	if len(found) == 0 {
		return nil
	}
	verb := "are"
	if len(found) == 1 {
		verb = "is"
	}
	return badRequest("%s %s not part of the %s protocol (a router must strip client-sent protocol fields)",
		strings.Join(found, ", "), verb, name)
}

// kvAnswer is what a side channel says of the KV it handed over: whose
// prompt it holds, the request that prefilled it, and the HTTP address of the
// prefill engine that computed it.
type kvAnswer struct {
	Fingerprint string `json:"fingerprint"`
	RequestID   string `json:"request_id"`
	Source      string `json:"source"`
	Rank        int    `json:"dp_rank"` // the prefill's DP rank that held the KV
}

// handoff is KV a prefill left for a decode, under a protocol's key (a
// bootstrap room, a transfer id, ...).
type handoff struct {
	kvAnswer
	owner      string // the request id that holds the KV while it waits, where the engine tracks one (SGLang's rid)
	created    time.Time
	consumedBy string // X-Request-Id of the decode that took it, "" until then
}

// handoffs holds an engine's KV under one kind of key. A decode may wait for
// a key that a concurrent prefill has not registered yet.
type handoffs struct {
	what string // the key's name in messages, e.g. "bootstrap_room"
	ttl  time.Duration

	mu      sync.Mutex
	entries map[string]*handoff
	changed chan struct{} // closed and replaced whenever an entry is added
	waiters int           // takes waiting for a registration (for tests)
	freed   kvFreed
}

func newHandoffs(what string, ttl time.Duration) *handoffs {
	return &handoffs{what: what, ttl: ttl, entries: make(map[string]*handoff), changed: make(chan struct{})}
}

// expire drops the entry under key if its time is up, counting it as
// expired if nobody took it; it reports whether it did. h.mu is held.
func (h *handoffs) expire(key string, e *handoff, now time.Time) bool {
	if now.Sub(e.created) <= h.ttl {
		return false
	}
	if e.consumedBy == "" {
		h.freed.expired++
	}
	delete(h.entries, key)
	return true
}

// sweep drops expired entries. h.mu is held.
func (h *handoffs) sweep(now time.Time) {
	for k, e := range h.entries {
		h.expire(k, e, now)
	}
}

// put registers KV under key. A key in use (registered and not yet taken) is
// a conflict; a key whose KV was taken may be registered again, as upstream
// engines only need ids to be unique among requests in flight. Expired
// entries are swept here.
func (h *handoffs) put(key string, a kvAnswer, now time.Time) *apiError {
	return h.putOwned(key, "", a, now)
}

// putOwned is put for KV held on behalf of the request owner.
func (h *handoffs) putOwned(key, owner string, a kvAnswer, now time.Time) *apiError {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sweep(now)
	if e, ok := h.entries[key]; ok && e.consumedBy == "" {
		return &apiError{status: http.StatusConflict,
			msg: fmt.Sprintf("%s %s is already in use (prefilled for request %q and not yet taken)", h.what, key, e.RequestID)}
	}
	h.entries[key] = &handoff{kvAnswer: a, owner: owner, created: now}
	close(h.changed)
	h.changed = make(chan struct{})
	return nil
}

// owners lists the owners of the KV held (registered, not taken, not
// expired), by key.
func (h *handoffs) owners(now time.Time) map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sweep(now)
	out := make(map[string]string)
	for k, e := range h.entries {
		if e.consumedBy == "" && e.owner != "" {
			out[k] = e.owner
		}
	}
	return out
}

// drop frees held KV whose owner matches, before any decode took it; a
// decode waiting for its key goes on waiting (nothing will come). It
// returns the number freed.
func (h *handoffs) drop(match func(owner string) bool, now time.Time) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sweep(now)
	n := 0
	for k, e := range h.entries {
		if e.consumedBy == "" && e.owner != "" && match(e.owner) {
			delete(h.entries, k)
			n++
		}
	}
	h.freed.released += n
	return n
}

// stats is the number of entries held and how many were freed, and how.
func (h *handoffs) stats(now time.Time) (int, kvFreed) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.sweep(now)
	held := 0
	for _, e := range h.entries {
		if e.consumedBy == "" {
			held++
		}
	}
	return held, h.freed
}

// take hands out the KV under key once, waiting up to wait for a prefill to
// register it (again, if its last KV was taken). The error is ctx's, or an
// *apiError: 409 when the KV was already taken and none came since, 504 when
// nothing was registered in time (404 when wait is 0).
func (h *handoffs) take(ctx context.Context, key, consumer string, wait time.Duration) (kvAnswer, error) {
	return h.takeAny(ctx, []string{key}, consumer, wait)
}

// takeAny is take of the KV under the first of keys that has some (an
// SGLang decode that asks a DP prefill for a room on any of its ranks).
func (h *handoffs) takeAny(ctx context.Context, keys []string, consumer string, wait time.Duration) (kvAnswer, error) {
	key := strings.Join(keys, " or ")
	var timeout <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	for {
		a, takenBy, changed := h.tryTake(keys, consumer, time.Now())
		if changed == nil {
			return a, nil
		}
		err := h.await(ctx, changed, timeout)
		switch {
		case err == nil:
			continue
		case !errors.Is(err, errTimedOut):
			return kvAnswer{}, err
		case takenBy != "":
			return kvAnswer{}, &apiError{status: http.StatusConflict,
				msg: fmt.Sprintf("KV of %s %s was already taken by request %q (and no prefill registered it again)", h.what, key, takenBy)}
		case wait <= 0:
			return kvAnswer{}, &apiError{status: http.StatusNotFound,
				msg: fmt.Sprintf("no KV for %s %s (unknown or expired)", h.what, key)}
		}
		return kvAnswer{}, &apiError{status: http.StatusGatewayTimeout,
			msg: fmt.Sprintf("no prefill registered KV for %s %s within %v", h.what, key, wait)}
	}
}

var errTimedOut = errors.New("timed out")

// await waits for changed, counting itself as a waiter. Without a timeout it
// does not wait.
func (h *handoffs) await(ctx context.Context, changed <-chan struct{}, timeout <-chan time.Time) error {
	if timeout == nil {
		return errTimedOut
	}
	h.mu.Lock()
	h.waiters++
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.waiters--
		h.mu.Unlock()
	}()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timeout:
		return errTimedOut
	case <-changed:
		return nil
	}
}

// waiting is the number of takes waiting for a registration.
func (h *handoffs) waiting() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.waiters
}

// tryTake takes the KV under key if it is there and not taken; otherwise it
// returns who took the last KV under key, if anyone, and the channel that
// signals the next registration.
func (h *handoffs) tryTake(keys []string, consumer string, now time.Time) (kvAnswer, string, <-chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	takenBy := ""
	for _, key := range keys {
		e, ok := h.entries[key]
		if ok && h.expire(key, e, now) {
			ok = false
		}
		switch {
		case !ok:
			continue
		case e.consumedBy != "":
			takenBy = cmp.Or(takenBy, e.consumedBy)
			continue
		}
		e.consumedBy = orNoID(consumer)
		h.freed.pulled++
		return e.kvAnswer, "", nil
	}
	return kvAnswer{}, takenBy, h.changed
}

// maxSideWait caps the wait a side channel request may ask for.
const maxSideWait = 10 * time.Minute

// sideWait is the wait a side channel request asked for, in milliseconds.
func sideWait(ms int64) time.Duration {
	return min(time.Duration(max(ms, 0))*time.Millisecond, maxSideWait)
}

// waitContext is ctx, also cancelled when the engine starts closing, so that
// a wait for KV never holds Close.
func (s *Server) waitContext(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.waitsDone, cancel)
	return ctx, func() {
		stop()
		cancel()
	}
}

// waitClient is the client for side channel calls that wait for KV: the
// pull client without its overall timeout (the caller's context bounds it).
func (s *Server) waitClient() *http.Client {
	c := *s.client
	c.Timeout = 0
	return &c
}

// sideCall POSTs in as JSON to url, a peer's side channel, and decodes its
// answer into out. what describes the call in errors. An error is ctx's or an
// *apiError fit to return: the peer's 409, 503 and 504 are passed on, its
// other failures become 400 since they stem from the request's protocol
// fields.
func (s *Server) sideCall(ctx context.Context, client *http.Client, what, url, requestID string, in, out any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return badRequest("%s failed: %v", what, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	if requestID != "" {
		hreq.Header.Set(headerReqID, requestID)
		// Side calls are idempotent: resent, as a pull is (pullKV), when
		// a kept connection closed as they were sent.
		hreq.Header.Set("Idempotency-Key", requestID)
	}
	return s.roundTrip(ctx, client, what, hreq, out)
}

// roundTrip sends hreq and decodes a 200 answer into out (see sideCall).
func (s *Server) roundTrip(ctx context.Context, client *http.Client, what string, hreq *http.Request, out any) error {
	resp, err := client.Do(hreq)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return badRequest("%s failed: %v", what, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return badRequest("%s failed reading the answer: %v", what, err)
	}
	if resp.StatusCode != http.StatusOK {
		status := http.StatusBadRequest
		switch resp.StatusCode {
		case http.StatusConflict, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			status = resp.StatusCode
		}
		return &apiError{status: status, msg: fmt.Sprintf("%s failed with %d: %s", what, resp.StatusCode, errorMessage(data))}
	}
	if err := decodeJSON(data, out); err != nil {
		return badRequest("%s returned an invalid answer: %v", what, err)
	}
	return nil
}

// finishDecode ends a decode leg once its KV source has answered: it refuses
// the request if the KV could not be had or holds another prompt, and
// otherwise generates from the pulled KV. what names the KV in messages.
func (s *Server) finishDecode(x *exchange, what string, got kvAnswer, err error) {
	switch {
	case x.r.Context().Err() != nil:
		s.abandon(x, x.r.Context().Err())
		return
	case (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) && s.waitsDone.Err() != nil:
		s.reject(x, &apiError{status: http.StatusServiceUnavailable, msg: "engine is shutting down"})
		return
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		s.reject(x, &apiError{status: http.StatusGatewayTimeout, msg: "gave up waiting for the KV of " + what + ": " + err.Error()})
		return
	case err != nil:
		s.reject(x, err)
		return
	case got.Fingerprint != x.rec.Fingerprint:
		s.reject(x, badRequest("KV of %s holds a different prompt: prefilled prompt fingerprint %s (by %s), this request's prompt has %s",
			what, got.Fingerprint, got.Source, x.rec.Fingerprint))
		return
	}
	s.servePulled(x, got.Source)
}

// servePulled generates from KV pulled from src, the prefill's HTTP address.
func (s *Server) servePulled(x *exchange, src string) {
	if err := s.transferKV(x.workContext(), x.req); err != nil {
		s.interrupted(x, x.workContext(), nil)
		return
	}
	x.rec.KV, x.rec.KVSource = KVPulled, src
	x.w.Header().Set(HeaderKV, KVPulled)
	x.w.Header().Set(HeaderKVSource, src)
	s.generate(x)
}

// sideRecord starts the record of a side channel request served by s.
type sideRecord struct {
	seq uint64
	rec Record
}

func (s *Server) startSide(r *http.Request, kind string) *sideRecord {
	return &sideRecord{seq: s.arrive(), rec: Record{RequestID: r.Header.Get(headerReqID), Path: r.URL.Path, Kind: kind}}
}

// readSide reads and decodes a side channel request body into v.
func (sr *sideRecord) readSide(w http.ResponseWriter, r *http.Request, v any) *apiError {
	body, err := readBody(w, r)
	sr.rec.Body = recordBody(body)
	if err != nil {
		return badRequest("reading side channel request: %v", err)
	}
	if err := decodeJSON(body, v); err != nil {
		return badRequest("invalid side channel request: %v", err)
	}
	return nil
}

// answer records and sends the outcome of a side channel request: v on
// success, else err (ctx's when the caller went away or the engine closes).
func (s *Server) answerSide(w http.ResponseWriter, r *http.Request, sr *sideRecord, v any, err error) {
	if err != nil {
		if r.Context().Err() != nil {
			sr.rec.Status, sr.rec.Error = statusClientGone, "client went away: "+r.Context().Err().Error()
			s.commit(sr.seq, sr.rec)
			return
		}
		ae := asAPIError(err)
		if errors.Is(err, context.Canceled) {
			ae = &apiError{status: http.StatusServiceUnavailable, msg: "engine is shutting down"}
		}
		sr.rec.Status, sr.rec.Error = ae.status, ae.msg
		s.commit(sr.seq, sr.rec)
		writeError(w, ae)
		return
	}
	sr.rec.Status = http.StatusOK
	s.commit(sr.seq, sr.rec)
	writeJSON(w, http.StatusOK, v)
}
