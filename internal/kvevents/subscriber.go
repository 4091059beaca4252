package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"math"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/go-zeromq/zmq4"
)

// The reasons a Subscriber gives Sink.Reset.
const (
	// ReasonGap: batches were missed and replay could not bring them back
	// (no replay endpoint, no answer, or no longer buffered).
	ReasonGap = "gap"
	// ReasonRestart: the sequence went back, so the publisher restarted.
	ReasonRestart = "restart"
	// ReasonReconnect: batches were missed across a dropped connection to
	// a publisher pdx dials (on the Bind socket, whose connections zmq4
	// does not tell apart, such a gap is a ReasonGap). A publisher that
	// restarted and has sent a few batches since looks the same, and its
	// replay buffer would answer with the new batches, so replay is not
	// asked.
	ReasonReconnect = "reconnect"
	// ReasonOverflow: the Sink fell behind and batches were dropped.
	ReasonOverflow = "overflow"
	// ReasonDecode: a batch could not be decoded.
	ReasonDecode = "decode"
	// ReasonRemoved: the engine left SetEngines, or its settings changed.
	ReasonRemoved = "removed"
)

// Engine is an engine whose events a Subscriber reads.
type Engine struct {
	// Addr names the engine to the Sink: its pdx endpoint, "host:port".
	// In bind mode it is also what a topic's <id> is matched against.
	Addr string
	// Endpoint, when set, is the PUB socket of DP rank 0 that the
	// Subscriber dials, "tcp://host:port"; rank r publishes on port+r
	// (vLLM's ZmqEventPublisher.offset_endpoint_port). Empty: the engine
	// dials the Subscriber's Bind socket.
	Endpoint string
	// Replay, when set, is rank 0's replay socket (vLLM's
	// replay_endpoint, a ROUTER it binds), rank r's on port+r.
	Replay string
	// DPSize is the engine's data-parallel size, its publishers; 0 means 1.
	DPSize int
}

// maxDPSize bounds Engine.DPSize, and so the publishers of one engine.
const maxDPSize = 1024

func (e Engine) ranks() int { return max(e.DPSize, 1) }

// normalized checks e and writes its endpoints with their scheme.
func (e Engine) normalized() (Engine, error) {
	if _, _, err := net.SplitHostPort(e.Addr); err != nil {
		return e, fmt.Errorf("kvevents: engine %q: not host:port: %w", e.Addr, err)
	}
	if e.DPSize < 0 || e.DPSize > maxDPSize {
		return e, fmt.Errorf("kvevents: engine %s: DPSize %d out of [0, %d]", e.Addr, e.DPSize, maxDPSize)
	}
	for _, ep := range []*string{&e.Endpoint, &e.Replay} {
		if *ep == "" {
			continue
		}
		if !strings.Contains(*ep, "://") {
			*ep = "tcp://" + *ep
		}
		_, port, err := splitEndpoint(*ep)
		if err != nil {
			return e, fmt.Errorf("kvevents: engine %s: %w", e.Addr, err)
		}
		if port+e.ranks()-1 > math.MaxUint16 {
			return e, fmt.Errorf("kvevents: engine %s: %s has no port for each of %d ranks", e.Addr, *ep, e.ranks())
		}
	}
	return e, nil
}

// splitEndpoint is a tcp://host:port endpoint's parts.
func splitEndpoint(ep string) (host string, port int, err error) {
	addr, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", 0, fmt.Errorf("endpoint %q: only tcp:// is supported (ranks are port offsets)", ep)
	}
	host, p, err := net.SplitHostPort(addr)
	if err == nil {
		port, err = strconv.Atoi(p)
	}
	if err != nil || port <= 0 || port > math.MaxUint16 {
		return "", 0, fmt.Errorf("endpoint %q: not tcp://host:port", ep)
	}
	return host, port, nil
}

// rankEndpoint is ep with its port offset by rank, as vLLM offsets each DP
// rank's publisher.
func rankEndpoint(ep string, rank int) string {
	host, port, _ := splitEndpoint(ep) // checked by normalized
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port+rank))
}

