package enginesim

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// KVEvents makes an engine publish its prefix cache's changes as vLLM's
// --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'
// does (vllm/config/kv_events.py, KVEventsConfig; the publisher is
// vllm/distributed/kv_events.py, ZmqEventPublisher): a ZeroMQ PUB socket
// sends one message of three frames per batch of events, [topic, sequence
// number (8 bytes, big-endian), msgpack payload], and an optional ROUTER
// socket replays buffered batches to a subscriber that missed some.
//
// The events are vLLM's BlockStored (full prompt blocks entered the cache:
// a chain of block hashes, the hash of the block before them, their token
// ids in the simulator tokenizer's vocabulary, the block size), BlockRemoved
// (evicted) and AllBlocksCleared (POST /reset_prefix_cache), as vLLM's
// BlockPool emits them (vllm/v1/core/block_pool.py: cache_full_blocks,
// _maybe_evict_cached_block, reset_prefix_cache). Block hashes are the
// simulator's own chained 64-bit hashes, opaque integers as vLLM's are with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (its default). Only the prefix cache of
// Config.Capacity has blocks, so KVEvents needs it.
type KVEvents struct {
	// Endpoint is where the PUB socket listens, e.g. "tcp://127.0.0.1:0"
	// (a free port; see Server.KVEventsEndpoint) or vLLM's default
	// "tcp://*:5557"; with Connect, the subscriber's socket it dials.
	Endpoint string
	// Connect makes the PUB socket dial Endpoint instead of binding it: the
	// engines of a subscriber that binds one socket for all (llm-d's
	// "central" mode). vLLM decides by the address
	// (ZmqEventPublisher._socket_setup: bind when it contains "*" or "::"
	// or is ipc:// or inproc://, else connect); the simulator binds unless
	// Connect is set, so "tcp://127.0.0.1:0" keeps binding. Like pyzmq's
	// connect it retries in the background, before the subscriber listens
	// and after it goes away; batches sent while unconnected are dropped,
	// as a PUB socket drops them.
	Connect bool
	// ReplayEndpoint, when set, is where the ROUTER socket that answers
	// replay requests listens (vLLM's replay_endpoint).
	ReplayEndpoint string
	// Topic is the first frame of every message (vLLM's topic, default "").
	Topic string
	// BufferSteps is how many past batches the replay socket keeps
	// (vLLM's buffer_steps, default 10000).
	BufferSteps int
	// Encoding is the payload's msgpack shape: EventsMap (the default) or
	// EventsArray.
	Encoding string
	// TokenScale, when above 1, publishes each simulated token as
	// TokenScale token ids (the id repeated), and the Renderer APIs answer
	// the same ids: an engine of ReferenceCapacity(tokenScale, ...), whose
	// block is 16/tokenScale simulated tokens, then publishes blocks of the
	// real 16 tokens. vllm-router reads --pd-kv-events sources with block
	// size 16 and rejects other batches (BlockSizeMismatch); a replay
	// divides token counts by its token scale.
	TokenScale int
}

// The payload shapes. A batch is [ts, events, data_parallel_rank] in both
// (msgspec's array_like=True EventBatch); they differ in the events.
const (
	// EventsMap encodes each event as a map tagged by "type"
	// ({"type": "BlockStored", "block_hashes": [...], ...}): vLLM since
	// PR #42892 ("[KV Events] Switch event structs from array to map
	// encoding"; 0.23.0 still had arrays, a capture of 0.26.0's wire is in
	// volcano-sh/kthena#1535), and what vllm-router 0.1.17 decodes
	// (src/kv_index/decode.rs, decode_event: "KV event must be a tagged map").
	EventsMap = "map"
	// EventsArray encodes each event as a tagged array
	// (["BlockStored", block_hashes, parent_block_hash, ...]): vLLM before
	// PR #42892, whose KVCacheEvent had array_like=True, with the fields
	// it had by then (through kv_cache_spec_kind).
	EventsArray = "array"
)

