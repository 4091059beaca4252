package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// call is one Sink call: an Apply (batch set) or a Reset.
type call struct {
	engine string
	batch  *Batch
	rank   int
	reason string
}

func (c call) String() string {
	if c.batch != nil {
		return fmt.Sprintf("Apply(%s, seq %d, %d events)", c.engine, c.batch.Seq, len(c.batch.Events))
	}
	return fmt.Sprintf("Reset(%s, %d, %s)", c.engine, c.rank, c.reason)
}

// recorder is a Sink that records its calls. hold, when set, makes Apply
// wait until it is closed (a Sink fallen behind). It checks the Sink
// contract: calls for one engine never overlap.
type recorder struct {
	mu       sync.Mutex
	hold     chan struct{}
	calls    []call
	inFlight map[string]bool
	overlaps int
	changed  chan struct{}
}

func newRecorder() *recorder {
	return &recorder{inFlight: map[string]bool{}, changed: make(chan struct{}, 1)}
}

func (r *recorder) enter(engine string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.inFlight[engine] {
		r.overlaps++
	}
	r.inFlight[engine] = true
}

func (r *recorder) leave(c call) {
	r.mu.Lock()
	r.inFlight[c.engine] = false
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *recorder) Apply(engine string, b *Batch) {
	r.enter(engine)
	r.mu.Lock()
	hold := r.hold
	r.mu.Unlock()
	if hold != nil {
		<-hold
	}
	r.leave(call{engine: engine, batch: cloneBatch(b)})
}

// cloneBatch is a copy of b that owns its slices, as a Sink that keeps a
// batch must make.
func cloneBatch(b *Batch) *Batch {
	c := *b
	c.Events = slices.Clone(b.Events)
	for i := range c.Events {
		ev := &c.Events[i]
		ev.Hashes, ev.TokenIDs, ev.ExtraKeys = slices.Clone(ev.Hashes), slices.Clone(ev.TokenIDs), slices.Clone(ev.ExtraKeys)
	}
	return &c
}

// holdApplies makes Apply wait until release is called, or the test
// ends: a test that fails while Applies wait must not leave the
// Subscriber's Close waiting for them.
func (r *recorder) holdApplies(t *testing.T) (release func()) {
	hold := make(chan struct{})
	r.mu.Lock()
	r.hold = hold
	r.mu.Unlock()
	release = sync.OnceFunc(func() {
		r.mu.Lock()
		r.hold = nil
		r.mu.Unlock()
		close(hold)
	})
	t.Cleanup(release)
	return release
}

// applying reports whether an Apply for engine is under way.
func (r *recorder) applying(engine string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.inFlight[engine]
}

func (r *recorder) Reset(engine string, rank int, reason string) {
	r.enter(engine)
	r.leave(call{engine: engine, rank: rank, reason: reason})
}

// since is the calls from the i-th on.
func (r *recorder) since(i int) []call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls[min(i, len(r.calls)):])
}

func (r *recorder) len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.calls)
}

// await waits up to d for ok to hold of the calls, and says whether it did.
func (r *recorder) await(d time.Duration, ok func([]call) bool) bool {
	deadline := time.After(d)
	for {
		if ok(r.since(0)) {
			return true
		}
		select {
		case <-r.changed:
		case <-deadline:
			return false
		}
	}
}

// waitFor fails the test unless ok comes to hold of the calls within 10s.
func (r *recorder) waitFor(t *testing.T, what string, ok func([]call) bool) []call {
	t.Helper()
	if !r.await(10*time.Second, ok) {
		require.FailNow(t, "the Sink never saw "+what, "calls: %v", r.since(0))
	}
	return r.since(0)
}

// applied reports whether calls hold an Apply of seq for engine.
func applied(engine string, seq uint64) func([]call) bool {
	return func(calls []call) bool {
		return slices.ContainsFunc(calls, func(c call) bool { return c.engine == engine && c.batch != nil && c.batch.Seq == seq })
	}
}

// anyApplied reports whether calls hold an Apply for engine from the
// mark-th call on.
func anyApplied(engine string, mark int) func([]call) bool {
	return func(calls []call) bool {
		return slices.ContainsFunc(calls[min(mark, len(calls)):], func(c call) bool { return c.engine == engine && c.batch != nil })
	}
}

