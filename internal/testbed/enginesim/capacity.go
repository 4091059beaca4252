package enginesim

import (
	"container/list"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"net/http"
	"slices"
	"sync"
	"time"
)

// Capacity makes an engine a queueing model of a real one (see capacity.go).
//
// The model, per engine:
//
//   - Prefix cache. The prompt (in the simulator tokenizer's tokens) is cut
//     into full blocks of BlockTokens tokens, each named by a chained hash
//     (a block's hash covers its predecessor's), as vLLM's prefix caching
//     does. The blocks live in an LRU of KVBlocks entries. The longest
//     cached run of leading blocks is the cached prefix, at most all but the
//     last prompt token (vLLM always computes the last token to get logits).
//   - Prefill. One FIFO server (prefill is compute-bound): a prompt takes
//     PrefillOverhead + uncached tokens / PrefillTokensPerSec (beside
//     sequences decoding, see One GPU); later ones wait. Prefill legs and the
//     prompt phase of plain requests (on any role: a vLLM kv_consumer
//     without kv_transfer_params prefills locally) share it. Its blocks
//     enter the cache when it is done. With PrefillSlots n > 1 the server
//     computes up to n prompts at once, each in that time as if alone, the
//     rest waiting FIFO: the model of simulators that run a fixed number of
//     requests side by side at a fixed cost per token (llm-d-inference-sim's
//     max-num-seqs), not of a GPU, whose prompts computed together share it.
//   - KV pull. A decode that takes KV from a prefill first pulls the prompt
//     blocks its own cache lacks (vLLM's decode computes local prefix hits
//     first), KVPullPerBlock each; meanwhile it counts as waiting, like
//     vLLM's WAITING_FOR_REMOTE_KVS requests.
//   - Decode. A batch of at most MaxRunning sequences; a sequence is admitted
//     (FIFO) when a place is free and the KV it will need fits, as vLLM's
//     scheduler leaves a request waiting when it cannot allocate its blocks.
//     Each output token takes DecodeStep + DecodeStepPerSeq × (running − 1),
//     with the batch size at that step, plus its share of a prompt computed
//     beside it (below).
//   - One GPU (MaxBatchedTokens > 0). vLLM V1 chunks prefills: a step
//     computes at most MaxBatchedTokens tokens, one for each running
//     decode first, then a chunk of the prompt being prefilled. So while
//     the engine computes a prompt and n sequences decode there, the prompt
//     advances in chunks of min(MaxBatchedTokens − n, uncached tokens left)
//     (at least 1), each taking its compute (chunk / PrefillTokensPerSec)
//     plus the decode step at the batch of the moment, and each decode step
//     is longer by the compute of the chunk it carries. Without sequences
//     decoding the prompt takes PrefillOverhead + uncached /
//     PrefillTokensPerSec as above, in chunks of MaxBatchedTokens so that a
//     sequence joining meanwhile shares the chunks after it joined. With
//     MaxBatchedTokens 0 prefill and decode do not slow each other down, as
//     if they ran on two GPUs. Usage's PrefillSharedDelay and
//     DecodeSharedDelay count what the sharing cost.
//
// Approximations: a sequence reserves the blocks of its whole output on
// admission, so nothing is ever preempted (vLLM allocates as it goes and
// preempts when it runs out); blocks held are pinned, and when pinned blocks
// alone exceed KVBlocks a prefill still runs (usage is reported as 1); a
// finished prefill's KV that waits for its decode is not pinned (it is the
// most recently used, so it is evicted last). Sharing the GPU is fluid
// (share.go): sequences step on their own clocks rather than in one batch
// step, so a step pays in advance the compute of the chunk in progress
// that it will overlap (a steady step exactly one chunk's) and at its next
// step what it overlapped beyond (the next chunk's start, a timer waking
// late), so that a sequence decoding throughout a prompt pays all of its
// compute once; a chunk given up midway (the client went away) still costs
// its whole compute, as the step carrying it runs on; a prompt's last,
// partial chunk rides the same share of a decode step as it has of the
// budget (a scaled engine's step stands for tokenScale real ones), though
// a prompt's first chunk rides at least PrefillOverhead, so that a prompt
// never computes faster beside a batch than alone; a chunk's batch size is
// the one when it begins; when n reaches the budget a prompt still
// advances a token a step (vLLM would starve it until decodes finish); the
// output tokens a prefill leg generates beyond its first (a router that
// keeps the client's limit) are not in the batch and share nothing.
type Capacity struct {
	MaxRunning          int           // vLLM --max-num-seqs: sequences decoding at once; more wait
	BlockTokens         int           // vLLM --block-size (16): tokens per KV block, the prefix cache's unit
	KVBlocks            int           // KV cache capacity in blocks (running sequences' blocks + the prefix cache, LRU-evicted)
	PrefillTokensPerSec float64       // uncached prompt tokens computed a second
	PrefillOverhead     time.Duration // fixed cost of each prefill
	DecodeStep          time.Duration // time per output token with one running sequence
	DecodeStepPerSeq    time.Duration // added to each decode step per further running sequence
	KVPullPerBlock      time.Duration // KV transfer time per block a decode pulls
	// PrefillSlots is how many prompts the prefill server computes at
	// once, each as fast as alone (0 or 1: one at a time, as one GPU
	// does; see Prefill above). More than one needs MaxBatchedTokens 0:
	// the step budget models one prompt computed beside the batch.
	PrefillSlots int
	// MaxBatchedTokens is vLLM's --max-num-batched-tokens: the tokens one
	// step computes, a decode's one each and chunks of a prompt in the rest,
	// so that a prompt computed while sequences decode slows them down and
	// is slowed down by them. 0 means no budget: prefill and decode do not
	// share the GPU (the model before it existed).
	MaxBatchedTokens int
	// MaxLoRA is vLLM's --max-loras: the adapters (Config.LoRAModules) on
	// the GPU, and at most that many distinct ones in the running batch
	// (lora.go); 0 models no adapters. LoRALoad is the engine's time to
	// load an adapter that is not on the GPU, spent before the request's
	// prompt computes (a decode's before its first token).
	MaxLoRA  int
	LoRALoad time.Duration
}