const (
	defaultKVEventsBufferSteps = 10_000 // vLLM's buffer_steps
	// kvEventsQueue bounds the batches waiting to be sent; vLLM's
	// max_queue_size is 100,000, and its publish blocks when it is full, as
	// this one does.
	kvEventsQueue = 100_000
	// mediumGPU is vLLM's MEDIUM_GPU, the medium of a device block.
	mediumGPU = "GPU"
	// specFullAttention is the kv_cache_spec_kind of a model's only,
	// full-attention KV cache group (vLLM's FullAttentionSpec).
	specFullAttention = "full_attention"
)

func (k *KVEvents) withDefaults(c *Config) error {
	if k.Endpoint == "" {
		return errors.New("enginesim: KVEvents.Endpoint is required (e.g. tcp://127.0.0.1:0)")
	}
	for _, ep := range []string{k.Endpoint, k.ReplayEndpoint} {
		if ep != "" && !strings.HasPrefix(ep, "tcp://") {
			return fmt.Errorf("enginesim: KV events endpoint %q: only tcp:// is simulated", ep)
		}
	}
	if k.Connect && strings.HasSuffix(k.Endpoint, ":0") {
		return fmt.Errorf("enginesim: KVEvents.Connect needs the port to dial, got %q", k.Endpoint)
	}
	if c.Capacity == nil {
		return errors.New("enginesim: KVEvents needs Capacity: only its prefix cache has blocks to publish")
	}
	if c.DPSize > 1 {
		// vLLM runs a publisher per DP rank, each on the endpoint's port +
		// rank (ZmqEventPublisher.offset_endpoint_port); the simulator's
		// ranks share one prefix cache, so there is nothing per rank to send.
		return errors.New("enginesim: KVEvents with DPSize > 1 is not modelled (the ranks share one prefix cache)")
	}
	switch k.Encoding {
	case "":
		k.Encoding = EventsMap
	case EventsMap, EventsArray:
	default:
		return fmt.Errorf("enginesim: unknown KVEvents.Encoding %q (want %s or %s)", k.Encoding, EventsMap, EventsArray)
	}
	if k.BufferSteps == 0 {
		k.BufferSteps = defaultKVEventsBufferSteps
	}
	if k.TokenScale == 0 {
		k.TokenScale = 1
	}
	if k.TokenScale < 0 {
		return fmt.Errorf("enginesim: KVEvents.TokenScale must not be negative, got %d", k.TokenScale)
	}
	if k.BufferSteps < 0 {
		return fmt.Errorf("enginesim: KVEvents.BufferSteps must not be negative, got %d", k.BufferSteps)
	}
	return nil
}

// kvEventKind names vLLM's event classes, the tag msgspec writes.
type kvEventKind string

const (
	eventBlockStored      kvEventKind = "BlockStored"
	eventBlockRemoved     kvEventKind = "BlockRemoved"
	eventAllBlocksCleared kvEventKind = "AllBlocksCleared"
)

// kvEvent is one of vLLM's KVCacheEvents.
type kvEvent struct {
	kind      kvEventKind
	hashes    []uint64
	tokenIDs  []uint32 // BlockStored: len(hashes) × blockSize ids
	blockSize int
	// BlockStored: the hash of the block before hashes[0], if any
	hasParent   bool
	parentValue uint64
}

// kvEventLog collects a prefix cache's events until they are published.
type kvEventLog struct {
	blockTokens int
	tokenScale  int // KVEvents.TokenScale
	pending     []kvEvent
}