// Options configure a Subscriber.
type Options struct {
	// Sink (required) takes the batches and resets.
	Sink Sink
	// CatchUp begins each subscription with what the engine's replay
	// socket holds (catch-ups): the blocks it stored before this
	// subscriber came, which no later event names again.
	CatchUp bool
	// Topic is the subscription: a prefix of the topics read, "" for
	// all. llm-d subscribes to "kv@".
	Topic string
	// Bind, when set, is an endpoint the Subscriber listens on for
	// engines that dial it (vLLM with an endpoint without a wildcard),
	// e.g. "tcp://0.0.0.0:5557", or "tcp://127.0.0.1:0" for a free port
	// (see Addr). Their topics name them, llm-d style: kv@<id>@<model>,
	// <id> being an Engine's Addr, or its host when one engine alone has
	// that host. zmq4 allocates a frame's declared length before reading
	// it, so bind where only engines can connect.
	Bind string
	// Queue bounds the batches waiting for one engine's Sink calls.
	// Default 1024; when it is full, batches are dropped and the Sink
	// reset (ReasonOverflow) rather than the socket left unread.
	Queue int
	// ReplayTimeout bounds a replay. Default 2s.
	ReplayTimeout time.Duration
	// Retry is the wait between dials of a publisher not listening yet,
	// or gone. Default 200ms.
	Retry time.Duration
	// Log receives state changes (a publisher restarted, malformed input
	// starting or stopping, an unknown topic the first time), not every
	// batch. Default slog.Default().
	Log *slog.Logger
}

const (
	defaultQueue         = 1024
	defaultReplayTimeout = 2 * time.Second
	defaultRetry         = 200 * time.Millisecond
	dialTimeout          = 5 * time.Second
	// maxQueuedBytes bounds the payloads waiting for one engine's Sink.
	maxQueuedBytes = 64 << 20
	// maxReplay bounds the batches asked of a replay socket: vLLM's
	// buffer_steps default keeps 10,000.
	maxReplay = 10_000
	// maxLoggedTopics bounds the unknown topics remembered for logging
	// each once.
	maxLoggedTopics = 256
)

// Stats are a Subscriber's counts since Start.
type Stats struct {
	Batches uint64 // batches applied, replayed ones included
	Events  uint64 // events applied
	// UnknownEvents are events of types this package does not know,
	// skipped.
	UnknownEvents uint64
	DecodeErrors  uint64 // payloads that are not a batch (each a Reset)
	// Malformed are messages that are not [topic, 8-byte sequence,
	// payload], dropped.
	Malformed uint64
	// UnknownTopics are bind-mode messages whose topic names no engine.
	UnknownTopics  uint64
	Gaps           uint64 // sequence gaps
	Replays        uint64 // gaps filled by replay
	CatchUps       uint64 // subscriptions that began with what the publisher held before
	ReplayFailures uint64
	Restarts       uint64 // sequences that went back
	Overflows      uint64 // times a queue filled up (each a Reset)
	Dropped        uint64 // batches dropped on overflows
	Resets         uint64 // Sink.Reset calls
}

type counters struct {
	batches, events, unknownEvents, decodeErrors, malformed, unknownTopics atomic.Uint64
	gaps, replays, replayFailures, restarts, overflows, dropped, resets    atomic.Uint64
	catchUps                                                               atomic.Uint64
}

// Subscriber keeps the subscriptions to engines' KV events: a SUB socket
// per publisher it dials (each DP rank of each Engine with an Endpoint)
// and one it binds for engines that dial it (Options.Bind), and per
// engine a goroutine that tracks each rank's sequence and calls the Sink.
type Subscriber struct {
	opts   Options
	log    *slog.Logger
	zlog   *log.Logger // zmq4's, at debug level
	topic  []byte
	ctx    context.Context
	cancel context.CancelFunc
	bound  string        // the Bind socket's endpoint
	served chan struct{} // closed when the Bind socket's reader returns

	setMu  sync.Mutex // serialises SetEngines and Close
	closed bool

	mu     sync.RWMutex
	feeds  map[string]*feed   // by Engine.Addr
	byHost map[string][]*feed // by the host of Engine.Addr

	stats counters
}

