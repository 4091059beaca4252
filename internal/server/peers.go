package server

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"time"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/resolver"
)

// Replicas exchange their prefill leases (picker/peers.go) over their
// admin listeners: GET peersPath streams a replica's journal as JSON
// lines, first the leases in flight, then every start and end; each
// replica reads every peer's stream and counts what it says in its own
// Sets, until the stream ends, when it forgets that peer's leases and
// reads it again.

// peersPath is where a replica serves its journal.
const peersPath = "/peers/prefills"

// instanceHeader names the replica that answers, so that one listed among
// its own peers recognises itself.
const instanceHeader = "Pdx-Instance"

const (
	// peerBuffer is how many events a slow reader may fall behind before
	// it is dropped (it reads again, from a new snapshot).
	peerBuffer = 1 << 14
	// peerKeepAlive is how often a quiet stream says it is alive, and
	// peerSilence how long a reader waits before taking a silent peer
	// for gone.
	peerKeepAlive = 2 * time.Second
	peerSilence   = 3 * peerKeepAlive
	// peerRetry is the first wait before reading a peer again, doubled
	// up to peerRetryMax while it fails.
	peerRetry    = 100 * time.Millisecond
	peerRetryMax = 5 * time.Second
)

// peerLine is one line of the stream: a lease's start, its end (End), or
// nothing (keep-alive). AgeMicros is how long ago the lease started, as
// the serving replica's clock tells: clocks of two hosts need not agree.
// Blocks are the prompt's block hashes (picker.Blocks). An end the engine
// answered says what the serving replica learned from it
// (picker.PrefillAnswer): TookMicros from its pick to the answer, the
// queue it counted at the pick, the tokens the engine computed. A reader
// that does not know these fields ignores them, and one that does reads
// an end without them as unanswered.
type peerLine struct {
	Pool       string   `json:"pool,omitempty"`
	Endpoint   string   `json:"endpoint,omitempty"`
	ID         uint64   `json:"id,omitempty"`
	Tokens     int      `json:"tokens,omitempty"`
	AgeMicros  int64    `json:"age_us,omitempty"`
	Blocks     []uint64 `json:"blocks,omitempty"`
	End        bool     `json:"end,omitempty"`
	TookMicros int64    `json:"took_us,omitempty"`
	Ahead      int      `json:"ahead,omitempty"`
	Waiting    int      `json:"waiting,omitempty"`
	Computed   int      `json:"computed,omitempty"`
}

// newInstance is a replica's name for itself in instanceHeader.
func newInstance() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// servePeers serves the table's journal: 404 without peers configured.
func (s *Server) servePeers(w http.ResponseWriter, r *http.Request) {
	j := s.proc.Table().Journal()
	if j == nil {
		http.Error(w, "peers are off (config: peers)", http.StatusNotFound)
		return
	}
	w.Header().Set(instanceHeader, s.instance)
	w.Header().Set("Content-Type", "application/jsonl")
	snapshot, reader := j.Subscribe(peerBuffer)
	defer j.Unsubscribe(reader)
	bw := bufio.NewWriter(w)
	enc := json.NewEncoder(bw)
	rc := http.NewResponseController(w)
	now := time.Now()
	for _, e := range snapshot {
		writePeerLine(enc, e, now)
	}
	if err := flush(bw, rc); err != nil {
		return
	}
	alive := time.NewTicker(peerKeepAlive)
	defer alive.Stop()
	for {
		select {
		case e, ok := <-reader.Events():
			if !ok {
				if reader.Lost() {
					s.log.Warn("a peer fell behind this replica's prefills: its stream ends, to start again", slog.String("peer", r.RemoteAddr))
				}
				return
			}
			now := time.Now()
			writePeerLine(enc, e, now)
			// What else is there goes in the same write (this handler
			// is the reader's only receiver).
			for range len(reader.Events()) {
				writePeerLine(enc, <-reader.Events(), now)
			}
		case <-alive.C:
			_ = enc.Encode(peerLine{}) // {}
		case <-r.Context().Done():
			return
		case <-s.peersStop:
			return
		}
		if err := flush(bw, rc); err != nil {
			return
		}
	}
}

func flush(bw *bufio.Writer, rc *http.ResponseController) error {
	if err := bw.Flush(); err != nil {
		return err
	}
	return rc.Flush()
}

// writePeerLine writes e as a line; its age is as of now. A write error
// shows at the flush.
func writePeerLine(enc *json.Encoder, e picker.PrefillEvent, now time.Time) {
	l := peerLine{Pool: e.Pool, Endpoint: e.Endpoint, ID: e.ID, Tokens: e.Tokens, Blocks: e.Blocks, End: e.Ended}
	if !e.Ended {
		l.AgeMicros = max(now.Sub(e.Start).Microseconds(), 0)
	} else if a := e.Answer; a.Took > 0 {
		// At least a microsecond: a zero reads as unanswered.
		l.TookMicros = max(a.Took.Microseconds(), 1)
		l.Ahead, l.Waiting, l.Computed = a.Ahead, a.Waiting, a.Computed
	}
	_ = enc.Encode(l)
}

// followPeers reads every peer's journal until ctx ends: the addresses of
// cfg, host names resolved every refresh.
func (s *Server) followPeers(ctx context.Context, cfg *configv1.Peers, refresh time.Duration) {
	if cfg == nil || s.proc.Table().Journal() == nil {
		return
	}
	if refresh <= 0 {
		refresh = config.DefaultDNSRefreshRate // a config not through config.Parse
	}
	log := s.log.With(slog.String("component", "peers"))
	pf := &peerFollower{s: s, log: log, hc: &http.Client{Transport: &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 2 * time.Second}).DialContext,
		ResponseHeaderTimeout: 5 * time.Second,
	}}, lookup: resolver.LookupWith(nil), reading: map[string]context.CancelFunc{}, resolved: map[string][]string{}}
	s.peersDone = make(chan struct{})
	go func() {
		defer close(s.peersDone)
		defer pf.stopAll()
		tick := time.NewTicker(refresh)
		defer tick.Stop()
		for {
			pf.follow(ctx, pf.resolve(ctx, cfg.GetAddresses()))
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
		}
	}()
}

