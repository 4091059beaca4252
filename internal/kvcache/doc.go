// Package kvcache knows which engine holds which prompt prefix in its KV
// cache, from the KV cache events the engines publish (package kvevents
// reads them): the precise prefix state of scheduling.md's "Precise prefix
// state: KV cache events". Its Index is a [kvevents.Sink].
//
// Hashes. The Index hashes the token ids of every stored block with pdx's
// own chained hash, HashTokens, and keeps the engine's block hashes only as
// opaque keys for parents and removals, as llm-d and SGLang's gateway do. A
// request's prompt tokens from the engine's render API, hashed the same
// way, give the same hashes exactly when the engine holds that prefix,
// whatever hash function (and PYTHONHASHSEED) the engine uses.
//
// Identity. A chain of blocks starts from a seed: 0 for the base model,
// else Seed of its LoRA adapter's name (lora_name; blocks known only by a
// lora_id get a seed no request has) and extra keys (cache salt,
// multimodal hashes; vLLM 0.32's [lora_name] per block is the adapter,
// already in the seed), so that an adapter's or a salted prefix never
// matches the base model's. A stored run with a parent chains from the
// parent's hash, which carries the adapter; its own extra keys, if any,
// taint it further. A request is hashed from SeedFor(model): the model
// names an adapter when an engine published blocks under that lora_name;
// else the request is the base model's. Requests with a cache salt or
// multimodal inputs are not for Match: their blocks are not the base
// model's, and pdx cannot rebuild vLLM's extra keys.
//
// Groups. Only full-attention cache groups (vLLM's kv_cache_spec_kind
// full_attention, mla_attention, sink_full_attention, or none sent) hold a
// prefix's KV for every token; events of sliding-window, Mamba and other
// groups, or with a sliding window, are ignored and counted. Of several
// full-attention groups an engine follows one, the first it published
// (vLLM stores and frees a request's blocks in all of them together).
//
// Tiers. A block is on the GPU tier (medium "GPU", or none sent) or the
// CPU tier ("CPU"); other media are ignored and counted. Match counts GPU
// blocks, MatchWithCPU blocks on either. An engine holds a block on a
// tier while any copy is there: another engine hash of the same content,
// the same hash stored twice, another DP rank.
//
// Matching. Each block's lookup is a cache miss at scale, so that walking
// a long prompt block by block costs microseconds. An engine that holds,
// of each chain, a prefix of it (it evicts chains from their ends, as
// vLLM does) is searched instead: a few lookups find where it stops. The
// Index counts, on every store and removal, each engine's blocks held
// without their parent; an engine with any has its blocks walked. Both
// are exact.
//
// Orphans. Blocks stored under a parent the index never saw (a
// subscription that joined mid-stream, or after a reset) are kept apart
// with their tokens, matched by nothing, until the block they wait for is
// stored under a known prefix: then they join (orphans.go). A parent named
// 0 is a chain's start, llm-d's "no parent", unless the engine holds a
// block hashed 0 (seedOf).
//
// Engines. An Index tells at most MaxEngines engines apart, each in a
// slot. Register gives a caller a handle of the slot; Forget and Retain
// free the slots of engines that left, and a freed slot's next engine
// gets a handle of its next generation: an old handle then names no
// engine (Fresh says so), never the new one's blocks.
//
// Bounds. An engine tracks at most Config.MaxEntries engine blocks,
// orphans included (it is reset beyond them), and orphans of at most
// 2^20 tokens.
package kvcache