// Figures of ReferenceCapacity, Llama-3-8B in 16-bit on one H100 SXM 80 GB.
const (
	// refMaxRunning is vLLM's default max_num_seqs for the OpenAI server on
	// a GPU of at least 70 GiB other than an A100 (EngineArgs
	// get_batch_defaults in vllm/engine/arg_utils.py: 1024; 256 elsewhere).
	refMaxRunning = 1024
	// refMaxBatchedTokens is vLLM's default max_num_batched_tokens for the
	// OpenAI server on the same GPUs (UsageContext.OPENAI_API_SERVER: 8192;
	// 2048 elsewhere, 16384 for the LLM class), from the same defaults
	// (get_batch_defaults, EngineArgs._set_default_args in earlier
	// versions, which also turns chunked prefill on for generative models:
	// "V1 uses chunked prefills ... by default"). vLLM V1's Scheduler.schedule
	// (vllm/v1/core/sched/scheduler.py) spends the step's token_budget on
	// "the RUNNING requests" first, a decode taking one token, then
	// "the WAITING requests", a prompt taking what is left as its chunk.
	refMaxBatchedTokens = 8192
	// refBlockTokens is vLLM's default --block-size on CUDA.
	refBlockTokens = 16
	// refKVBlocks: KV per token is 2 (K and V) × 32 layers × 8 KV heads ×
	// 128 head dim × 2 bytes = 128 KiB, so a 16-token block is 2 MiB. vLLM
	// takes gpu_memory_utilization 0.9 of 80 GiB = 72 GiB, less ~15 GiB of
	// weights (8.03 B parameters × 2 bytes) and a few GiB of activations and
	// CUDA graphs: ~53 GiB of KV, 27,000 blocks or ~430k tokens.
	refKVBlocks = 27000
	// refPrefillTokensPerSec: a forward pass costs ~2 × 8 B = 16 GFLOP per
	// token; at ~25–30% of the H100's 989 dense bf16 TFLOP/s, plus attention
	// on long prompts, that is 10–20k tokens/s (scheduling.md's range).
	refPrefillTokensPerSec = 15000
	// refPrefillOverhead: a pass reads all 16 GB of weights at least once;
	// at 3.35 TB/s of HBM3 that is ~5 ms, plus scheduling.
	refPrefillOverhead = 6 * time.Millisecond
	// refDecodeStep: a decode step is memory-bound, the same ~5 ms of weight
	// reads plus kernel launches and sampling: ~8 ms for one sequence.
	refDecodeStep = 8 * time.Millisecond
	// refDecodeStepPerSeq: each further sequence adds its KV reads and its
	// share of the matmuls; 120 µs gives ~16 ms at 64 sequences and ~23 ms
	// at 128, the 10–30 ms per token of moderate batches.
	refDecodeStepPerSeq = 120 * time.Microsecond
	// refKVPullPerBlock: a 2 MiB block over one 400 Gb/s RDMA NIC
	// (ConnectX-7, ~45 GB/s achieved by NIXL/UCX) takes ~47 µs.
	refKVPullPerBlock = 50 * time.Microsecond
)

