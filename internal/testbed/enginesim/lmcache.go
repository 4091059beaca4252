package enginesim

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"
)

// lmcacheProtocol is Connector "http" (alias "lmcache"): the router calls
// the prefill and then the decode with the client's request, and the KV goes
// out of band through a shared store, like LMCache's. A prefill stores its
// KV under the prompt's fingerprint; a decode looks the prompt up and pulls
// it on a hit, or recomputes it on a miss, as LMCache does.
type lmcacheProtocol struct{ s *Server }

func (p *lmcacheProtocol) classify(x *exchange) (mode, error) {
	if err := foreignFields(x.req, ConnectorHTTP); err != nil {
		return modePlain, err
	}
	if p.s.cfg.Role == RolePrefill {
		return modePrefill, nil
	}
	// A decode or kv_both engine looks every prompt up in the store.
	return modeDecode, nil
}

func (p *lmcacheProtocol) prefill(x *exchange) {
	s := p.s
	x.rec.Kind = KindPrefill
	ctx := x.r.Context()
	if err := s.computePrompt(ctx, x.req); err != nil {
		s.abandon(x, err)
		return
	}
	entry := storeEntry{Engine: s.addr, RequestID: x.rec.RequestID}
	what := "storing KV in the KV store at " + s.cfg.StoreAddr
	u := storeURL(s.cfg.StoreAddr, x.rec.Fingerprint, "")
	var ok struct{}
	if err := s.sideCall(ctx, s.client, what, u, x.rec.RequestID, entry, &ok); err != nil {
		if ctx.Err() != nil {
			s.abandon(x, ctx.Err())
			return
		}
		// The prefill failed to make its KV available: the engine's fault,
		// not the request's.
		s.reject(x, &apiError{status: http.StatusBadGateway, msg: asAPIError(err).msg})
		return
	}
	// LMCache saves the KV as the prompt is computed, whatever the request
	// generates after it (or whether it streams).
	toks, finish := prefillOutput(x, false)
	if s.awaitPrefillTokens(x, toks) {
		s.answerVLLMPrefill(x, toks, finish, nil)
	}
}

func (p *lmcacheProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	ctx := x.r.Context()
	var got storeLookup
	what := "looking up KV in the KV store at " + s.cfg.StoreAddr
	err := s.sideCall(ctx, s.client, what, storeURL(s.cfg.StoreAddr, x.rec.Fingerprint, "/take"), x.rec.RequestID,
		storeTake{RequestID: x.rec.RequestID}, &got)
	switch {
	case ctx.Err() != nil:
		s.abandon(x, ctx.Err())
	case err == nil && !got.Hit:
		// A miss: LMCache recomputes the prompt.
		x.rec.KV = KVRecomputed
		x.w.Header().Set(HeaderKV, KVRecomputed)
		if err := s.computePrompt(ctx, x.req); err != nil {
			s.abandon(x, err)
			return
		}
		s.generate(x)
	case err != nil:
		s.reject(x, &apiError{status: http.StatusBadGateway, msg: asAPIError(err).msg})
	default:
		s.servePulled(x, got.Engine)
	}
}

func storeURL(addr, fingerprint, suffix string) string {
	return "http://" + addr + "/kv/" + url.PathEscape(fingerprint) + suffix
}

// storeEntry is what the store keeps per prefilled prompt.
type storeEntry struct {
	Engine    string `json:"engine"`     // HTTP address of the prefill engine
	RequestID string `json:"request_id"` // X-Request-Id of the prefill
}

type storeTake struct {
	RequestID string `json:"request_id"` // X-Request-Id of the decode
}

// storeLookup is the store's answer to a take: a hit with the entry, or a miss.
type storeLookup struct {
	Hit bool `json:"hit"`
	storeEntry
}

// Store is a shared KV store standing in for LMCache's remote backend: engines
// of Connector "http" put the KV of their prefills into it and take it out
// for their decodes. Its API is the simulator's own: PUT (or POST)
// /kv/{fingerprint} stores {"engine","request_id"}, POST
// /kv/{fingerprint}/take takes an entry out ({"hit":false} on a miss).
type Store struct {
	addr   string
	srv    *http.Server
	served chan struct{}
	ttl    time.Duration

	mu        sync.Mutex
	entries   map[string][]storedKV // by prompt fingerprint, oldest first
	stopWatch func() bool           // detaches Close from the Start context

	closeOnce sync.Once
	closeErr  error
}

