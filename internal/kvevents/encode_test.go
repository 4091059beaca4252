package kvevents

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
)

// What the tests write, as msgspec does: the smallest integer encodings,
// floats as float64, a struct's fields in declaration order (om, an
// ordered map, for the map encoding).

// om is a msgpack map that keeps its keys' order.
type om []kv

type kv struct {
	k string
	v any
}

func (m om) EncodeMsgpack(e *msgpack.Encoder) error {
	if err := e.EncodeMapLen(len(m)); err != nil {
		return err
	}
	for _, p := range m {
		if err := e.EncodeString(p.k); err != nil {
			return err
		}
		if err := e.Encode(p.v); err != nil {
			return err
		}
	}
	return nil
}

// raw is msgpack written as it is.
type raw []byte

func (r raw) EncodeMsgpack(e *msgpack.Encoder) error {
	_, err := e.Writer().Write(r)
	return err
}

// pack encodes v as msgspec would.
func pack(tb testing.TB, v any) []byte {
	tb.Helper()
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	require.NoError(tb, enc.Encode(v))
	return buf.Bytes()
}

// wireHash is h as a publisher sends it: an integer when Hi is 0, else 16
// bytes (Hi, Lo big-endian), which decode to Lo again and to another Hi
// (see roundTripped).
func wireHash(h Hash) any {
	if h.Hi == 0 {
		return h.Lo
	}
	return binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint64(nil, h.Hi), h.Lo)
}

// roundTripped is what h decodes to after wireHash.
func roundTripped(h Hash) Hash {
	if h.Hi == 0 {
		return h
	}
	return bytesHash(wireHash(h).([]byte))
}

func orNil[T comparable](v T) any {
	var zero T
	if v == zero {
		return nil
	}
	return v
}

// encodeBatch is b in vLLM's encoding: events as tagged arrays (arrays)
// or maps, every field written.
func encodeBatch(tb testing.TB, b *Batch, arrays bool) []byte {
	tb.Helper()
	events := make([]any, 0, len(b.Events))
	for _, e := range b.Events {
		hashes := make([]any, len(e.Hashes))
		for i, h := range e.Hashes {
			hashes[i] = wireHash(h)
		}
		var parent, extra any
		if e.HasParent {
			parent = wireHash(e.Parent)
		}
		if e.ExtraKeys != nil {
			extra = raw(e.ExtraKeys)
		}
		tokens := e.TokenIDs
		if tokens == nil {
			tokens = []uint32{}
		}
		var fields om
		switch e.Kind {
		case BlockStored:
			fields = om{{"block_hashes", hashes}, {"parent_block_hash", parent}, {"token_ids", tokens},
				{"block_size", e.BlockSize}, {"lora_id", orNil(e.LoRAID)}, {"medium", orNil(e.Medium)},
				{"lora_name", orNil(e.LoRAName)}, {"extra_keys", extra}, {"group_idx", e.GroupIdx},
				{"kv_cache_spec_kind", orNil(e.SpecKind)}, {"kv_cache_spec_sliding_window", orNil(e.SlidingWindow)}}
		case BlockRemoved:
			fields = om{{"block_hashes", hashes}, {"medium", orNil(e.Medium)}, {"group_idx", e.GroupIdx}}
		}
		if arrays {
			a := []any{e.Kind.String()}
			for _, f := range fields {
				a = append(a, f.v)
			}
			events = append(events, a)
		} else {
			events = append(events, append(om{{"type", e.Kind.String()}}, fields...))
		}
	}
	var rank any
	if b.HasDPRank {
		rank = b.DPRank
	}
	return pack(tb, []any{b.TS, events, rank})
}