// ReferenceCapacity is an 8B model on one H100 (sources in the doc comment), with token counts divided by tokenScale and times multiplied by timeScale (replays scale both to fit a small machine).
//
// The sources are those of the ref* constants: vLLM's defaults (block size
// 16, max_num_seqs 1024 on an H100), Llama-3-8B's shape (32 layers, 8 KV
// heads, head dim 128: 128 KiB of KV per token in fp16/bf16), the H100 SXM's
// 80 GB, 3.35 TB/s and 989 TFLOP/s, and a 400 Gb/s RDMA link for pulls.
//
// Scaling keeps one invariant: a request whose prompt and output token
// counts were divided by tokenScale takes timeScale times as long as the
// real one would. So the block size becomes 16/tokenScale tokens (at least
// 1), the KV capacity holds 1/tokenScale of the real tokens, the prefill
// rate and per-token decode and pull times are scaled accordingly, and
// fixed costs are multiplied by timeScale. MaxRunning counts sequences and
// is not scaled. Nor is MaxBatchedTokens, though it counts tokens: it is
// tokens per step, and a scaled decode step stands for tokenScale real
// ones (its output is divided by tokenScale), so a scaled step computes
// tokenScale × 8192 real tokens, 8192 scaled ones, the decodes' share
// included (n sequences decode tokenScale × n real tokens in it, n scaled
// ones). Dividing it too would cut a scaled prompt into tokenScale times
// as many chunks, each riding a whole scaled step. Scales that are not
// positive count as 1.
func ReferenceCapacity(tokenScale, timeScale float64) Capacity {
	if !(tokenScale > 0) {
		tokenScale = 1
	}
	if !(timeScale > 0) {
		timeScale = 1
	}
	block := max(1, int(math.Round(refBlockTokens/tokenScale)))
	// Real tokens a scaled block stands for: the unit of per-block costs.
	blockReal := float64(block) * tokenScale
	scaled := func(d time.Duration, factor float64) time.Duration {
		return time.Duration(math.Round(float64(d) * factor))
	}
	return Capacity{
		MaxRunning:          refMaxRunning,
		BlockTokens:         block,
		KVBlocks:            max(1, int(math.Round(refKVBlocks*refBlockTokens/blockReal))),
		PrefillTokensPerSec: refPrefillTokensPerSec / tokenScale / timeScale,
		PrefillOverhead:     scaled(refPrefillOverhead, timeScale),
		DecodeStep:          scaled(refDecodeStep, tokenScale*timeScale),
		DecodeStepPerSeq:    scaled(refDecodeStepPerSeq, tokenScale*timeScale),
		KVPullPerBlock:      scaled(refKVPullPerBlock, blockReal/refBlockTokens*timeScale),
		MaxBatchedTokens:    refMaxBatchedTokens,
	}
}

func (c *Capacity) validate() error {
	switch {
	case c.MaxRunning < 1:
		return fmt.Errorf("enginesim: Capacity.MaxRunning must be at least 1, got %d", c.MaxRunning)
	case c.BlockTokens < 1:
		return fmt.Errorf("enginesim: Capacity.BlockTokens must be at least 1, got %d", c.BlockTokens)
	case c.KVBlocks < 1:
		return fmt.Errorf("enginesim: Capacity.KVBlocks must be at least 1, got %d", c.KVBlocks)
	case c.MaxLoRA < 0:
		return fmt.Errorf("enginesim: Capacity.MaxLoRA must not be negative (0: no adapters), got %d", c.MaxLoRA)
	case c.MaxBatchedTokens < 0:
		return fmt.Errorf("enginesim: Capacity.MaxBatchedTokens must not be negative (0: no step budget), got %d", c.MaxBatchedTokens)
	case c.PrefillSlots < 0:
		return fmt.Errorf("enginesim: Capacity.PrefillSlots must not be negative (0: one), got %d", c.PrefillSlots)
	case c.PrefillSlots > 1 && c.MaxBatchedTokens > 0:
		return fmt.Errorf("enginesim: Capacity.PrefillSlots %d needs MaxBatchedTokens 0 (the step budget models one prompt computed at a time), got %d",
			c.PrefillSlots, c.MaxBatchedTokens)
	case !(c.PrefillTokensPerSec > 0) || math.IsInf(c.PrefillTokensPerSec, 0):
		return fmt.Errorf("enginesim: Capacity.PrefillTokensPerSec must be positive and finite, got %v", c.PrefillTokensPerSec)
	}
	for name, d := range map[string]time.Duration{
		"PrefillOverhead": c.PrefillOverhead, "DecodeStep": c.DecodeStep,
		"DecodeStepPerSeq": c.DecodeStepPerSeq, "KVPullPerBlock": c.KVPullPerBlock,
		"LoRALoad": c.LoRALoad,
	} {
		if d < 0 {
			return fmt.Errorf("enginesim: Capacity.%s must not be negative, got %v", name, d)
		}
	}
	return nil
}