// Start starts a Subscriber with no engines (see SetEngines), listening
// on Options.Bind if set. It runs until Close or until ctx ends.
func Start(ctx context.Context, opts Options) (*Subscriber, error) {
	if opts.Sink == nil {
		return nil, errors.New("kvevents: Options.Sink is required")
	}
	if opts.Queue <= 0 {
		opts.Queue = defaultQueue
	}
	if opts.ReplayTimeout <= 0 {
		opts.ReplayTimeout = defaultReplayTimeout
	}
	if opts.Retry <= 0 {
		opts.Retry = defaultRetry
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	s := &Subscriber{opts: opts, log: opts.Log, topic: []byte(opts.Topic), feeds: map[string]*feed{}}
	s.zlog = slog.NewLogLogger(opts.Log.Handler(), slog.LevelDebug)
	s.ctx, s.cancel = context.WithCancel(ctx)
	if opts.Bind != "" {
		sock := zmq4.NewSub(s.ctx, zmq4.WithLogger(s.zlog))
		err := sock.SetOption(zmq4.OptionSubscribe, opts.Topic)
		var ep string
		if err == nil {
			ep, err = zmqEndpoint(opts.Bind)
		}
		if err == nil {
			err = sock.Listen(ep)
		}
		if err == nil {
			s.bound, err = boundEndpoint(sock)
		}
		if err != nil {
			closeSocket(sock)
			s.cancel()
			return nil, fmt.Errorf("kvevents: bind %s: %w", opts.Bind, err)
		}
		s.served = make(chan struct{})
		go s.serve(sock)
	}
	return s, nil
}

// boundEndpoint is the tcp:// endpoint of a listening socket; a wildcard
// address is reachable on loopback.
func boundEndpoint(sock zmq4.Socket) (string, error) {
	tcp, ok := sock.Addr().(*net.TCPAddr)
	if !ok {
		return "", fmt.Errorf("not a TCP listener: %v", sock.Addr())
	}
	host := tcp.IP.String()
	if tcp.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(tcp.Port)), nil
}

// Addr is the endpoint the Bind socket listens on ("tcp://127.0.0.1:port"
// for a wildcard or port 0), or "" without Bind.
func (s *Subscriber) Addr() string { return s.bound }

// Stats is a snapshot of the counts.
func (s *Subscriber) Stats() Stats {
	c := &s.stats
	return Stats{
		Batches: c.batches.Load(), Events: c.events.Load(), UnknownEvents: c.unknownEvents.Load(),
		DecodeErrors: c.decodeErrors.Load(), Malformed: c.malformed.Load(), UnknownTopics: c.unknownTopics.Load(),
		Gaps: c.gaps.Load(), Replays: c.replays.Load(), CatchUps: c.catchUps.Load(), ReplayFailures: c.replayFailures.Load(),
		Restarts: c.restarts.Load(), Overflows: c.overflows.Load(), Dropped: c.dropped.Load(), Resets: c.resets.Load(),
	}
}

