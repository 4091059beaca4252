package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// reader walks a msgpack document in place. Every length it reads is
// checked against the bytes left, so hostile input fails before anything
// is allocated for it, and nothing it does can index out of range.
type reader struct {
	b   []byte
	pos int
}

var errTruncated = errors.New("truncated")

// maxDepth bounds the nesting of values skipped (extra_keys, unknown
// fields): vLLM's are a few levels deep.
const maxDepth = 32

func (r *reader) left() int { return len(r.b) - r.pos }

func (r *reader) peek() (byte, error) {
	if r.pos >= len(r.b) {
		return 0, errTruncated
	}
	return r.b[r.pos], nil
}

func (r *reader) next() (byte, error) {
	c, err := r.peek()
	if err == nil {
		r.pos++
	}
	return c, err
}

// take is the next n bytes.
func (r *reader) take(n uint64) ([]byte, error) {
	if n > uint64(r.left()) {
		return nil, errTruncated
	}
	s := r.b[r.pos : r.pos+int(n)]
	r.pos += int(n)
	return s, nil
}

// size reads a big-endian length of width bytes (1, 2 or 4).
func (r *reader) size(width int) (uint64, error) {
	s, err := r.take(uint64(width))
	if err != nil {
		return 0, err
	}
	switch width {
	case 1:
		return uint64(s[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(s)), nil
	}
	return uint64(binary.BigEndian.Uint32(s)), nil
}

// null consumes a nil and reports whether there was one.
func (r *reader) null() bool {
	if r.pos < len(r.b) && r.b[r.pos] == 0xc0 {
		r.pos++
		return true
	}
	return false
}

func isArray(c byte) bool { return c&0xf0 == 0x90 || c == 0xdc || c == 0xdd }
func isMap(c byte) bool   { return c&0xf0 == 0x80 || c == 0xde || c == 0xdf }

// arrayLen reads an array header. Each element takes a byte at least, so
// n is at most the bytes left.
func (r *reader) arrayLen() (int, error) {
	c, err := r.next()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c&0xf0 == 0x90:
		n = uint64(c & 0x0f)
	case c == 0xdc:
		n, err = r.size(2)
	case c == 0xdd:
		n, err = r.size(4)
	default:
		return 0, unexpected("an array", c)
	}
	if err != nil {
		return 0, err
	}
	if n > uint64(r.left()) {
		return 0, errTruncated
	}
	return int(n), nil
}

// mapLen reads a map header; a pair takes two bytes at least.
func (r *reader) mapLen() (int, error) {
	c, err := r.next()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case c&0xf0 == 0x80:
		n = uint64(c & 0x0f)
	case c == 0xde:
		n, err = r.size(2)
	case c == 0xdf:
		n, err = r.size(4)
	default:
		return 0, unexpected("a map", c)
	}
	if err != nil {
		return 0, err
	}
	if 2*n > uint64(r.left()) {
		return 0, errTruncated
	}
	return int(n), nil
}

// str reads a string, in place.
func (r *reader) str() ([]byte, error) {
	c, err := r.next()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch {
	case c&0xe0 == 0xa0:
		n = uint64(c & 0x1f)
	case c == 0xd9:
		n, err = r.size(1)
	case c == 0xda:
		n, err = r.size(2)
	case c == 0xdb:
		n, err = r.size(4)
	default:
		return nil, unexpected("a string", c)
	}
	if err != nil {
		return nil, err
	}
	return r.take(n)
}

// integer reads any msgpack integer as its 64-bit two's complement
// pattern; neg says it was negative (so bits > MaxInt64 with !neg is a
// large unsigned value). It is the hot path (every token id and hash).
func (r *reader) integer() (bits uint64, neg bool, err error) {
	if r.pos >= len(r.b) {
		return 0, false, errTruncated
	}
	c := r.b[r.pos]
	switch {
	case c <= 0x7f:
		r.pos++
		return uint64(c), false, nil
	case c >= 0xe0:
		r.pos++
		return uint64(int64(int8(c))), true, nil
	case c < 0xcc || c > 0xd3:
		return 0, false, unexpected("an integer", c)
	}
	// uint8, 16, 32, 64 (0xcc-0xcf), then int8 to int64 (0xd0-0xd3).
	w := 1 << ((c - 0xcc) & 3)
	if len(r.b)-r.pos-1 < w {
		return 0, false, errTruncated
	}
	s := r.b[r.pos+1 : r.pos+1+w]
	r.pos += 1 + w
	var u uint64
	switch w {
	case 1:
		u = uint64(s[0])
	case 2:
		u = uint64(binary.BigEndian.Uint16(s))
	case 4:
		u = uint64(binary.BigEndian.Uint32(s))
	default:
		u = binary.BigEndian.Uint64(s)
	}
	if c <= 0xcf {
		return u, false, nil
	}
	shift := 64 - 8*w
	v := int64(u<<shift) >> shift // sign-extended
	return uint64(v), v < 0, nil
}