// reset reports whether calls hold a Reset of engine's rank for reason.
func reset(engine string, rank int, reason string) func([]call) bool {
	return func(calls []call) bool {
		return slices.ContainsFunc(calls, func(c call) bool {
			return c.engine == engine && c.batch == nil && c.rank == rank && c.reason == reason
		})
	}
}

// resets is the Resets among calls.
func resets(calls []call) []call {
	var out []call
	for _, c := range calls {
		if c.batch == nil {
			out = append(out, c)
		}
	}
	return out
}

// startEngineAt runs an engine simulator on addr for the test.
func startEngineAt(t *testing.T, addr string, cfg enginesim.Config) *enginesim.Server {
	t.Helper()
	s, err := enginesim.Start(t.Context(), addr, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Close()) })
	return s
}

// startSub starts a Subscriber for the test, sending rec its calls.
func startSub(t *testing.T, rec *recorder, opts Options) *Subscriber {
	t.Helper()
	opts.Sink = rec
	if opts.Retry == 0 {
		opts.Retry = 50 * time.Millisecond
	}
	w := &testWriter{t: t}
	opts.Log = slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
	s, err := Start(t.Context(), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, s.Close())
		w.stop()
		rec.mu.Lock()
		defer rec.mu.Unlock()
		require.Zero(t, rec.overlaps, "Sink calls for one engine overlapped")
	})
	return s
}

// testWriter logs to the test, so that a failure shows the Subscriber's
// log, until stop: zmq4's goroutines may log a little after Close.
type testWriter struct {
	t       *testing.T
	mu      sync.Mutex
	stopped bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.stopped {
		w.t.Log(string(p[:len(p)-1]))
	}
	return len(p), nil
}

func (w *testWriter) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
}

// simEngine is the Engine of a simulator publishing on its own socket.
func simEngine(s *enginesim.Server) Engine {
	return Engine{Addr: s.Addr(), Endpoint: s.KVEventsEndpoint(), Replay: s.KVEventsReplayEndpoint()}
}

// syncSim resets s's cache (an AllBlocksCleared batch each) until the
// Sink gets one, then until it has the last: the subscription is live and
// every batch from now on reaches the Sink. It returns the last's seq,
// counting s's batches from first (its numbering so far).
func syncSim(t *testing.T, s *enginesim.Server, rec *recorder, engine string, first uint64) uint64 {
	t.Helper()
	seq := first
	deadline := time.Now().Add(10 * time.Second)
	for mark := rec.len(); ; {
		require.True(t, s.ResetPrefixCache())
		if rec.await(50*time.Millisecond, anyApplied(engine, mark)) {
			break
		}
		require.True(t, time.Now().Before(deadline), "the subscription never reached the publisher")
		seq++
	}
	rec.waitFor(t, fmt.Sprintf("batch %d", seq), applied(engine, seq))
	return seq
}

// testPub is a publisher written for the tests: a PUB socket (listening or
// dialling) and a replay ROUTER that serves what send and skip recorded.
type testPub struct {
	t     *testing.T
	topic []byte
	rank  int // the payloads' data_parallel_rank
	pub   zmq4.Socket
	ep    string // the PUB's endpoint
	next  uint64 // the seq sync publishes next

	router   zmq4.Socket
	replayEP string
	requests chan uint64 // replay requests' start seqs

	mu       sync.Mutex
	buffered map[uint64][]byte
	from     uint64 // the replay buffer holds from this seq on
	mute     bool   // the replay socket answers nothing
	// noTopic answers replays as vLLM before 0.32 did, without the topic
	// frame: ["", seq, payload], then ["", -1, ""].
	noTopic bool

	close func() // stops the publisher (also at the test's end)
}

// newTestPub starts a publisher whose PUB listens on listen, or dials it
// when dial, with a replay socket when replay.
func newTestPub(t *testing.T, listen string, dial, replay bool, topic string) *testPub {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	p := &testPub{t: t, topic: []byte(topic), buffered: map[uint64][]byte{}, requests: make(chan uint64, 16)}
	done := make(chan struct{})
	if dial {
		p.pub = zmq4.NewPub(ctx, zmq4.WithDialerRetry(50*time.Millisecond))
		require.NoError(t, p.pub.Dial(listen))
		p.ep = listen
	} else {
		p.pub = zmq4.NewPub(ctx)
		require.NoError(t, p.pub.Listen(listen))
		var err error
		p.ep, err = boundEndpoint(p.pub)
		require.NoError(t, err)
	}
	if replay {
		p.router = zmq4.NewRouter(ctx)
		require.NoError(t, p.router.Listen("tcp://127.0.0.1:0"))
		var err error
		p.replayEP, err = boundEndpoint(p.router)
		require.NoError(t, err)
		go p.serveReplay(done)
	} else {
		close(done)
	}
	p.close = sync.OnceFunc(func() {
		_ = p.pub.Close()
		if p.router != nil {
			_ = p.router.Close()
		}
		cancel()
		<-done
	})
	t.Cleanup(p.close)
	return p
}