// SetEngines makes engines the ones subscribed to. Engines already there
// with the same settings keep their subscriptions (so calling it again
// with the same list does nothing); an engine that is gone, or whose
// settings changed, is unsubscribed, then reset (ReasonRemoved) once its
// last Sink call has returned, and a changed one subscribed anew after
// that. It returns an error, changing nothing, when an engine is invalid.
func (s *Subscriber) SetEngines(engines []Engine) error {
	want := make(map[string]Engine, len(engines))
	for _, e := range engines {
		e, err := e.normalized()
		if err != nil {
			return err
		}
		if _, dup := want[e.Addr]; dup {
			return fmt.Errorf("kvevents: engine %s given twice", e.Addr)
		}
		want[e.Addr] = e
	}
	s.setMu.Lock()
	defer s.setMu.Unlock()
	if s.closed {
		return errors.New("kvevents: SetEngines after Close")
	}
	var stopped, started []*feed
	s.mu.Lock()
	for addr, f := range s.feeds {
		if e, ok := want[addr]; !ok || e != f.cfg {
			stopped = append(stopped, f)
			delete(s.feeds, addr)
		}
	}
	for addr, e := range want {
		if _, ok := s.feeds[addr]; !ok {
			f := s.newFeed(e)
			s.feeds[addr] = f
			started = append(started, f)
		}
	}
	s.byHost = map[string][]*feed{}
	for addr, f := range s.feeds {
		host, _, _ := net.SplitHostPort(addr)
		s.byHost[host] = append(s.byHost[host], f)
	}
	s.mu.Unlock()
	for _, f := range stopped {
		f.cancel()
	}
	for _, f := range stopped {
		f.wg.Wait()
		s.stats.resets.Add(1)
		s.opts.Sink.Reset(f.cfg.Addr, -1, ReasonRemoved)
	}
	for _, f := range started {
		f.start()
	}
	return nil
}

// Close stops every subscription; the Sink is not called after it
// returns.
func (s *Subscriber) Close() error {
	s.setMu.Lock()
	defer s.setMu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.cancel()
	s.mu.Lock()
	feeds := s.feeds
	s.feeds, s.byHost = nil, nil
	s.mu.Unlock()
	for _, f := range feeds {
		f.wg.Wait()
	}
	if s.served != nil {
		<-s.served
	}
	return nil
}

// serve reads the Bind socket and hands each message to the engine its
// topic names.
func (s *Subscriber) serve(sock zmq4.Socket) {
	defer close(s.served)
	defer closeSocket(sock)
	var malformed bool
	logged := map[string]bool{}
	for {
		msg, err := sock.Recv()
		if s.ctx.Err() != nil {
			return
		}
		if err != nil {
			continue // one engine's connection ended; the others go on
		}
		it, ok := s.frame(msg, &malformed, s.log)
		if !ok {
			continue
		}
		s.mu.RLock()
		f := s.route(msg.Frames[0])
		s.mu.RUnlock()
		if f == nil {
			s.stats.unknownTopics.Add(1)
			if topic := string(msg.Frames[0]); !logged[topic] && len(logged) < maxLoggedTopics {
				logged[topic] = true
				s.log.Warn("KV events: a topic that names no engine, dropped", "topic", topic, "bind", s.bound)
			}
			continue
		}
		it.rank = -1 // bind mode: the payload says
		f.offer(&f.bindOverflow, it)
	}
}

var at = []byte("@")

// route is the engine a bind-mode topic names, or nil. s.mu is held.
func (s *Subscriber) route(topic []byte) *feed {
	id := topic // llm-d takes a topic not of the form kv@<id>@<model> whole
	if _, rest, ok := bytes.Cut(topic, at); ok {
		if first, _, ok := bytes.Cut(rest, at); ok {
			id = first
		}
	}
	if f := s.feeds[string(id)]; f != nil {
		return f
	}
	host := string(id)
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	} else {
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	}
	if fs := s.byHost[host]; len(fs) == 1 {
		return fs[0]
	}
	return nil
}

