package kvevents

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"slices"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// MaxPayload bounds a batch's payload, as vllm-router's decoder does
// (16 MiB). A vLLM batch is one scheduler step's events: a few hundred KiB
// for a step of long prompts.
const MaxPayload = 16 << 20

// Decode decodes the payload of message seq: vLLM's KVEventBatch, as
// msgspec encodes it (vllm/distributed/kv_events.py). It takes every
// shape vLLM, SGLang (whose publisher is a copy) and llm-d's simulator
// (llm-d-inference-sim, positional by default, maps with
// --use-vllm-map-event-format) have sent, in any mix within a batch:
//
//   - the batch as an array, [ts, events] or [ts, events, dp_rank]
//     (msgspec array_like; later elements are ignored), or as a map with
//     "ts", "events" and "data_parallel_rank" (vLLM main once EventBatch
//     lost array_like);
//   - each event as a tagged array, ["BlockStored", block_hashes,
//     parent_block_hash, token_ids, block_size, lora_id, medium,
//     lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//     kv_cache_spec_sliding_window] and ["BlockRemoved", block_hashes,
//     medium, group_idx] (vLLM before PR #42892, SGLang), which may stop
//     after block_size, resp. block_hashes (msgspec omits trailing
//     defaults, and older versions had fewer fields), or as a map tagged
//     by "type" (vLLM since PR #42892), whose unknown keys are ignored;
//   - block hashes as integers or bytes (see Hash).
//
// Nil is taken for any field after block_hashes, as its zero. Events of a
// type it does not know are left out and counted in Batch.Skipped; any
// other deviation is an error. Decode never panics, and what it allocates
// is bounded by the payload: at most 16 bytes of Hash per payload byte.
// The events' slices may share backing arrays; the Batch is the caller's.
func Decode(seq uint64, payload []byte) (Batch, error) {
	var d Decoder
	b, err := d.Decode(seq, payload)
	if err != nil {
		return Batch{}, err
	}
	if len(b.Events) == 0 {
		b.Events = nil
	}
	return *b, nil
}

// A Decoder decodes batches as Decode does into arrays it reuses: the
// Batch it returns, and every slice in it, are valid until its next
// Decode. A subscription's feed keeps one, so that a batch costs no
// allocation once the arrays have grown to the engine's busiest step.
type Decoder struct {
	d     decoder
	batch Batch
}

// Decode decodes the payload of message seq (see the function Decode).
func (dec *Decoder) Decode(seq uint64, payload []byte) (*Batch, error) {
	if len(payload) > MaxPayload {
		return nil, fmt.Errorf("kvevents: batch %d: %d bytes, over the %d allowed", seq, len(payload), MaxPayload)
	}
	d, b := &dec.d, &dec.batch
	clear(b.Events)
	if retained := cap(d.hashes)*hashBytes + cap(d.tokens)*4 + cap(b.Events)*eventBytes; retained > maxRetained {
		// One flood of a batch does not hold its arrays for good.
		d.hashes, d.tokens, b.Events = nil, nil, nil
	}
	d.r = reader{b: payload}
	d.hashes, d.tokens = d.hashes[:0], d.tokens[:0]
	*b = Batch{Seq: seq, Events: b.Events[:0]}
	if err := d.batch(b); err != nil {
		return nil, fmt.Errorf("kvevents: batch %d: %w", seq, err)
	}
	if n := d.r.left(); n > 0 {
		return nil, fmt.Errorf("kvevents: batch %d: %d bytes after the batch", seq, n)
	}
	return b, nil
}

// maxRetained bounds the bytes of arrays a Decoder keeps between batches:
// a busy step's hundreds of events, not the largest payload allowed.
const maxRetained = 1 << 20

const (
	hashBytes  = int(unsafe.Sizeof(Hash{}))
	eventBytes = int(unsafe.Sizeof(Event{}))
)

// decoder appends a batch's hashes and token ids to two arrays, which the
// events slice, rather than allocating two per event. An event keeps the
// array it was read into when a later one grows it; the events' slices
// are capped, so appending to one copies it.
type decoder struct {
	r      reader
	hashes []Hash
	tokens []uint32
}