func (p *testPub) serveReplay(done chan struct{}) {
	defer close(done)
	for {
		msg, err := p.router.Recv()
		if err != nil {
			return
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		select {
		case p.requests <- start:
		default:
		}
		p.mu.Lock()
		mute, noTopic := p.mute, p.noTopic
		var seqs []uint64
		for seq := range p.buffered {
			if seq >= start && seq >= p.from {
				seqs = append(seqs, seq)
			}
		}
		slices.Sort(seqs)
		replies := make([][]byte, len(seqs))
		for i, seq := range seqs {
			replies[i] = p.buffered[seq]
		}
		p.mu.Unlock()
		if mute {
			continue
		}
		if noTopic {
			for i, seq := range seqs {
				_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, binary.BigEndian.AppendUint64(nil, seq), replies[i]))
			}
			_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, endReplay, nil))
			continue
		}
		// vLLM 0.32's ZmqEventPublisher._service_replay.
		for i, seq := range seqs {
			_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, p.topic, binary.BigEndian.AppendUint64(nil, seq), replies[i]))
		}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, nil, endReplay, nil))
	}
}

// batch is the test publishers' batch seq: one BlockRemoved of hash seq,
// so the Sink's batches say which they were.
func (p *testPub) batch(seq uint64) []byte {
	b := Batch{TS: 1, HasDPRank: true, DPRank: p.rank, Events: []Event{{Kind: BlockRemoved, Hashes: []Hash{{Lo: seq}}}}}
	return encodeBatch(p.t, &b, false)
}

// send publishes batch seq (and keeps it for replay).
func (p *testPub) send(seq uint64) {
	p.skip(seq)
	p.sendFrames(p.topic, binary.BigEndian.AppendUint64(nil, seq), p.batch(seq))
}

// skip keeps batch seq for replay without publishing it: a lost message.
func (p *testPub) skip(seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buffered[seq] = p.batch(seq)
}

func (p *testPub) sendFrames(frames ...[]byte) {
	require.NoError(p.t, p.pub.SendMulti(zmq4.NewMsgFrom(frames...)))
}

// drainRequests forgets the replay requests p has had: a subscription's
// catch-up before the batches a test sends.
func (p *testPub) drainRequests() {
	for {
		select {
		case <-p.requests:
		default:
			return
		}
	}
}

// sync publishes batches from p.next on until the Sink has one of them:
// p.next is then the seq the Sink expects next. It keeps none of them for
// replay, so that only the live connection brings them (a subscription's
// catch-up cannot stand for it).
func (p *testPub) sync(rec *recorder, engine string) {
	p.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		seq := p.next
		p.sendFrames(p.topic, binary.BigEndian.AppendUint64(nil, seq), p.batch(seq))
		p.next++
		if rec.await(50*time.Millisecond, applied(engine, seq)) {
			return
		}
		require.True(p.t, time.Now().Before(deadline), "the subscription never reached the publisher")
	}
}

// appliedSeqs is the seqs of engine's Applies among calls.
func appliedSeqs(calls []call, engine string) []uint64 {
	var out []uint64
	for _, c := range calls {
		if c.engine == engine && c.batch != nil {
			out = append(out, c.batch.Seq)
		}
	}
	return out
}

// freePorts is a loopback port p with p..p+n-1 all free just now, for
// publishers of consecutive DP ranks.
func freePorts(t *testing.T, n int) int {
	t.Helper()
	for range 20 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		base := ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		ok := true
		for i := 1; i < n && ok; i++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if ok = err == nil; ok {
				lns = append(lns, l)
			}
		}
		for _, l := range lns {
			require.NoError(t, l.Close())
		}
		if ok {
			return base
		}
	}
	require.FailNow(t, "no run of free ports")
	return 0
}