// Usage is what an engine's capacity model has done so far, for a replay's
// report of how load spread (requests served by kind are in Tally).
type Usage struct {
	// PrefillBusy is the total time the prefill server was busy (without
	// Capacity: the time some prefill was in progress; with
	// Capacity.PrefillSlots n > 1, each slot's busy time over n, so that
	// two slots each busy half the time count half). Divided by the
	// replay's duration it is the engine's prefill busy share.
	PrefillBusy time.Duration
	// DecodeBusy is the total time at least one sequence was generating.
	DecodeBusy time.Duration
	// Prefills counts prompts computed (prefill legs and the prompt phases
	// of plain requests) and PrefillTokens their tokens not served from the
	// prefix cache.
	Prefills, PrefillTokens int64
	// PrefixQueryTokens and PrefixHitTokens are the prompt tokens looked up
	// in the prefix cache and those found (vllm:prefix_cache_queries and
	// vllm:prefix_cache_hits). Without Capacity there is no cache: every
	// prefilled token is a query, none a hit.
	PrefixQueryTokens, PrefixHitTokens int64
	// PulledBlocks counts KV blocks decodes transferred from prefills
	// (Capacity only).
	PulledBlocks int64
	// DecodeTokens counts decode steps, one per output token generated
	// after the first token of a plain request (Capacity only).
	DecodeTokens int64
	// What sharing the GPU cost (Capacity.MaxBatchedTokens > 0).
	// PrefillSharedDelay is the time prompts took beyond PrefillOverhead +
	// uncached / PrefillTokensPerSec because they rode the steps of
	// sequences decoding on the engine. DecodeSharedSteps counts decode
	// steps made longer by the chunks of a prompt computed beside them and
	// DecodeSharedDelay adds up how much longer, sequence by sequence (so
	// a prompt computed beside n sequences adds about n times its compute;
	// DecodeSharedDelay / DecodeTokens is the mean rise of the time per
	// output token).
	PrefillSharedDelay, DecodeSharedDelay time.Duration
	DecodeSharedSteps                     int64
	// Evictions counts prefix-cache blocks evicted to make room.
	Evictions int64
	// Running and Waiting are the requests running (prefilling or
	// decoding) and waiting (for the prefill server, a decode place, or
	// their KV pull, and NIXL decodes in the queue of DecodeQueueLatency)
	// now; PeakRunning and PeakWaiting their maxima so far (PeakWaiting
	// without the DecodeQueueLatency queue).
	Running, Waiting, PeakRunning, PeakWaiting int
	// KVUsage is the fraction of KV blocks in use now (0–1).
	KVUsage float64
}

// Usage returns what the engine has done and holds now.
func (s *Server) Usage() Usage {
	queued := s.queuedDecodes()
	m := s.load
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	u := m.usage
	u.PrefillBusy = m.prefillBusy.total(now)
	if n := m.slots(); n > 1 {
		u.PrefillBusy = m.prefillSlotTime.total(now) / time.Duration(n)
	}
	u.DecodeBusy = m.decodeBusy.total(now)
	u.Running, u.Waiting = m.running(), m.waitingLocked()+queued
	u.Evictions = m.cache.evictions
	u.KVUsage = m.kvUsage()
	return u
}

// queuedDecodes is the number of NIXL decodes in the waiting queue of
// Config.DecodeQueueLatency, which is vLLM's waiting queue too.
func (s *Server) queuedDecodes() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting
}

// engineLoad is an engine's load: its queues, batch and prefix cache under
// Capacity, and without it just what is in flight.
type engineLoad struct {
	capa *Capacity // nil: the fixed latencies of Config

	mu         sync.Mutex
	cache      prefixCache
	prefillQ   []*ticket
	decodeQ    []*ticket
	prefilling int // prompts being computed (at most PrefillSlots under Capacity)
	decoding   int // sequences generating (the decode batch under Capacity)
	pulling    int // decodes transferring their KV
	// prefillBusy and decodeBusy measure the time prefilling, resp.
	// decoding, was not zero.
	prefillBusy, decodeBusy busyClock
	// prefillSlotTime adds up the time each prefill slot was busy
	// (Capacity.PrefillSlots).
	prefillSlotTime slotClock
	usage           Usage // the counters; the rest is filled in by Usage
	// hitBlocks and queryBlocks count prefix-cache lookups in blocks, for
	// TensorRT-LLM's reused/missed block counters.
	hitBlocks, queryBlocks int64
	kvpub                  *kvPublisher // Config.KVEvents, nil without
	truth                  truth        // what the forecasts read (oracle.go)
	// run is the prompt being computed, chunk by chunk, and shared the
	// prompt compute done beside the decode batch so far, in chunks ended
	// (share.go).
	run    promptRun
	shared time.Duration
	// lora is the engine's adapters (Capacity.MaxLoRA).
	lora loraSlots
}

func newEngineLoad(c *Capacity, pub *kvPublisher) *engineLoad {
	m := &engineLoad{}
	if c != nil {
		cp := *c // the caller's Config may change; the model must not
		m.capa = &cp
		m.cache = newPrefixCache(cp.KVBlocks)
		m.lora = newLoRASlots(&cp)
		if pub != nil {
			m.kvpub = pub
			m.cache.events = &kvEventLog{blockTokens: cp.BlockTokens, tokenScale: pub.cfg.TokenScale}
		}
	}
	return m
}