// frame checks a message's shape, [topic, 8-byte sequence, payload]; a
// malformed one is counted, and logged when the first after good ones.
func (s *Subscriber) frame(msg zmq4.Msg, malformed *bool, log *slog.Logger) (item, bool) {
	var why string
	var seq uint64
	switch {
	case len(msg.Frames) != 3:
		why = fmt.Sprintf("%d frames, want [topic, seq, payload]", len(msg.Frames))
	case len(msg.Frames[1]) != 8:
		why = fmt.Sprintf("a %d-byte sequence frame, want 8", len(msg.Frames[1]))
	case !bytes.HasPrefix(msg.Frames[0], s.topic):
		why = "a topic outside the subscription"
	default:
		if seq = binary.BigEndian.Uint64(msg.Frames[1]); seq == math.MaxUint64 {
			why = "sequence -1 (the end of a replay) on the PUB socket"
		}
	}
	if why != "" {
		s.stats.malformed.Add(1)
		if !*malformed {
			*malformed = true
			log.Warn("KV events: malformed messages, dropped", "why", why)
		}
		return item{}, false
	}
	if *malformed {
		*malformed = false
		log.Info("KV events: messages well-formed again")
	}
	return item{seq: seq, payload: msg.Frames[2]}, true
}

// item is what a socket's reader hands an engine's feed.
type item struct {
	rank    int // the publisher's DP rank; -1: the payload's (bind mode)
	seq     uint64
	payload []byte
	mark    mark
}

type mark uint8

const (
	markBatch        mark = iota
	markOverflow          // batches before this one were dropped
	markDisconnected      // the connection dropped (and is back)
)

// seqState is what a feed knows of one publisher's sequence.
type seqState struct {
	known bool
	last  uint64
	// replayed holds the payloads' hashes of the batches a catch-up
	// replayed, by sequence number, until a batch past them comes: the
	// messages queued meanwhile repeat some of them, byte for byte, where
	// a restarted publisher's batch of the same number differs (its
	// timestamp). nil otherwise.
	replayed map[uint64]uint64
	// suspect: the connection dropped since last; a gap now may be a
	// restart (see ReasonReconnect).
	suspect bool
}

// feed is one engine's subscription: the readers of its dialled
// publishers (and the Bind socket's) queue messages, and run, alone,
// decodes them, keeps each rank's sequence and calls the Sink.
type feed struct {
	s      *Subscriber
	cfg    Engine
	log    *slog.Logger
	queue  chan item
	queued atomic.Int64 // payload bytes in queue
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// bindOverflow is the Bind socket reader's overflow state for this
	// engine; only that goroutine touches it.
	bindOverflow bool

	// run's own:
	dec             Decoder    // its batches are valid until the next
	seqs            []seqState // by rank
	decodeFailing   bool
	lastOverflowLog time.Time
}

func (s *Subscriber) newFeed(e Engine) *feed {
	f := &feed{s: s, cfg: e, log: s.log.With("engine", e.Addr), queue: make(chan item, s.opts.Queue), seqs: make([]seqState, e.ranks())}
	f.ctx, f.cancel = context.WithCancel(s.ctx)
	return f
}

func (f *feed) start() {
	f.wg.Go(f.run)
	if f.cfg.Endpoint != "" {
		for rank := range f.cfg.ranks() {
			f.wg.Go(func() { f.dial(rank) })
		}
	}
}

// dial subscribes to rank's publisher and queues its messages. zmq4
// dials until the publisher listens, and again when the connection drops.
func (f *feed) dial(rank int) {
	ep := rankEndpoint(f.cfg.Endpoint, rank)
	sock := zmq4.NewSub(f.ctx, zmq4.WithDialerRetry(f.s.opts.Retry), zmq4.WithDialerMaxRetries(-1),
		zmq4.WithDialerTimeout(dialTimeout), zmq4.WithAutomaticReconnect(true), zmq4.WithLogger(f.s.zlog))
	defer closeSocket(sock)
	if err := sock.SetOption(zmq4.OptionSubscribe, f.s.opts.Topic); err != nil {
		f.log.Error("KV events: cannot subscribe", "endpoint", ep, "err", err)
		return
	}
	zep, err := zmqEndpoint(ep)
	if err == nil {
		err = sock.Dial(zep)
	}
	if err != nil {
		if f.ctx.Err() == nil {
			f.log.Error("KV events: cannot subscribe", "endpoint", ep, "err", err)
		}
		return
	}
	f.log.Debug("KV events: connected", "endpoint", ep, "rank", rank)
	var overflowing, malformed bool
	for {
		msg, err := sock.Recv()
		if f.ctx.Err() != nil {
			return
		}
		if err != nil {
			// zmq4 hands over a connection's error once it has dialled
			// again.
			f.offer(&overflowing, item{rank: rank, mark: markDisconnected})
			continue
		}
		it, ok := f.s.frame(msg, &malformed, f.log)
		if !ok {
			continue
		}
		it.rank = rank
		f.offer(&overflowing, it)
	}
}