func (d *decoder) batch(b *Batch) error {
	c, err := d.r.peek()
	if err != nil {
		return err
	}
	switch {
	case isArray(c):
		n, err := d.r.arrayLen()
		if err != nil {
			return err
		}
		if n < 2 {
			return fmt.Errorf("an array of %d, want [ts, events, dp_rank]", n)
		}
		if b.TS, err = d.r.float(); err != nil {
			return fmt.Errorf("ts: %w", err)
		}
		if err := d.events(b); err != nil {
			return err
		}
		if n > 2 {
			if err := d.rank(b); err != nil {
				return err
			}
		}
		return d.r.skipN(uint64(n-min(n, 3)), 0)
	case isMap(c):
		n, err := d.r.mapLen()
		if err != nil {
			return err
		}
		var ts, events bool
		for range n {
			key, err := d.r.str()
			if err != nil {
				return fmt.Errorf("batch key: %w", err)
			}
			switch string(key) {
			case "ts":
				if b.TS, err = d.r.float(); err != nil {
					return fmt.Errorf("ts: %w", err)
				}
				ts = true
			case "events":
				if err := d.events(b); err != nil {
					return err
				}
				events = true
			case "data_parallel_rank":
				if err := d.rank(b); err != nil {
					return err
				}
			default:
				if err := d.r.skip(1); err != nil {
					return fmt.Errorf("%q: %w", key, err)
				}
			}
		}
		if !ts || !events {
			return errors.New("a map without ts or events")
		}
		return nil
	}
	return unexpected("a batch (array or map)", c)
}

func (d *decoder) rank(b *Batch) error {
	if d.r.null() {
		return nil
	}
	v, err := d.r.count(math.MaxInt32)
	if err != nil {
		return fmt.Errorf("data_parallel_rank: %w", err)
	}
	b.DPRank, b.HasDPRank = int(v), true
	return nil
}

// minEventBytes is the smallest known event on the wire,
// ["BlockRemoved", []]: the events' first allocation is no larger than
// the payload could hold.
const minEventBytes = 15

func (d *decoder) events(b *Batch) error {
	n, err := d.r.arrayLen()
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	if n == 0 {
		return nil
	}
	if want := max(1, min(n, d.r.left()/minEventBytes)); cap(b.Events) < want {
		b.Events = make([]Event, 0, want)
	}
	for i := range n {
		b.Events = append(b.Events, Event{})
		known, err := d.event(&b.Events[len(b.Events)-1])
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if !known {
			b.Events[len(b.Events)-1] = Event{}
			b.Events = b.Events[:len(b.Events)-1]
			b.Skipped++
		}
	}
	return nil
}

// field names an event's field.
type field uint8

const (
	fOther field = iota // unknown: skipped
	fType
	fHashes
	fParent
	fTokens
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fExtraKeys
	fGroupIdx
	fSpecKind
	fWindow
)

// Each kind's fields in declaration order (the array encoding's
// positions), and how many an array must have.
var (
	storedFields = [...]field{fHashes, fParent, fTokens, fBlockSize, fLoRAID, fMedium, fLoRAName, fExtraKeys, fGroupIdx, fSpecKind, fWindow}
	// removedFields: vLLM's BlockRemoved; SGLang's has only block_hashes.
	removedFields = [...]field{fHashes, fMedium, fGroupIdx}
)

func positions(k Kind) (fields []field, required int) {
	switch k {
	case BlockStored:
		return storedFields[:], 4 // through block_size: every version had those
	case BlockRemoved:
		return removedFields[:], 1
	}
	return nil, 0
}

func kindOf(tag []byte) Kind {
	switch string(tag) {
	case "BlockStored":
		return BlockStored
	case "BlockRemoved":
		return BlockRemoved
	case "AllBlocksCleared":
		return AllBlocksCleared
	}
	return 0
}

func fieldNamed(k Kind, key []byte) field {
	f := fOther
	switch string(key) {
	case "type":
		return fType
	case "block_hashes":
		f = fHashes
	case "parent_block_hash":
		f = fParent
	case "token_ids":
		f = fTokens
	case "block_size":
		f = fBlockSize
	case "lora_id":
		f = fLoRAID
	case "medium":
		f = fMedium
	case "lora_name":
		f = fLoRAName
	case "extra_keys":
		f = fExtraKeys
	case "group_idx":
		f = fGroupIdx
	case "kv_cache_spec_kind":
		f = fSpecKind
	case "kv_cache_spec_sliding_window":
		f = fWindow
	}
	fields, _ := positions(k)
	if slices.Contains(fields, f) {
		return f
	}
	return fOther
}