type storedKV struct {
	storeEntry
	created time.Time
}

// StartStore runs a KV store on addr (e.g. "127.0.0.1:0") until Close is
// called or ctx is done.
func StartStore(ctx context.Context, addr string) (*Store, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("enginesim: store listen: %w", err)
	}
	host, port := advertised(ln)
	st := &Store{
		addr:    net.JoinHostPort(host, strconv.Itoa(port)),
		served:  make(chan struct{}),
		ttl:     defaultKVTTL,
		entries: make(map[string][]storedKV),
	}
	mux := http.NewServeMux()
	mux.HandleFunc("PUT /kv/{fingerprint}", st.handlePut)
	mux.HandleFunc("POST /kv/{fingerprint}", st.handlePut)
	mux.HandleFunc("POST /kv/{fingerprint}/take", st.handleTake)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, &apiError{status: http.StatusNotFound, msg: "no route for " + r.Method + " " + r.URL.Path})
	})
	st.srv = &http.Server{Handler: mux, ReadHeaderTimeout: headerTimeout}
	go func() {
		defer close(st.served)
		_ = st.srv.Serve(ln)
	}()
	stop := context.AfterFunc(ctx, func() { _ = st.Close() })
	st.mu.Lock()
	st.stopWatch = stop
	st.mu.Unlock()
	return st, nil
}

// Addr is the "host:port" the store is reachable on.
func (st *Store) Addr() string { return st.addr }

// Close stops the store; it is safe to call more than once.
func (st *Store) Close() error {
	st.closeOnce.Do(func() {
		st.mu.Lock()
		stop := st.stopWatch
		st.mu.Unlock()
		if stop != nil {
			stop()
		}
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		if err := st.srv.Shutdown(ctx); err != nil {
			st.closeErr = st.srv.Close()
		}
		<-st.served
	})
	return st.closeErr
}

func (st *Store) handlePut(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		writeError(w, badRequest("reading request: %v", err))
		return
	}
	var e storeEntry
	if err := decodeJSON(body, &e); err != nil || e.Engine == "" {
		writeError(w, badRequest("invalid store entry %s (want {\"engine\":...,\"request_id\":...})", bytes.TrimSpace(body)))
		return
	}
	fp, now := r.PathValue("fingerprint"), time.Now()
	st.mu.Lock()
	for k, list := range st.entries {
		kept := list[:0]
		for _, kv := range list {
			if now.Sub(kv.created) <= st.ttl {
				kept = append(kept, kv)
			}
		}
		if len(kept) == 0 {
			delete(st.entries, k)
		} else {
			st.entries[k] = kept
		}
	}
	st.entries[fp] = append(st.entries[fp], storedKV{storeEntry: e, created: now})
	st.mu.Unlock()
	writeJSON(w, http.StatusOK, struct{}{})
}

// handleTake hands out the KV of a prompt once: preferably the entry the
// decode's own request prefilled, else the oldest (the store is content
// addressed, like LMCache).
func (st *Store) handleTake(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r)
	if err != nil {
		writeError(w, badRequest("reading request: %v", err))
		return
	}
	var t storeTake
	if err := decodeJSON(body, &t); err != nil {
		writeError(w, badRequest("invalid take request: %v", err))
		return
	}
	fp, now := r.PathValue("fingerprint"), time.Now()
	st.mu.Lock()
	defer st.mu.Unlock()
	list := st.entries[fp]
	pick := -1
	for i, kv := range list {
		if now.Sub(kv.created) > st.ttl {
			continue
		}
		if kv.RequestID == t.RequestID && t.RequestID != "" {
			pick = i
			break
		}
		if pick < 0 {
			pick = i
		}
	}
	if pick < 0 {
		writeJSON(w, http.StatusOK, storeLookup{})
		return
	}
	e := list[pick].storeEntry
	list = append(list[:pick], list[pick+1:]...)
	if len(list) == 0 {
		delete(st.entries, fp)
	} else {
		st.entries[fp] = list
	}
	writeJSON(w, http.StatusOK, storeLookup{Hit: true, storeEntry: e})
}