// ticket is a place in a queue; ready is closed when it is granted.
type ticket struct {
	ready   chan struct{}
	granted bool
	// what a decode pins on admission: its prompt's full blocks and the
	// rest of the blocks its sequence will fill
	hashes  []uint64
	ids     []uint32
	private int
	// a prefill's prompt: the forecasts' view of the queue (oracle.go)
	prompt *promptBlocks
	// a granted prefill's compute, once its cache lookup is done: started,
	// and with several prefill slots when it ends (with one, m.run's)
	started bool
	end     time.Time
	// a decode's starting seat.paid: the prompt compute shared with the
	// batch before it was admitted (share.go)
	paid time.Duration
	// adapter is the request's LoRA adapter, "" for the base model, and
	// loadLoRA the time its load takes once granted (lora.go).
	adapter  string
	loadLoRA time.Duration
}

// busyClock accumulates the time a count was above zero.
type busyClock struct {
	since time.Time // zero when idle
	sum   time.Duration
}

func (b *busyClock) update(count int, now time.Time) {
	switch {
	case count > 0 && b.since.IsZero():
		b.since = now
	case count == 0 && !b.since.IsZero():
		b.sum += now.Sub(b.since)
		b.since = time.Time{}
	}
}

func (b *busyClock) total(now time.Time) time.Duration {
	if b.since.IsZero() {
		return b.sum
	}
	return b.sum + now.Sub(b.since)
}

// slotClock accumulates a count over time: busy slots × the time they
// were.
type slotClock struct {
	count int
	at    time.Time
	sum   time.Duration
}

func (c *slotClock) update(count int, now time.Time) {
	c.sum = c.total(now)
	c.count, c.at = count, now
}

func (c *slotClock) total(now time.Time) time.Duration {
	return c.sum + time.Duration(c.count)*now.Sub(c.at)
}

// slots is the prompts the prefill server computes at once.
func (m *engineLoad) slots() int {
	if m.capa == nil {
		return 1
	}
	return max(m.capa.PrefillSlots, 1)
}

func (m *engineLoad) running() int { return m.prefilling + m.decoding }

func (m *engineLoad) waitingLocked() int { return len(m.prefillQ) + len(m.decodeQ) + m.pulling }

// changed updates the busy clocks and peaks after a change of the counts.
// m.mu is held.
func (m *engineLoad) changed() {
	now := time.Now()
	m.prefillBusy.update(m.prefilling, now)
	m.prefillSlotTime.update(m.prefilling, now)
	m.decodeBusy.update(m.decoding, now)
	m.usage.PeakRunning = max(m.usage.PeakRunning, m.running())
	m.usage.PeakWaiting = max(m.usage.PeakWaiting, m.waitingLocked())
}

// kvUsage is vLLM's kv_cache_usage_perc: the share of blocks requests
// hold. Cached blocks no request holds count as free, as in vLLM's block
// pool (they are reused or evicted on demand).
func (m *engineLoad) kvUsage() float64 {
	if m.capa == nil {
		return 0
	}
	return min(1, float64(m.cache.held())/float64(m.cache.capacity))
}

// promptBlocks is a prompt as the prefix cache sees it.
type promptBlocks struct {
	tokens int
	hashes []uint64 // chained hashes of the full blocks
	ids    []uint32 // the prompt's token ids (block i is ids[i×n:(i+1)×n])
	blocks int      // blocks the prompt fills, the last one possibly partly
}

// blocksOf cuts a prompt into blocks of n tokens. A block's hash is 64-bit
// FNV-1a over the previous block's hash and the block's token ids: fixed, so
// that engines (and runs) agree, and chained, so that equal hashes mean
// equal prefixes.
func blocksOf(prompt string, n int) promptBlocks {
	const offset64, prime64 = 14695981039346656037, 1099511628211
	ids := tokenize(prompt)
	p := promptBlocks{tokens: promptTokens(prompt), ids: ids}
	p.blocks = (p.tokens + n - 1) / n
	var prev uint64
	var word [8]byte
	for i := 0; i+n <= len(ids); i += n {
		h := uint64(offset64)
		mix := func(b []byte) {
			for _, c := range b {
				h = (h ^ uint64(c)) * prime64
			}
		}
		binary.BigEndian.PutUint64(word[:], prev)
		mix(word[:])
		for _, id := range ids[i : i+n] {
			binary.BigEndian.PutUint32(word[:4], id)
			mix(word[:4])
		}
		prev = h
		p.hashes = append(p.hashes, prev)
	}
	return p
}

// lookup is the number of leading blocks of p in the cache that a request
// may reuse, counted as a prefix-cache query. m.mu is held.
func (m *engineLoad) lookup(p promptBlocks) int {
	bt := m.capa.BlockTokens
	// vLLM computes at least the last prompt token, for its logits.
	hit := min(m.cache.match(p.hashes), (p.tokens-1)/bt)
	m.usage.PrefixQueryTokens += int64(p.tokens)
	m.usage.PrefixHitTokens += int64(hit * bt)
	m.queryBlocks += int64(p.blocks)
	m.hitBlocks += int64(hit)
	return hit
}