// stored records that block i of a prompt (hashes, ids) entered the cache.
// Consecutive blocks of one prompt extend one BlockStored, as vLLM's
// cache_full_blocks emits one event per run of newly full blocks.
func (l *kvEventLog) stored(hashes []uint64, ids []uint32, i int) {
	bt := l.blockTokens
	tokens := scaleTokens(ids[i*bt:(i+1)*bt], l.tokenScale)
	if n := len(l.pending); n > 0 {
		last := &l.pending[n-1]
		if last.kind == eventBlockStored && i > 0 && last.hashes[len(last.hashes)-1] == hashes[i-1] {
			last.hashes = append(last.hashes, hashes[i])
			last.tokenIDs = append(last.tokenIDs, tokens...)
			return
		}
	}
	e := kvEvent{kind: eventBlockStored, hashes: []uint64{hashes[i]}, tokenIDs: tokens, blockSize: bt * l.tokenScale}
	if i > 0 {
		e.hasParent, e.parentValue = true, hashes[i-1]
	}
	l.pending = append(l.pending, e)
}

// scaleTokens is ids with each id repeated scale times (KVEvents.TokenScale),
// a new slice.
func scaleTokens(ids []uint32, scale int) []uint32 {
	out := make([]uint32, 0, len(ids)*scale)
	for _, id := range ids {
		for range scale {
			out = append(out, id)
		}
	}
	return out
}

// removed records an eviction: one BlockRemoved per block, as vLLM's
// _maybe_evict_cached_block emits them.
func (l *kvEventLog) removed(hash uint64) {
	l.pending = append(l.pending, kvEvent{kind: eventBlockRemoved, hashes: []uint64{hash}})
}

func (l *kvEventLog) cleared() {
	l.pending = append(l.pending, kvEvent{kind: eventAllBlocksCleared})
}

// take returns the pending events and forgets them.
func (l *kvEventLog) take() []kvEvent {
	ev := l.pending
	l.pending = nil
	return ev
}

// kvPublisher is the ZMQ side: vLLM's ZmqEventPublisher.
type kvPublisher struct {
	cfg      KVEvents
	pub      zmq4.Socket
	replay   zmq4.Socket // nil without ReplayEndpoint
	endpoint string      // tcp://host:port bound
	replayEP string
	// listenEP is Endpoint with the port bound (Endpoint itself with
	// Connect), and listenReplay ReplayEndpoint's: where a restarted
	// publisher listens again.
	listenEP, listenReplay string
	queue                  chan kvBatch
	done                   chan struct{}
	dialed                 chan struct{} // with Connect: closed when the dialling gives up
	cancel                 context.CancelFunc
	// closing guards queue: publish sends under its read lock, close
	// closes the queue under its write lock, so a late publish is dropped
	// rather than a send on a closed channel.
	closing sync.RWMutex
	closed  bool

	mu     sync.Mutex
	buffer []sentBatch // the last BufferSteps batches sent, oldest first
	sent   uint64      // batches sent
}

type kvBatch struct {
	ts     time.Time
	events []kvEvent
}

type sentBatch struct {
	seq     uint64
	payload []byte
}

// endReplay is the sequence frame ending a replay, -1 as 8 signed bytes
// (ZmqEventPublisher.END_SEQ).
var endReplay = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// kvDialRetry is the wait between a connecting publisher's dials.
const kvDialRetry = 100 * time.Millisecond

func startKVPublisher(cfg KVEvents) (*kvPublisher, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &kvPublisher{cfg: cfg, queue: make(chan kvBatch, kvEventsQueue), done: make(chan struct{}), dialed: make(chan struct{}), cancel: cancel}
	var err error
	if cfg.Connect {
		// zmq4's Dial blocks until it connects; retrying for ever it
		// returns only when the socket closes.
		p.pub = zmq4.NewPub(ctx, zmq4.WithDialerRetry(kvDialRetry), zmq4.WithDialerMaxRetries(-1), zmq4.WithAutomaticReconnect(true))
		p.endpoint, p.listenEP = cfg.Endpoint, cfg.Endpoint
		go func() {
			defer close(p.dialed)
			_ = p.pub.Dial(cfg.Endpoint)
		}()
	} else {
		close(p.dialed)
		p.pub = zmq4.NewPub(ctx)
		if err := p.pub.Listen(cfg.Endpoint); err != nil {
			cancel()
			return nil, fmt.Errorf("enginesim: KV events: %w", err)
		}
		if p.endpoint, err = boundEndpoint(p.pub); err != nil {
			_ = p.pub.Close()
			cancel()
			return nil, err
		}
		p.listenEP = withBoundPort(cfg.Endpoint, p.pub)
	}
	if cfg.ReplayEndpoint != "" {
		p.replay = zmq4.NewRouter(ctx)
		if err := p.replay.Listen(cfg.ReplayEndpoint); err != nil {
			_ = p.pub.Close()
			cancel()
			<-p.dialed
			return nil, fmt.Errorf("enginesim: KV events replay: %w", err)
		}
		if p.replayEP, err = boundEndpoint(p.replay); err != nil {
			_ = p.pub.Close()
			_ = p.replay.Close()
			cancel()
			<-p.dialed
			return nil, err
		}
		p.listenReplay = withBoundPort(cfg.ReplayEndpoint, p.replay)
		go p.serveReplay()
	}
	go p.run()
	return p, nil
}

