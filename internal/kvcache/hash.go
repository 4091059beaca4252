package kvcache

import (
	"encoding/binary"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// blockBuf is the stack buffer a block is hashed from: the parent hash and
// up to 126 tokens, little-endian. Longer blocks are streamed.
const blockBuf = 512

// littleEndian is whether uint32s are stored little-endian, as hashed.
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// HashTokens appends to dst the chained hashes of the full blocks of
// blockSize tokens in tokens, at most maxBlocks of them (maxBlocks <= 0: no
// limit), and returns it. Hash k covers blocks 0 to k: it is the xxhash of
// hash k-1 (seed for block 0) and block k's tokens, all little-endian, so
// equal hashes mean equal prefixes of equal identity. A partial last block
// is not hashed (engines cache full blocks only). seed is the prefix's
// identity (Seed; 0 for the base model) or, to extend a chain, the hash of
// the block before tokens. It allocates only to grow dst.
//
// No hash is 0: the Index keeps 0 for "no block".
func HashTokens(dst []uint64, seed uint64, tokens []uint32, blockSize int, maxBlocks int) []uint64 {
	if blockSize <= 0 {
		return dst
	}
	n := len(tokens) / blockSize
	if maxBlocks > 0 {
		n = min(n, maxBlocks)
	}
	h := seed
	var buf [blockBuf]byte
	for k := range n {
		h = hashBlock(&buf, h, tokens[k*blockSize:(k+1)*blockSize])
		dst = append(dst, h)
	}
	return dst
}

// hashBlock is the hash of block chained to parent: xxhash of parent's and
// the tokens' little-endian bytes, never 0.
func hashBlock(buf *[blockBuf]byte, parent uint64, block []uint32) uint64 {
	var h uint64
	if n := 8 + 4*len(block); n <= len(buf) {
		binary.LittleEndian.PutUint64(buf[:8], parent)
		if littleEndian {
			// The tokens' memory is their little-endian bytes: one copy
			// instead of a store per token, a third of the block's cost.
			copy(buf[8:n], unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(block))), 4*len(block)))
		} else {
			for i, t := range block {
				binary.LittleEndian.PutUint32(buf[8+4*i:], t)
			}
		}
		h = xxhash.Sum64(buf[:n])
	} else {
		// The same bytes, streamed: a digest equals the one-shot sum.
		var d xxhash.Digest
		d.Reset()
		binary.LittleEndian.PutUint64(buf[:8], parent)
		_, _ = d.Write(buf[:8])
		for len(block) > 0 {
			m := min(len(block), len(buf)/4)
			for i, t := range block[:m] {
				binary.LittleEndian.PutUint32(buf[4*i:], t)
			}
			_, _ = d.Write(buf[:4*m])
			block = block[m:]
		}
		h = d.Sum64()
	}
	if h == 0 {
		h = 1
	}
	return h
}

// Identity tags: each taint hashes a tag before its bytes, so that a LoRA
// name cannot pass for extra keys or a LoRA id.
const (
	tagLoRA      = 'L'
	tagLoRAID    = 'I'
	tagExtraKeys = 'X'
)

// Seed is the identity of a prefix that starts a chain: 0 for the base
// model without extra keys, else a hash of the LoRA adapter's name and of
// extraKeys, vLLM's extra_keys as msgpack (cache salt, multimodal hashes).
// A LoRA adapter's KV is not the base model's, and a salted block is
// another block, so their chains share no hash with the base model's.
// extraKeys that carry no key (absent, nil, or a list of nils, one per
// block, as vLLM sends for plain blocks) do not taint.
func Seed(loraName string, extraKeys []byte) uint64 {
	var h uint64
	if loraName != "" {
		var d xxhash.Digest
		d.Reset()
		_, _ = d.Write([]byte{tagLoRA})
		_, _ = d.WriteString(loraName)
		h = nonZero(d.Sum64())
	}
	return taint(h, extraKeys)
}

// loraIDSeed is the identity of blocks of an adapter known only by its
// lora_id (vLLM before lora_name): no request's Seed equals it, so such
// blocks are kept (their removals and children resolve) but never match.
func loraIDSeed(id int64) uint64 {
	var b [9]byte
	b[0] = tagLoRAID
	binary.LittleEndian.PutUint64(b[1:], uint64(id))
	return nonZero(xxhash.Sum64(b[:]))
}