// dispatch grants queued tickets while the prefill server's slots and the
// decode batch have room, in FIFO order (a head that does not fit blocks
// those behind it, as in vLLM's FCFS scheduler). m.mu is held.
func (m *engineLoad) dispatch() {
	for m.prefilling < m.slots() {
		i := m.admissible(m.prefillQ)
		if i < 0 {
			break
		}
		t := m.prefillQ[i]
		m.prefillQ = slices.Delete(m.prefillQ, i, i+1)
		m.prefilling++
		m.truth.running = append(m.truth.running, t)
		m.grant(t)
	}
	for {
		i := m.admissible(m.decodeQ)
		if i < 0 {
			break
		}
		t := m.decodeQ[i]
		if m.decoding >= m.capa.MaxRunning || (m.decoding > 0 && !m.cache.fits(t.hashes, t.private)) {
			break
		}
		m.decodeQ = slices.Delete(m.decodeQ, i, i+1)
		m.decoding++
		m.cache.pin(t.hashes, t.ids, t.private)
		t.paid = m.sharedAt(time.Now())
		m.grant(t)
	}
	m.flushKV()
	m.changed()
}

// admissible is the first ticket of q the batch's adapters let in (vLLM
// skips a waiting request whose adapter would exceed max_loras and goes
// on with those behind it), -1 when none does.
func (m *engineLoad) admissible(q []*ticket) int {
	for i, t := range q {
		if m.lora.admits(t.adapter) {
			return i
		}
	}
	return -1
}

// grant hands t its place, its adapter now running (loaded if it must be).
func (m *engineLoad) grant(t *ticket) {
	t.loadLoRA = m.lora.start(t.adapter)
	t.granted = true
	close(t.ready)
}