// boundEndpoint is the tcp:// endpoint subscribers connect to; a wildcard
// address is reachable on loopback.
func boundEndpoint(s zmq4.Socket) (string, error) {
	tcp, ok := s.Addr().(*net.TCPAddr)
	if !ok {
		return "", fmt.Errorf("enginesim: KV events: not a TCP endpoint: %v", s.Addr())
	}
	host := tcp.IP.String()
	if tcp.IP.IsUnspecified() {
		host = "127.0.0.1"
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(tcp.Port)), nil
}

// withBoundPort is endpoint with the port s listens on (endpoint may ask
// for port 0), its host as given.
func withBoundPort(endpoint string, s zmq4.Socket) string {
	tcp, ok := s.Addr().(*net.TCPAddr)
	i := strings.LastIndexByte(endpoint, ':')
	if !ok || i < 0 {
		return endpoint
	}
	return endpoint[:i+1] + strconv.Itoa(tcp.Port)
}

// publish queues a batch; like vLLM's publish it blocks while the queue is
// full.
func (p *kvPublisher) publish(events []kvEvent) {
	if len(events) == 0 {
		return
	}
	p.closing.RLock()
	defer p.closing.RUnlock()
	if p.closed {
		return
	}
	p.queue <- kvBatch{ts: time.Now(), events: events}
}

// run sends the queued batches in order, numbering them from 0 (vLLM's
// _publisher_thread, with itertools.count()).
func (p *kvPublisher) run() {
	defer close(p.done)
	for b := range p.queue {
		payload, err := encodeKVBatch(b, p.cfg.Encoding)
		if err != nil {
			continue // encoding our own events cannot fail
		}
		p.mu.Lock()
		seq := p.sent
		p.sent++
		p.buffer = append(p.buffer, sentBatch{seq: seq, payload: payload})
		if len(p.buffer) > p.cfg.BufferSteps {
			p.buffer = p.buffer[len(p.buffer)-p.cfg.BufferSteps:]
		}
		p.mu.Unlock()
		var seqFrame [8]byte
		binary.BigEndian.PutUint64(seqFrame[:], seq)
		_ = p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.cfg.Topic), seqFrame[:], payload))
	}
}

// serveReplay answers replay requests, [identity, "", start seq], with every
// buffered batch from start on, [identity, "", topic, seq, payload], then
// [identity, "", "", -1, ""], as vLLM 0.32's ZmqEventPublisher
// ._service_replay does (the real-engine tier saw it; releases before sent
// no topic frame).
func (p *kvPublisher) serveReplay() {
	for {
		msg, err := p.replay.Recv()
		if err != nil {
			return // closed
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue // vLLM logs "Invalid replay request" and goes on
		}
		id, start := msg.Frames[0], binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		var todo []sentBatch
		for _, b := range p.buffer {
			if b.seq >= start {
				todo = append(todo, b)
			}
		}
		p.mu.Unlock()
		for _, b := range todo {
			var seqFrame [8]byte
			binary.BigEndian.PutUint64(seqFrame[:], b.seq)
			_ = p.replay.SendMulti(zmq4.NewMsgFrom(id, nil, []byte(p.cfg.Topic), seqFrame[:], b.payload))
		}
		_ = p.replay.SendMulti(zmq4.NewMsgFrom(id, nil, nil, endReplay, nil))
	}
}