// event decodes one event into ev; known is false for a type it does
// not know, which it skips.
func (d *decoder) event(ev *Event) (known bool, err error) {
	c, err := d.r.peek()
	if err != nil {
		return false, err
	}
	switch {
	case isArray(c):
		return d.eventArray(ev)
	case isMap(c):
		return d.eventMap(ev)
	}
	return false, unexpected("an event (array or map)", c)
}

func (d *decoder) eventArray(ev *Event) (bool, error) {
	n, err := d.r.arrayLen()
	if err != nil {
		return false, err
	}
	if n == 0 {
		return false, errors.New("an empty event array")
	}
	tag, err := d.r.str()
	if err != nil {
		return false, fmt.Errorf("tag: %w", err)
	}
	ev.Kind = kindOf(tag)
	if ev.Kind == 0 {
		return false, d.r.skipN(uint64(n-1), 1)
	}
	fields, required := positions(ev.Kind)
	if n-1 < required {
		return false, fmt.Errorf("%s with %d fields, want %d at least", ev.Kind, n-1, required)
	}
	for i := 1; i < n; i++ {
		f := fOther
		if i-1 < len(fields) {
			f = fields[i-1]
		}
		if err := d.field(ev, f); err != nil {
			return false, fmt.Errorf("%s field %d: %w", ev.Kind, i, err)
		}
	}
	return true, nil
}

func (d *decoder) eventMap(ev *Event) (bool, error) {
	n, err := d.r.mapLen()
	if err != nil {
		return false, err
	}
	// msgspec writes the tag first; any other order costs a second pass.
	rest, mark := n, d.r.pos
	key, err := d.r.str()
	if err != nil {
		return false, fmt.Errorf("event key: %w", err)
	}
	if string(key) == "type" {
		tag, err := d.r.str()
		if err != nil {
			return false, fmt.Errorf("type: %w", err)
		}
		ev.Kind, rest = kindOf(tag), n-1
	} else {
		d.r.pos = mark
		if ev.Kind, err = d.findType(n); err != nil {
			return false, err
		}
		d.r.pos = mark
	}
	if ev.Kind == 0 {
		return false, d.r.skipN(2*uint64(rest), 1)
	}
	hashes := false
	for range rest {
		key, err := d.r.str()
		if err != nil {
			return false, fmt.Errorf("%s key: %w", ev.Kind, err)
		}
		f := fieldNamed(ev.Kind, key)
		if f == fType {
			f = fOther // read already
		}
		if err := d.field(ev, f); err != nil {
			return false, fmt.Errorf("%s %q: %w", ev.Kind, key, err)
		}
		hashes = hashes || f == fHashes
	}
	if !hashes && ev.Kind != AllBlocksCleared {
		return false, fmt.Errorf("%s without block_hashes", ev.Kind)
	}
	return true, nil
}

// findType reads the "type" of a map of n pairs whose first key is not
// it; 0 for a type it does not know.
func (d *decoder) findType(n int) (Kind, error) {
	for range n {
		key, err := d.r.str()
		if err != nil {
			return 0, fmt.Errorf("event key: %w", err)
		}
		if string(key) == "type" {
			tag, err := d.r.str()
			if err != nil {
				return 0, fmt.Errorf("type: %w", err)
			}
			return kindOf(tag), nil
		}
		if err := d.r.skip(1); err != nil {
			return 0, fmt.Errorf("%q: %w", key, err)
		}
	}
	return 0, errors.New("an event map without type")
}