// await waits for t, queued in q, to be granted. If ctx ends first, t leaves
// the queue, or gives its grant back with ungrant, so that a client that
// went away holds nothing. The error is ctx's.
func (m *engineLoad) await(ctx context.Context, t *ticket, q *[]*ticket, ungrant func()) error {
	select {
	case <-t.ready:
		return nil
	case <-ctx.Done():
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if t.granted {
		ungrant()
		m.lora.stop(t.adapter)
	} else {
		*q = slices.DeleteFunc(*q, func(o *ticket) bool { return o == t })
		m.lora.unqueue(t.adapter)
	}
	m.dispatch()
	return ctx.Err()
}

// computePrompt is the prompt phase of a request: a prefill leg, or the
// prefill of a plain request. The error is ctx's.
func (s *Server) computePrompt(ctx context.Context, req *inferenceRequest) error {
	m := s.load
	if m.capa == nil {
		m.mu.Lock()
		m.prefilling++
		m.usage.Prefills++
		m.usage.PrefillTokens += int64(promptTokens(req.prompt))
		m.usage.PrefixQueryTokens += int64(promptTokens(req.prompt))
		m.changed()
		m.mu.Unlock()
		defer func() {
			m.mu.Lock()
			m.prefilling--
			m.changed()
			m.mu.Unlock()
		}()
		return sleep(ctx, s.prefillTime(req))
	}
	hit, err := m.prefill(ctx, blocksOf(req.prompt, m.capa.BlockTokens), s.adapterOf(req))
	req.cachedTokens = hit
	return err
}

// prefill computes p, a prompt of adapter ("": the base model's), on the
// FIFO prefill server, and returns how many of its tokens it found in the
// prefix cache (vLLM's num_cached_tokens).
func (m *engineLoad) prefill(ctx context.Context, p promptBlocks, adapter string) (int, error) {
	t := &ticket{ready: make(chan struct{}), prompt: &p, adapter: adapter}
	m.mu.Lock()
	m.prefillQ = append(m.prefillQ, t)
	m.lora.queue(adapter)
	m.truth.queued()
	m.dispatch()
	m.mu.Unlock()
	if err := m.await(ctx, t, &m.prefillQ, func() { m.prefilling--; m.truth.done(t) }); err != nil {
		return 0, err
	}
	// Loading the adapter holds the prefill server, as it holds vLLM's
	// step.
	if err := sleep(ctx, t.loadLoRA); err != nil {
		m.mu.Lock()
		m.prefilling--
		m.truth.done(t)
		m.lora.stop(adapter)
		m.dispatch()
		m.mu.Unlock()
		return 0, err
	}

	// The cache is looked up when the prompt is taken, not when it arrived:
	// what came in meanwhile counts, as in vLLM's scheduler.
	m.mu.Lock()
	hit := m.lookup(p)
	held := p.hashes[:hit]
	computing := p.blocks - hit
	m.cache.pin(held, p.ids, computing)
	m.flushKV()
	uncached := p.tokens - hit*m.capa.BlockTokens
	m.usage.Prefills++
	m.usage.PrefillTokens += int64(uncached)
	// One slot computes the prompt as m.run, chunk by chunk beside the
	// decode batch (share.go); several (no step budget) each in one go.
	shared := m.slots() == 1
	var end time.Time
	if shared {
		m.startRun(uncached, time.Now())
		end = m.run.end
	} else {
		end = time.Now().Add(m.prefillTime(uncached, 0))
		t.end = end
	}
	t.started = true
	m.mu.Unlock()

	// The prompt computes chunk by chunk, each ending at a time fixed when
	// it begins (the next begins there, however late this wakes).
	var err error
	for {
		if err = sleep(ctx, time.Until(end)); err != nil || !shared {
			break
		}
		m.mu.Lock()
		more := m.nextChunk()
		end = m.run.end
		m.mu.Unlock()
		if !more {
			break
		}
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	if shared {
		m.endRun()
	}
	m.cache.unpin(held, computing)
	if err == nil {
		m.cache.insert(p.hashes, p.ids)
	}
	m.prefilling--
	m.truth.done(t)
	m.lora.stop(adapter)
	m.dispatch()
	return hit * m.capa.BlockTokens, err
}

// transferKV is a decode's transfer of the prompt blocks its own prefix cache
// lacks. The error is ctx's.
func (s *Server) transferKV(ctx context.Context, req *inferenceRequest) error {
	m := s.load
	if m.capa == nil {
		return nil
	}
	p := blocksOf(req.prompt, m.capa.BlockTokens)
	m.mu.Lock()
	n := p.blocks - m.lookup(p)
	m.usage.PulledBlocks += int64(n)
	m.pulling++
	m.changed()
	m.mu.Unlock()
	err := sleep(ctx, time.Duration(n)*m.capa.KVPullPerBlock)
	m.mu.Lock()
	m.pulling--
	m.changed()
	m.mu.Unlock()
	return err
}

// admit waits for a place in the decode batch for req's sequence and
// returns it (its leave gives it back). Without Capacity it only counts the
// sequence. The error is ctx's.
func (m *engineLoad) admit(ctx context.Context, req *inferenceRequest, adapter string) (*seat, error) {
	if m.capa == nil {
		m.mu.Lock()
		m.decoding++
		m.changed()
		m.mu.Unlock()
		return &seat{m: m, leave: func() {
			m.mu.Lock()
			m.decoding--
			m.changed()
			m.mu.Unlock()
		}}, nil
	}
	bt := m.capa.BlockTokens
	p := blocksOf(req.prompt, bt)
	total := (p.tokens + req.maxTokens + bt - 1) / bt
	t := &ticket{ready: make(chan struct{}), hashes: p.hashes, ids: p.ids, private: total - len(p.hashes), adapter: adapter}
	release := func() {
		m.decoding--
		m.cache.unpin(t.hashes, t.private)
		m.lora.stop(adapter)
	}
	m.mu.Lock()
	m.decodeQ = append(m.decodeQ, t)
	m.lora.queue(adapter)
	m.dispatch()
	m.mu.Unlock()
	if err := m.await(ctx, t, &m.decodeQ, func() { m.decoding--; m.cache.unpin(t.hashes, t.private) }); err != nil {
		return nil, err
	}
	// A decode engine needs the adapter too: loading it delays the
	// sequence's first step.
	if err := sleep(ctx, t.loadLoRA); err != nil {
		m.mu.Lock()
		release()
		m.dispatch()
		m.mu.Unlock()
		return nil, err
	}
	return &seat{m: m, paid: t.paid, leave: func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		release()
		m.dispatch()
	}}, nil
}

// step is the time of the next decode step of a prefill leg's output,
// which is not in the batch (see seat.step for a sequence's), at the batch
// size of now.
func (m *engineLoad) step() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.usage.DecodeTokens++
	return m.batchStep(m.decoding)
}

// batchStep is a decode step with n sequences decoding, at least one.
func (m *engineLoad) batchStep(n int) time.Duration {
	return m.capa.DecodeStep + time.Duration(max(n-1, 0))*m.capa.DecodeStepPerSeq
}

// generateBatched is generate under Capacity: the sequence waits for a
// place in the decode batch, then each token takes a decode step of the
// batch as it is at that step (seat.step: with the chunks of a prompt
// computed beside it). The first token of a request this engine prefilled
// came with its prefill; a decode that pulled KV computes it.
func (s *Server) generateBatched(x *exchange) {
	toks := outputTokens(x.rec.Fingerprint, x.req.maxTokens)
	work := x.workContext()
	seat, err := s.load.admit(work, x.req, s.adapterOf(x.req))
	if err != nil {
		s.interrupted(x, work, nil)
		return
	}
	defer seat.leave()
	prefilled := x.rec.KV != KVPulled
	delay := func(i int) time.Duration {
		if i == 0 && prefilled {
			return 0
		}
		return seat.step()
	}
	if x.req.stream {
		s.stream(x, toks, delay, "length")
		return
	}
	ctx := x.runContext()
	for i := range toks {
		if err := sleep(ctx, delay(i)); err != nil {
			s.interrupted(x, ctx, toks[:i])
			return
		}
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, s.answer(x, toks, "length", nil))
}