// close sends what is queued, then closes the sockets; later batches are
// dropped.
func (p *kvPublisher) close() {
	p.closing.Lock()
	p.closed = true
	close(p.queue)
	p.closing.Unlock()
	<-p.done
	_ = p.pub.Close()
	if p.replay != nil {
		_ = p.replay.Close()
	}
	p.cancel()
	<-p.dialed
}

// encodeKVBatch is msgspec's encoding of vLLM's KVEventBatch: the batch is
// array_like, so [ts, events, data_parallel_rank] (the rank, 0, is set by
// the publisher and so not omitted); omit_defaults drops optional fields
// left at their defaults. (A later vLLM main, kv_events.py at 0181ea31,
// dropped array_like from EventBatch too, making the batch a map;
// vllm-router 0.1.17 rejects that, "KV event batch must be an array", so
// the array is kept.)
func encodeKVBatch(b kvBatch, encoding string) ([]byte, error) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	ts := float64(b.ts.UnixNano()) / 1e9
	w := &msgWriter{enc: enc}
	w.arrayLen(3)
	w.float(ts)
	w.arrayLen(len(b.events))
	for _, e := range b.events {
		if encoding == EventsArray {
			w.eventArray(e)
		} else {
			w.eventMap(e)
		}
	}
	w.uint(0)
	return buf.Bytes(), w.err
}

// msgWriter keeps the first encoding error.
type msgWriter struct {
	enc *msgpack.Encoder
	err error
}

func (w *msgWriter) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *msgWriter) arrayLen(n int)  { w.do(w.enc.EncodeArrayLen(n)) }
func (w *msgWriter) mapLen(n int)    { w.do(w.enc.EncodeMapLen(n)) }
func (w *msgWriter) str(s string)    { w.do(w.enc.EncodeString(s)) }
func (w *msgWriter) float(f float64) { w.do(w.enc.EncodeFloat64(f)) }
func (w *msgWriter) uint(n uint64)   { w.do(w.enc.EncodeUint(n)) }
func (w *msgWriter) null()           { w.do(w.enc.EncodeNil()) }

func (w *msgWriter) hashes(hs []uint64) {
	w.arrayLen(len(hs))
	for _, h := range hs {
		w.uint(h)
	}
}

func (w *msgWriter) parent(e kvEvent) {
	if e.hasParent {
		w.uint(e.parentValue)
	} else {
		w.null()
	}
}

func (w *msgWriter) tokens(ids []uint32) {
	w.arrayLen(len(ids))
	for _, id := range ids {
		w.uint(uint64(id))
	}
}

// extraKeys is vLLM's extra_keys of blocks without multimodal inputs, LoRA
// or cache salt: one null per block.
func (w *msgWriter) extraKeys(n int) {
	w.arrayLen(n)
	for range n {
		w.null()
	}
}

// eventMap writes e as a tagged map, the fields in vLLM's declaration order
// (msgspec writes the tag first). BlockStored's required fields are always
// there, null or not; of its defaulted ones vLLM sets extra_keys, group_idx
// and kv_cache_spec_kind, and leaves kv_cache_spec_sliding_window (None for
// full attention) out.
func (w *msgWriter) eventMap(e kvEvent) {
	switch e.kind {
	case eventBlockStored:
		w.mapLen(11)
		w.str("type")
		w.str(string(e.kind))
		w.str("block_hashes")
		w.hashes(e.hashes)
		w.str("parent_block_hash")
		w.parent(e)
		w.str("token_ids")
		w.tokens(e.tokenIDs)
		w.str("block_size")
		w.uint(uint64(e.blockSize))
		w.str("lora_id")
		w.null()
		w.str("medium")
		w.str(mediumGPU)
		w.str("lora_name")
		w.null()
		w.str("extra_keys")
		w.extraKeys(len(e.hashes))
		w.str("group_idx")
		w.uint(0)
		w.str("kv_cache_spec_kind")
		w.str(specFullAttention)
	case eventBlockRemoved:
		w.mapLen(4)
		w.str("type")
		w.str(string(e.kind))
		w.str("block_hashes")
		w.hashes(e.hashes)
		w.str("medium")
		w.str(mediumGPU)
		w.str("group_idx")
		w.uint(0)
	case eventAllBlocksCleared:
		w.mapLen(1)
		w.str("type")
		w.str(string(e.kind))
	}
}