// offer queues it without waiting. When the queue is full it drops it and
// what follows until the queue has drained to half, then queues an
// overflow mark first: a flood costs a Reset per half queue, not one per
// batch. overflowing is the calling reader's state.
func (f *feed) offer(overflowing *bool, it item) {
	if *overflowing {
		if len(f.queue) > cap(f.queue)/2 || f.queued.Load() > maxQueuedBytes/2 ||
			!f.put(item{rank: it.rank, mark: markOverflow}) {
			f.s.stats.dropped.Add(1)
			return
		}
		*overflowing = false
	}
	if !f.put(it) {
		*overflowing = true
		f.s.stats.overflows.Add(1)
		f.s.stats.dropped.Add(1)
	}
}

func (f *feed) put(it item) bool {
	n := int64(len(it.payload))
	if f.queued.Add(n) > maxQueuedBytes && n > 0 {
		f.queued.Add(-n)
		return false
	}
	select {
	case f.queue <- it:
		return true
	default:
		f.queued.Add(-n)
		return false
	}
}

// run applies the queued messages in order until the feed stops, after
// what each rank's replay socket holds from before (caughtUp).
func (f *feed) run() {
	for rank := range f.seqs {
		f.caughtUp(rank)
	}
	for {
		select {
		case <-f.ctx.Done():
			return
		case it := <-f.queue:
			f.queued.Add(-int64(len(it.payload)))
			if f.ctx.Err() != nil {
				return
			}
			f.handle(it)
		}
	}
}

func (f *feed) handle(it item) {
	switch it.mark {
	case markOverflow:
		if time.Since(f.lastOverflowLog) > 10*time.Second {
			f.lastOverflowLog = time.Now()
			f.log.Warn("KV events: the sink fell behind, batches dropped; relearning", "rank", it.rank)
		}
		f.reset(it.rank, ReasonOverflow)
		return
	case markDisconnected:
		st := &f.seqs[it.rank]
		st.suspect = st.known
		return
	}
	b, err := f.dec.Decode(it.seq, it.payload)
	rank := it.rank
	if err == nil && rank < 0 {
		rank = b.DPRank // 0 when nil
		if rank >= len(f.seqs) {
			err = fmt.Errorf("kvevents: batch %d: data_parallel_rank %d, but the engine has %d ranks", it.seq, rank, len(f.seqs))
			rank = -1
		}
	}
	if err != nil {
		f.s.stats.decodeErrors.Add(1)
		if !f.decodeFailing {
			f.decodeFailing = true
			f.log.Warn("KV events: batches that do not decode; each resets the engine's state", "err", err)
		}
		f.reset(rank, ReasonDecode)
		return
	}
	if f.decodeFailing {
		f.decodeFailing = false
		f.log.Info("KV events: batches decode again")
	}
	f.sequence(rank, b, it.payload)
}

// sequence applies b, rank's next batch, after what its sequence number
// says: a gap is filled by replay or reset, a number that goes back is a
// restart. Before the first batch, what the publisher's replay socket
// still holds of the batches before it is applied (catchUp).
func (f *feed) sequence(rank int, b *Batch, payload []byte) {
	st := &f.seqs[rank]
	switch {
	case st.replayed != nil && b.Seq <= st.last && st.replayed[b.Seq] == xxhash.Sum64(payload):
		return // applied by the catch-up
	case !st.known:
		f.catchUp(rank, b.Seq)
	case b.Seq == st.last+1:
	case b.Seq <= st.last:
		f.s.stats.restarts.Add(1)
		f.log.Info("KV events: the publisher restarted", "rank", rank, "last", st.last, "seq", b.Seq)
		f.reset(rank, ReasonRestart)
	case st.suspect:
		f.s.stats.gaps.Add(1)
		f.reset(rank, ReasonReconnect)
	default:
		f.s.stats.gaps.Add(1)
		if !f.fill(rank, st.last+1, b.Seq) {
			f.reset(rank, ReasonGap)
		}
	}
	f.apply(b)
	f.seqs[rank] = seqState{known: true, last: b.Seq}
}