// prefixCache is the KV blocks of an engine: an LRU of prompt blocks by
// chained hash, some pinned by the requests that hold them, and private
// blocks (partial and output blocks, which no other request can reuse).
// Only unpinned blocks are in the LRU list, so eviction is a pop.
type prefixCache struct {
	capacity  int
	blocks    map[uint64]*cachedBlock
	lru       *list.List // unpinned blocks, most recently used first
	private   int
	evictions int64
	// events, when the engine publishes KV events, collects the blocks
	// stored and evicted until the engine publishes them (flushKV).
	events *kvEventLog
}

type cachedBlock struct {
	hash uint64
	refs int
	elem *list.Element // nil while pinned
}

func newPrefixCache(capacity int) prefixCache {
	return prefixCache{capacity: capacity, blocks: make(map[uint64]*cachedBlock), lru: list.New()}
}

func (c *prefixCache) used() int { return len(c.blocks) + c.private }

// held is the blocks requests hold: used but the unpinned cached ones.
func (c *prefixCache) held() int { return c.used() - c.lru.Len() }

// match is the number of leading hashes cached.
func (c *prefixCache) match(hashes []uint64) int {
	for i, h := range hashes {
		if _, ok := c.blocks[h]; !ok {
			return i
		}
	}
	return len(hashes)
}

// fits reports whether hashes and private more blocks can be held without
// going over capacity, evicting unpinned blocks as needed.
func (c *prefixCache) fits(hashes []uint64, private int) bool {
	need, reused := private, 0
	for _, h := range hashes {
		switch b, ok := c.blocks[h]; {
		case !ok:
			need++
		case b.refs == 0:
			reused++ // pinned rather than evicted
		}
	}
	return need <= c.capacity-c.used()+c.lru.Len()-reused
}

// makeRoom evicts least recently used unpinned blocks until n more fit, or
// none is left to evict.
func (c *prefixCache) makeRoom(n int) {
	for c.used()+n > c.capacity && c.lru.Len() > 0 {
		b := c.lru.Remove(c.lru.Back()).(*cachedBlock)
		delete(c.blocks, b.hash)
		c.evictions++
		if c.events != nil {
			c.events.removed(b.hash)
		}
	}
}

// pin holds the blocks of hashes (adding those missing) and private more.
// Held blocks are never evicted; if they alone exceed capacity, the cache
// goes over it. ids are the token ids of the prompt whose leading blocks
// hashes are (for the events of blocks added).
func (c *prefixCache) pin(hashes []uint64, ids []uint32, private int) {
	for i, h := range hashes {
		b, ok := c.blocks[h]
		if !ok {
			c.makeRoom(1)
			b = &cachedBlock{hash: h}
			c.blocks[h] = b
			c.stored(hashes, ids, i)
		}
		if b.elem != nil {
			c.lru.Remove(b.elem)
			b.elem = nil
		}
		b.refs++
	}
	c.makeRoom(private)
	c.private += private
}

// unpin gives back what pin took. The blocks stay cached; like vLLM, which
// frees a request's blocks in reverse order, a prompt's tail is evicted
// before its head, since a head block is worth more (more prompts share it).
func (c *prefixCache) unpin(hashes []uint64, private int) {
	c.private -= private
	for _, h := range slices.Backward(hashes) {
		b, ok := c.blocks[h]
		if !ok {
			continue
		}
		if b.refs--; b.refs == 0 {
			b.elem = c.lru.PushFront(b)
		}
	}
}

// insert caches computed blocks, unpinned, as most recently used (the
// head last, as in unpin). When room runs out the rest is not cached: a
// block is of use only after its predecessors. ids are as for pin.
func (c *prefixCache) insert(hashes []uint64, ids []uint32) {
	n := 0
	for i, h := range hashes {
		// Each block leaves the LRU list until the loop below puts it back
		// in order, so that making room for its successors cannot evict it.
		if b, ok := c.blocks[h]; ok {
			if b.elem != nil {
				c.lru.Remove(b.elem)
				b.elem = nil
			}
		} else {
			c.makeRoom(1)
			if c.used() >= c.capacity {
				break
			}
			c.blocks[h] = &cachedBlock{hash: h}
			c.stored(hashes, ids, i)
		}
		n++
	}
	for _, h := range slices.Backward(hashes[:n]) {
		if b := c.blocks[h]; b.refs == 0 {
			b.elem = c.lru.PushFront(b)
		}
	}
}

// stored notes that block i of hashes entered the cache.
func (c *prefixCache) stored(hashes []uint64, ids []uint32, i int) {
	if c.events != nil {
		c.events.stored(hashes, ids, i)
	}
}

// reset forgets every cached block; held ones (there must be none) too.
func (c *prefixCache) reset() {
	clear(c.blocks)
	c.lru.Init()
	c.private = 0
	if c.events != nil {
		c.events.cleared()
	}
}

// flushKV publishes the cache's pending events as one batch, as vLLM's
// scheduler publishes the events of a step. m.mu is held.
func (m *engineLoad) flushKV() {
	if m.kvpub == nil {
		return
	}
	m.kvpub.publish(m.cache.events.take())
}