// eventArray writes e as a tagged array, msgspec's array_like encoding:
// the tag, then the fields in declaration order, trailing defaults omitted.
func (w *msgWriter) eventArray(e kvEvent) {
	switch e.kind {
	case eventBlockStored:
		w.arrayLen(11)
		w.str(string(e.kind))
		w.hashes(e.hashes)
		w.parent(e)
		w.tokens(e.tokenIDs)
		w.uint(uint64(e.blockSize))
		w.null() // lora_id
		w.str(mediumGPU)
		w.null() // lora_name
		w.extraKeys(len(e.hashes))
		w.uint(0) // group_idx
		w.str(specFullAttention)
	case eventBlockRemoved:
		w.arrayLen(4)
		w.str(string(e.kind))
		w.hashes(e.hashes)
		w.str(mediumGPU)
		w.uint(0) // group_idx
	case eventAllBlocksCleared:
		w.arrayLen(1)
		w.str(string(e.kind))
	}
}

// KVEventsEndpoint is the tcp:// endpoint the engine publishes its KV
// events on (Config.KVEvents; with Connect, the one it dials), or "" when
// it publishes none.
func (s *Server) KVEventsEndpoint() string {
	p := s.kvPublisher()
	if p == nil {
		return ""
	}
	return p.endpoint
}

// KVEventsReplayEndpoint is the tcp:// endpoint of the replay socket, or ""
// when there is none.
func (s *Server) KVEventsReplayEndpoint() string {
	p := s.kvPublisher()
	if p == nil {
		return ""
	}
	return p.replayEP
}

// kvPublisher is the current publisher (RestartKVEvents replaces it), or
// nil.
func (s *Server) kvPublisher() *kvPublisher {
	s.load.mu.Lock()
	defer s.load.mu.Unlock()
	return s.kvpub
}

// RestartKVEvents replaces the KV events publisher with a new one, as a
// restarted vLLM engine has: on the same endpoints (the ports first bound,
// or the endpoint dialled), numbering batches from 0 again, with an empty
// replay buffer. Subscribers see the sequence go back. The prefix cache is
// kept; ResetPrefixCache empties it.
func (s *Server) RestartKVEvents() error {
	m := s.load
	m.mu.Lock()
	defer m.mu.Unlock()
	old := s.kvpub
	if old == nil {
		return errors.New("enginesim: RestartKVEvents: the engine publishes no KV events")
	}
	cfg := old.cfg
	cfg.Endpoint, cfg.ReplayEndpoint = old.listenEP, old.listenReplay
	old.close() // publish runs under m.mu: nothing is sent meanwhile
	p, err := startKVPublisher(cfg)
	if err != nil {
		s.kvpub, m.kvpub = nil, nil
		return fmt.Errorf("enginesim: RestartKVEvents: %w", err)
	}
	s.kvpub, m.kvpub = p, p
	return nil
}

// ResetPrefixCache empties the prefix cache as vLLM's POST
// /reset_prefix_cache does (BlockPool.reset_prefix_cache): it fails while
// requests hold blocks, and publishes AllBlocksCleared when done. Without
// Capacity there is no cache and it succeeds.
func (s *Server) ResetPrefixCache() bool {
	m := s.load
	if m.capa == nil {
		return true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cache.held() > 0 {
		return false
	}
	m.cache.reset()
	m.flushKV()
	return true
}