// resolve turns the configured addresses into host:port of IPs: a name
// stands for each of its addresses (IPv4 if it has any: resolver.Preferred),
// and one whose lookup fails for those it had last.
func (f *peerFollower) resolve(ctx context.Context, configured []string) []string {
	var out []string
	for _, a := range configured {
		addr, err := endpoint.ParseHostPort(a)
		if err != nil {
			continue // config validation refuses it
		}
		if !addr.IsName() {
			out = append(out, addr.String())
			continue
		}
		lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		ips, err := f.lookup(lctx, addr.Name)
		cancel()
		if err != nil {
			f.log.LogAttrs(ctx, slog.LevelDebug, "peer name lookup failed", slog.String("address", a), slog.String("error", err.Error()))
			if !errors.Is(err, resolver.ErrNotFound) {
				out = append(out, f.resolved[a]...)
				continue
			}
		}
		var found []string
		for _, ip := range resolver.Preferred(ips) {
			found = append(found, addr.At(ip))
		}
		f.resolved[a] = found
		out = append(out, found...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// peerFollower reads the peers' journals, one goroutine per address.
type peerFollower struct {
	s      *Server
	log    *slog.Logger
	hc     *http.Client
	lookup resolver.Lookup
	wg     sync.WaitGroup
	// reading cancels the reader of each address followed; resolved are
	// each configured name's addresses, as last found.
	reading  map[string]context.CancelFunc
	resolved map[string][]string
}

// follow starts reading the addresses not read yet and stops those no
// longer listed.
func (f *peerFollower) follow(ctx context.Context, addresses []string) {
	for a, stop := range f.reading {
		if !slices.Contains(addresses, a) {
			stop()
			delete(f.reading, a)
		}
	}
	for _, a := range addresses {
		if _, ok := f.reading[a]; ok {
			continue
		}
		rctx, cancel := context.WithCancel(ctx)
		f.reading[a] = cancel
		f.wg.Go(func() { f.read(rctx, a) })
	}
}

func (f *peerFollower) stopAll() {
	for _, stop := range f.reading {
		stop()
	}
	f.wg.Wait()
	f.hc.CloseIdleConnections()
}

// errSelf ends the reading of this replica's own address.
var errSelf = errors.New("the address is this replica's own")

// read reads the peer at address until ctx ends or it turns out to be
// this replica, starting again after a failure, each time from a new
// snapshot.
func (f *peerFollower) read(ctx context.Context, address string) {
	wait := peerRetry
	quiet := false // the failure is logged already
	for {
		started := time.Now()
		err := f.stream(ctx, address)
		f.forget(address)
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, errSelf):
			f.log.Debug("skipping this replica's own address among the peers", slog.String("peer", address))
			return
		}
		if time.Since(started) > peerRetryMax {
			wait, quiet = peerRetry, false // it had been reading
		}
		level := slog.LevelWarn
		if quiet {
			level = slog.LevelDebug
		}
		quiet = true
		f.log.LogAttrs(ctx, level, "not reading a peer's prefills: its prefills count as the engines' metrics show them, pdx keeps trying",
			slog.String("peer", address), slog.String("error", fmt.Sprint(err)), slog.Duration("retry_in", wait))
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, peerRetryMax)
	}
}

// stream reads one stream of the peer's journal into the table's Sets.
func (f *peerFollower) stream(ctx context.Context, address string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+address+peersPath, nil)
	if err != nil {
		return err
	}
	resp, err := f.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.Header.Get(instanceHeader) == f.s.instance {
		return errSelf
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", address, resp.Status)
	}
	f.log.Info("reading a peer's prefills", slog.String("peer", address))
	// A peer that goes silent (its host gone without a word) is gone.
	silence := time.AfterFunc(peerSilence, cancel)
	defer silence.Stop()
	// A line fits the scanner's 64 KB: a start with picker.MaxPeerBlocks
	// hashes of 20 digits is about 21 KB.
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		silence.Reset(peerSilence)
		var l peerLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return fmt.Errorf("%s: a line that is not JSON: %w", address, err)
		}
		f.apply(address, l)
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return errors.New("the stream ended")
}

// apply counts a line of peer in the current table's prefill Sets.
func (f *peerFollower) apply(peer string, l peerLine) {
	if l.Pool == "" {
		return // keep-alive
	}
	p, ok := f.s.proc.Table().Pool(l.Pool)
	if !ok || !p.Prefills {
		return
	}
	if l.End {
		p.Prefill.Set.PeerEnded(peer, l.Endpoint, l.ID, picker.PrefillAnswer{
			Took: time.Duration(l.TookMicros) * time.Microsecond, Ahead: l.Ahead, Waiting: l.Waiting, Computed: l.Computed})
		return
	}
	p.Prefill.Set.PeerStarted(peer, l.Endpoint, l.ID, l.Tokens, time.Duration(l.AgeMicros)*time.Microsecond, l.Blocks)
}

// forget stops counting peer's leases in every pool of the current table
// (a pool's Sets share their peers' leases with their predecessors').
func (f *peerFollower) forget(peer string) {
	for _, p := range f.s.proc.Table().Pools() {
		if p.Prefills {
			p.Prefill.Set.PeerGone(peer)
		}
	}
}