// caughtUp applies what rank's publisher's replay socket holds when the
// subscription starts, so that the blocks the engine stored before this
// pdx subscribed are known before any request is placed by them, without
// waiting for the engine to publish again. It does nothing without a
// replay socket, or when the engine does not answer yet (catchUp then
// does at the first batch).
func (f *feed) caughtUp(rank int) {
	if f.cfg.Replay == "" || !f.s.opts.CatchUp {
		return
	}
	ep := rankEndpoint(f.cfg.Replay, rank)
	var last uint64
	replayed := map[uint64]uint64{}
	n, err := f.s.replayFrom(f.ctx, ep, 0, math.MaxUint64, func(b *Batch, payload []byte) {
		last, replayed[b.Seq] = b.Seq, xxhash.Sum64(payload)
		f.apply(b)
	}, true)
	if n > 0 {
		f.seqs[rank] = seqState{known: true, last: last, replayed: replayed}
	}
	if err != nil || n == 0 {
		return
	}
	f.s.stats.catchUps.Add(1)
	f.log.Debug("KV events: caught up with what the publisher held before pdx subscribed", "rank", rank, "replayed", n, "last", last)
}

// catchUp applies what rank's publisher still buffers of the batches
// before until, the first batch pdx heard of it: the blocks an engine
// stored before this pdx subscribed (it started after the engine, or
// restarted), which its events would otherwise never name again. The
// oldest it holds may come later than the first asked for; blocks whose
// parents it no longer holds wait as orphans for them. Nothing is reset
// when it fails: the index then knows what it knew without it.
func (f *feed) catchUp(rank int, until uint64) {
	if f.cfg.Replay == "" || until == 0 || !f.s.opts.CatchUp {
		return
	}
	from := uint64(0)
	if until > maxReplay {
		from = until - maxReplay
	}
	ep := rankEndpoint(f.cfg.Replay, rank)
	n, err := f.s.replayFrom(f.ctx, ep, from, until, f.applyReplayed, true)
	if err != nil {
		f.log.Info("KV events: caught up in part with what the publisher held before pdx subscribed", "endpoint", ep, "until", until, "replayed", n, "err", err)
		return
	}
	f.s.stats.catchUps.Add(1)
	f.log.Debug("KV events: caught up with what the publisher held before pdx subscribed", "rank", rank, "until", until, "replayed", n)
}

// fill replays batches from..until-1 of rank's publisher, applying them;
// false when it could not have them all (those it had are applied).
func (f *feed) fill(rank int, from, until uint64) bool {
	if f.cfg.Replay == "" || until-from > maxReplay {
		return false
	}
	ep := rankEndpoint(f.cfg.Replay, rank)
	n, err := f.s.replayFrom(f.ctx, ep, from, until, f.applyReplayed, false)
	if err != nil {
		f.s.stats.replayFailures.Add(1)
		f.log.Warn("KV events: replay failed", "endpoint", ep, "from", from, "until", until, "replayed", n, "err", err)
		return false
	}
	f.s.stats.replays.Add(1)
	f.log.Debug("KV events: gap replayed", "rank", rank, "from", from, "until", until)
	return true
}

// applyReplayed applies a batch a replay brought.
func (f *feed) applyReplayed(b *Batch, _ []byte) { f.apply(b) }