// taint is h with extraKeys mixed in when they carry a key: the seed of
// the first block of a stored run whose blocks have extra keys, h being
// Seed's or the parent block's hash.
func taint(h uint64, extraKeys []byte) uint64 {
	if !hasKeys(extraKeys) {
		return h
	}
	var d xxhash.Digest
	d.Reset()
	var b [9]byte
	b[0] = tagExtraKeys
	binary.LittleEndian.PutUint64(b[1:], h)
	_, _ = d.Write(b[:])
	_, _ = d.Write(extraKeys)
	return nonZero(d.Sum64())
}

func nonZero(h uint64) uint64 {
	if h == 0 {
		return 1
	}
	return h
}

// onlyLoRAKeys reports whether extraKeys, msgpack, is a list with one entry
// per block that is nil or the adapter's name alone, [lora]: the extra keys
// vLLM gives an adapter's blocks (generate_block_hash_extra_keys: the LoRA
// name, then multimodal hashes, a cache salt, ... when there are some).
func onlyLoRAKeys(extraKeys []byte, lora string) bool {
	n, off, ok := msgpackArray(extraKeys)
	if !ok {
		return false
	}
	b := extraKeys[off:]
	for range n {
		switch {
		case len(b) > 0 && b[0] == 0xc0:
			b = b[1:]
			continue
		case len(b) > 0 && b[0] == 0x91: // an array of one
			b = b[1:]
		default:
			return false
		}
		s, rest, ok := msgpackStr(b)
		if !ok || s != lora {
			return false
		}
		b = rest
	}
	return len(b) == 0
}

// msgpackArray reads an array header: its length and size.
func msgpackArray(b []byte) (n, off int, ok bool) {
	switch {
	case len(b) == 0:
		return 0, 0, false
	case b[0]&0xf0 == 0x90:
		return int(b[0] & 0x0f), 1, true
	case b[0] == 0xdc && len(b) >= 3:
		return int(binary.BigEndian.Uint16(b[1:])), 3, true
	case b[0] == 0xdd && len(b) >= 5:
		return int(binary.BigEndian.Uint32(b[1:])), 5, true
	}
	return 0, 0, false
}

// msgpackStr reads a string and returns it and what follows.
func msgpackStr(b []byte) (s string, rest []byte, ok bool) {
	var n, off int
	switch {
	case len(b) == 0:
		return "", nil, false
	case b[0]&0xe0 == 0xa0:
		n, off = int(b[0]&0x1f), 1
	case b[0] == 0xd9 && len(b) >= 2:
		n, off = int(b[1]), 2
	case b[0] == 0xda && len(b) >= 3:
		n, off = int(binary.BigEndian.Uint16(b[1:])), 3
	case b[0] == 0xdb && len(b) >= 5:
		n, off = int(binary.BigEndian.Uint32(b[1:])), 5
	default:
		return "", nil, false
	}
	if len(b)-off < n {
		return "", nil, false
	}
	return string(b[off : off+n]), b[off+n:], true
}

// hasKeys reports whether extraKeys, msgpack, is anything but nothing: nil,
// empty, a msgpack nil or an array of only nils.
func hasKeys(extraKeys []byte) bool {
	if len(extraKeys) == 0 {
		return false
	}
	var n, off int
	switch c := extraKeys[0]; {
	case c == 0xc0: // nil
		return len(extraKeys) != 1
	case c&0xf0 == 0x90: // fixarray
		n, off = int(c&0x0f), 1
	case c == 0xdc && len(extraKeys) >= 3: // array 16
		n, off = int(binary.BigEndian.Uint16(extraKeys[1:])), 3
	case c == 0xdd && len(extraKeys) >= 5: // array 32
		n, off = int(binary.BigEndian.Uint32(extraKeys[1:])), 5
	default:
		return true
	}
	if len(extraKeys) != off+n {
		return true
	}
	for _, c := range extraKeys[off:] {
		if c != 0xc0 {
			return true
		}
	}
	return false
}
