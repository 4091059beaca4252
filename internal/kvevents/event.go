// Package kvevents reads the KV-cache events engines publish: vLLM's
// --kv-events-config ZMQ publisher (vllm/distributed/kv_events.py) and the
// engines that speak its wire (SGLang's). It decodes both encodings vLLM
// has shipped and keeps one subscription per engine publisher, dialled by
// pdx or dialling pdx, with sequence tracking, replay and restarts. What
// the events mean for placement is package kvcache's business.
package kvevents

// Kind is an event's class, the tag vLLM's msgspec writes.
type Kind uint8

const (
	// BlockStored: full blocks entered the cache.
	BlockStored Kind = iota + 1
	// BlockRemoved: blocks left the cache (evicted).
	BlockRemoved
	// AllBlocksCleared: the whole cache was reset.
	AllBlocksCleared
)

func (k Kind) String() string {
	switch k {
	case BlockStored:
		return "BlockStored"
	case BlockRemoved:
		return "BlockRemoved"
	case AllBlocksCleared:
		return "AllBlocksCleared"
	}
	return "unknown"
}

// Hash is an engine's block hash, an opaque key: two hashes are the same
// block when their Hash values are equal. vLLM sends an integer
// (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, its default: the hash's low 64
// bits, vllm/v1/core/kv_cache_utils.py maybe_convert_block_hash) or the
// hash's bytes (32 for sha256, 16 for xxhash); SGLang sends signed 64-bit
// integers.
//
// An integer, signed or not, is Lo as its 64-bit two's complement
// pattern, with Hi 0. Bytes are folded to 128 bits: Lo is their last 8
// bytes as a big-endian integer (what vLLM would have sent as the integer)
// and Hi is xxhash64 of all of them, never 0. So no bytes hash equals an
// integer one, and two byte strings share a Hash only when their last 8
// bytes agree and their xxhash64s collide (about 2^-64 for such a pair).
type Hash struct {
	Lo, Hi uint64
}

// Event is one KVCacheEvent, with the fields placement reads.
type Event struct {
	Kind Kind
	// Hashes are the blocks stored (in chain order) or removed.
	Hashes []Hash
	// Parent is the hash of the block before Hashes[0] (BlockStored);
	// HasParent is false for a chain that starts at the prompt's start
	// (vLLM's nil). llm-d's publishers (llm-d-inference-sim's default
	// positional layout) name that start's parent 0 instead, their
	// EmptyBlockHash: it is read as sent, HasParent with Parent zero, and
	// package kvcache tells the two apart.
	Parent    Hash
	HasParent bool
	// TokenIDs are the stored blocks' tokens, BlockSize per block.
	TokenIDs  []uint32
	BlockSize int
	// LoRAID is lora_id (0: none); LoRAName is lora_name ("" when absent).
	LoRAID   int64
	LoRAName string
	// Medium is the tier: "GPU" (or "" when not sent), "CPU", ...
	Medium string
	// ExtraKeys is the msgpack encoding of extra_keys (one entry per
	// block: multimodal hashes, LoRA name, cache salt) when some entry is
	// not nil, else nil: vLLM sends [null, ...] for blocks without any. A
	// block with extra keys is another block than one without.
	ExtraKeys []byte
	// GroupIdx is group_idx (0 when absent); SpecKind is
	// kv_cache_spec_kind ("" when absent: a model with one full-attention
	// group), SlidingWindow kv_cache_spec_sliding_window (0 when absent).
	GroupIdx      int
	SpecKind      string
	SlidingWindow int
}

// Batch is one published message: vLLM's KVEventBatch.
type Batch struct {
	// Seq is the message's sequence number (the second frame).
	Seq uint64
	// TS is the batch's timestamp (seconds since the epoch).
	TS float64
	// Events in order.
	Events []Event
	// DPRank is data_parallel_rank; HasDPRank is false when nil.
	DPRank    int
	HasDPRank bool
	// Skipped counts the events of types this package does not know,
	// left out of Events.
	Skipped int
}

// Sink takes what subscriptions read. Subscriptions call it from their own
// goroutines, one at a time per engine, in sequence order; it must be safe
// for concurrent use across engines and must not block for long.
type Sink interface {
	// Apply hands over a batch of engine's events. engine is the pdx
	// endpoint address ("host:port") the publisher belongs to. b and its
	// slices are the caller's again once Apply returns: a Sink copies
	// what it keeps.
	Apply(engine string, b *Batch)
	// Reset says that what engine's rank published before can no longer be
	// trusted (a sequence gap that replay could not fill, a publisher
	// restart, a flood): forget it and relearn from the events that
	// follow. rank -1 means every rank. reason is a short label for
	// metrics ("gap", "restart", "overflow", ...).
	Reset(engine string, rank int, reason string)
}