func (f *feed) apply(b *Batch) {
	c := &f.s.stats
	c.batches.Add(1)
	c.events.Add(uint64(len(b.Events)))
	c.unknownEvents.Add(uint64(b.Skipped))
	f.s.opts.Sink.Apply(f.cfg.Addr, b)
}

// reset resets rank (-1: all) in the Sink and forgets its sequence: the
// next batch's number is taken as it is.
func (f *feed) reset(rank int, reason string) {
	f.s.stats.resets.Add(1)
	f.s.opts.Sink.Reset(f.cfg.Addr, rank, reason)
	if rank < 0 {
		clear(f.seqs)
	} else {
		f.seqs[rank] = seqState{}
	}
}

// endReplay is the sequence frame that ends a replay, -1
// (ZmqEventPublisher.END_SEQ).
var endReplay = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// replay asks a replay socket for the batches from on and hands those
// before until to apply, in order, returning how many. The socket is
// vLLM's ROUTER (ZmqEventPublisher._service_replay): it takes [identity,
// "", start seq (8 bytes, big-endian)], so a DEALER sends ["", start], and
// answers each buffered batch from start on as ["", topic, seq, payload],
// then ["", "", -1, ""] (vLLM 0.32; older releases sent no topic frame:
// ["", seq, payload], then ["", -1, ""]). It fails when no answer comes
// within ReplayTimeout, or the socket no longer has batch from (unless
// later: then it starts with the oldest batch it has).
func (s *Subscriber) replayFrom(ctx context.Context, endpoint string, from, until uint64, apply func(b *Batch, payload []byte), later bool) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.ReplayTimeout)
	defer cancel()
	d := zmq4.NewDealer(ctx, zmq4.WithDialerMaxRetries(1), zmq4.WithDialerRetry(50*time.Millisecond), zmq4.WithLogger(s.zlog))
	defer closeSocket(d)
	zep, err := zmqEndpoint(endpoint)
	if err == nil {
		err = d.Dial(zep)
	}
	if err != nil {
		return 0, err
	}
	if err := d.SendMulti(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, from))); err != nil {
		return 0, fmt.Errorf("request: %w", err)
	}
	applied := 0
	for next := from; next < until; {
		msg, err := d.Recv()
		if err != nil {
			return applied, fmt.Errorf("waiting for batch %d: %w", next, err)
		}
		frames := msg.Frames
		if len(frames) == 4 {
			frames = [][]byte{frames[0], frames[2], frames[3]} // the topic is the publisher's own
		}
		if len(frames) != 3 || len(frames[0]) != 0 || len(frames[1]) != 8 {
			return applied, fmt.Errorf("a reply of %d frames, want [\"\", topic, seq, payload] or [\"\", seq, payload]", len(msg.Frames))
		}
		if bytes.Equal(frames[1], endReplay) {
			if until == math.MaxUint64 {
				return applied, nil // everything buffered
			}
			return applied, fmt.Errorf("the replay ended before batch %d", next)
		}
		seq := binary.BigEndian.Uint64(frames[1])
		if seq < next {
			continue
		}
		if seq > next && later && applied == 0 {
			next = seq // the oldest the buffer still holds
			if next >= until {
				return 0, nil
			}
		}
		if seq > next {
			return applied, fmt.Errorf("batch %d is no longer buffered (the replay starts at %d)", next, seq)
		}
		b, err := Decode(seq, frames[2])
		if err != nil {
			return applied, err
		}
		apply(&b, frames[2])
		applied++
		next++
	}
	return applied, nil
}

// closeSocket closes sock, then lets zmq4's (v0.17.0) connection readers
// go: one that found the socket's receive queue full waits on it for ever
// (qreader.listen does not watch the socket's context while it sends), so
// the queue is emptied until it stays empty.
func closeSocket(sock zmq4.Socket) {
	_ = sock.Close()
	for misses := 0; misses < 16; {
		if _, err := sock.Recv(); errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			misses++
			runtime.Gosched()
		} else {
			misses = 0
		}
	}
}