// field decodes the value of field f into ev.
func (d *decoder) field(ev *Event, f field) error {
	if f != fHashes && f != fOther && d.r.null() {
		return nil // nil is the zero of every optional field
	}
	switch f {
	case fHashes:
		n, err := d.r.arrayLen()
		if err != nil {
			return err
		}
		h0 := len(d.hashes)
		d.hashes = slices.Grow(d.hashes, n)
		for range n {
			h, err := d.hash()
			if err != nil {
				return err
			}
			d.hashes = append(d.hashes, h)
		}
		ev.Hashes = nil
		if h1 := len(d.hashes); h1 > h0 {
			ev.Hashes = d.hashes[h0:h1:h1]
		}
	case fParent:
		h, err := d.hash()
		if err != nil {
			return err
		}
		ev.Parent, ev.HasParent = h, true
	case fTokens:
		n, err := d.r.arrayLen()
		if err != nil {
			return err
		}
		t0 := len(d.tokens)
		d.tokens = slices.Grow(d.tokens, n)
		for range n {
			v, err := d.r.tokenID()
			if err != nil {
				return err
			}
			d.tokens = append(d.tokens, v)
		}
		ev.TokenIDs = nil
		if t1 := len(d.tokens); t1 > t0 {
			ev.TokenIDs = d.tokens[t0:t1:t1]
		}
	case fBlockSize, fGroupIdx, fWindow:
		v, err := d.r.count(math.MaxInt32)
		if err != nil {
			return err
		}
		switch f {
		case fBlockSize:
			ev.BlockSize = int(v)
		case fGroupIdx:
			ev.GroupIdx = int(v)
		default:
			ev.SlidingWindow = int(v)
		}
	case fLoRAID:
		v, err := d.r.int64()
		if err != nil {
			return err
		}
		ev.LoRAID = v
	case fMedium, fLoRAName, fSpecKind:
		b, err := d.r.str()
		if err != nil {
			return err
		}
		switch f {
		case fMedium:
			ev.Medium = intern(b)
		case fLoRAName:
			ev.LoRAName = intern(b)
		default:
			ev.SpecKind = intern(b)
		}
	case fExtraKeys:
		return d.extraKeys(ev)
	default:
		return d.r.skip(1)
	}
	return nil
}

// hash reads a block hash, an integer or bytes (see Hash).
func (d *decoder) hash() (Hash, error) {
	c, err := d.r.peek()
	if err != nil {
		return Hash{}, err
	}
	if c == 0xc4 || c == 0xc5 || c == 0xc6 {
		d.r.pos++
		n, err := d.r.size(1 << (c - 0xc4)) // bin8, bin16, bin32
		if err != nil {
			return Hash{}, err
		}
		b, err := d.r.take(n)
		if err != nil {
			return Hash{}, err
		}
		if len(b) == 0 {
			return Hash{}, errors.New("an empty bytes hash")
		}
		return bytesHash(b), nil
	}
	bits, _, err := d.r.integer()
	if err != nil {
		return Hash{}, fmt.Errorf("a hash: %w", err)
	}
	return Hash{Lo: bits}, nil
}

// bytesHash folds a bytes hash to a Hash (see Hash).
func bytesHash(b []byte) Hash {
	var lo uint64
	for _, c := range b[max(0, len(b)-8):] {
		lo = lo<<8 | uint64(c)
	}
	hi := xxhash.Sum64(b)
	if hi == 0 {
		hi = 1
	}
	return Hash{Lo: lo, Hi: hi}
}

// extraKeys keeps extra_keys' encoding unless every entry is nil.
func (d *decoder) extraKeys(ev *Event) error {
	start := d.r.pos
	c, err := d.r.peek()
	if err != nil {
		return err
	}
	if !isArray(c) {
		if err := d.r.skip(1); err != nil {
			return err
		}
	} else {
		n, err := d.r.arrayLen()
		if err != nil {
			return err
		}
		some := false
		for range n {
			if d.r.null() {
				continue
			}
			some = true
			if err := d.r.skip(2); err != nil {
				return err
			}
		}
		if !some {
			return nil
		}
	}
	ev.ExtraKeys = bytes.Clone(d.r.b[start:d.r.pos])
	return nil
}

// intern returns the strings vLLM sends on every event without
// allocating them.
func intern(b []byte) string {
	switch string(b) {
	case "":
		return ""
	case "GPU":
		return "GPU"
	case "CPU":
		return "CPU"
	case "cpu":
		return "cpu"
	case "full_attention":
		return "full_attention"
	case "sliding_window":
		return "sliding_window"
	}
	return string(b)
}
