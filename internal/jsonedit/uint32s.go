package jsonedit

import (
	"bytes"
	"errors"
	"math"
)

// ErrNotUint32s is Uint32s' error for a value that is not an array of
// integers in [0, 2^32).
var ErrNotUint32s = errors.New("not an array of integers in [0, 2^32)")

// Uint32s parses raw, a valid JSON value such as an Object's Raw member, as
// an array of integers in [0, 2^32): token ids. A render answer's 8,000
// ids take encoding/json milliseconds to decode into integers; this reads
// them in one pass.
func Uint32s(raw []byte) ([]uint32, error) {
	if len(raw) < 2 || raw[0] != '[' {
		return nil, ErrNotUint32s
	}
	out := make([]uint32, 0, bytes.Count(raw, []byte{','})+1)
	i := skipSpace(raw, 1)
	if i < len(raw) && raw[i] == ']' {
		return out, nil
	}
	for {
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > math.MaxUint32 {
				return nil, ErrNotUint32s
			}
			i++
		}
		if i == start || (raw[start] == '0' && i-start > 1) {
			return nil, ErrNotUint32s
		}
		out = append(out, uint32(v))
		switch i = skipSpace(raw, i); {
		case i < len(raw) && raw[i] == ',':
			i = skipSpace(raw, i+1)
		case i < len(raw) && raw[i] == ']':
			return out, nil
		default:
			return nil, ErrNotUint32s // a fraction, an exponent, a string
		}
	}
}