// tokenID reads a token id, an integer in [0, 2^32): inline for the
// encodings a vocabulary's ids take, as a batch is mostly token ids.
func (r *reader) tokenID() (uint32, error) {
	if r.pos < len(r.b) {
		switch c := r.b[r.pos]; {
		case c <= 0x7f:
			r.pos++
			return uint32(c), nil
		case c == 0xcd && len(r.b)-r.pos >= 3:
			v := binary.BigEndian.Uint16(r.b[r.pos+1:])
			r.pos += 3
			return uint32(v), nil
		case c == 0xce && len(r.b)-r.pos >= 5:
			v := binary.BigEndian.Uint32(r.b[r.pos+1:])
			r.pos += 5
			return v, nil
		}
	}
	v, err := r.count(math.MaxUint32)
	return uint32(v), err
}

// count reads a non-negative integer of at most limit.
func (r *reader) count(limit uint64) (uint64, error) {
	v, neg, err := r.integer()
	if err != nil {
		return 0, err
	}
	if neg || v > limit {
		return 0, fmt.Errorf("%d out of range [0, %d]", int64(v), limit)
	}
	return v, nil
}

// int64 reads an integer that fits in an int64.
func (r *reader) int64() (int64, error) {
	v, neg, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !neg && v > math.MaxInt64 {
		return 0, fmt.Errorf("%d overflows an int64", v)
	}
	return int64(v), nil
}

// float reads a float, or an integer as one.
func (r *reader) float() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case 0xca:
		r.pos++
		s, err := r.take(4)
		if err != nil {
			return 0, err
		}
		return float64(math.Float32frombits(binary.BigEndian.Uint32(s))), nil
	case 0xcb:
		r.pos++
		s, err := r.take(8)
		if err != nil {
			return 0, err
		}
		return math.Float64frombits(binary.BigEndian.Uint64(s)), nil
	}
	v, neg, err := r.integer()
	if err != nil {
		return 0, unexpected("a number", c)
	}
	if neg {
		return float64(int64(v)), nil
	}
	return float64(v), nil
}

// skip passes over one value of any type.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return errors.New("nested too deep")
	}
	c, err := r.next()
	if err != nil {
		return err
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return nil
	case c&0xf0 == 0x80:
		return r.skipN(2*uint64(c&0x0f), depth)
	case c&0xf0 == 0x90:
		return r.skipN(uint64(c&0x0f), depth)
	case c&0xe0 == 0xa0:
		_, err = r.take(uint64(c & 0x1f))
		return err
	}
	var n uint64
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		n, err = r.size(1)
	case 0xc5, 0xda:
		n, err = r.size(2)
	case 0xc6, 0xdb:
		n, err = r.size(4)
	case 0xc7: // ext8: length, type, data
		n, err = r.size(1)
		n++
	case 0xc8:
		n, err = r.size(2)
		n++
	case 0xc9:
		n, err = r.size(4)
		n++
	case 0xca:
		n = 4
	case 0xcb:
		n = 8
	case 0xcc, 0xd0:
		n = 1
	case 0xcd, 0xd1:
		n = 2
	case 0xce, 0xd2:
		n = 4
	case 0xcf, 0xd3:
		n = 8
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16 and a type byte
		n = 1 + 1<<(c-0xd4)
	case 0xdc, 0xdd:
		r.pos--
		k, err := r.arrayLen()
		if err != nil {
			return err
		}
		return r.skipN(uint64(k), depth)
	case 0xde, 0xdf:
		r.pos--
		k, err := r.mapLen()
		if err != nil {
			return err
		}
		return r.skipN(2*uint64(k), depth)
	default:
		return unexpected("a msgpack value", c) // 0xc1, never used
	}
	if err != nil {
		return err
	}
	_, err = r.take(n)
	return err
}

// skipN skips n values inside a container at depth.
func (r *reader) skipN(n uint64, depth int) error {
	if n > uint64(r.left()) {
		return errTruncated
	}
	for range n {
		if err := r.skip(depth + 1); err != nil {
			return err
		}
	}
	return nil
}

func unexpected(want string, c byte) error {
	return fmt.Errorf("want %s, got type byte 0x%02x", want, c)
}
