// Package jsonedit parses the top level of a JSON object and writes edited
// copies of it without re-encoding: every member pdx does not touch keeps its
// bytes, so key order, number text and string escapes reach the engine as the
// client wrote them. Engines that tokenize what they get (SGLang, TensorRT-LLM)
// and integers above 2^53 (bootstrap_room) depend on that.
package jsonedit

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"unicode/utf8"
	"unsafe"
)

// ErrNotObject is returned by Parse for valid JSON that is not an object.
var ErrNotObject = errors.New("JSON body is not an object")

// ErrInvalid is returned by Parse for bytes that are not valid JSON.
var ErrInvalid = errors.New("body is not valid JSON")

// DuplicateKeyError is returned by Parse when a top-level key appears twice.
// JSON parsers disagree on which copy wins, so a router that checks one copy
// while the engine reads the other could be steered; pdx refuses both.
type DuplicateKeyError struct{ Key string }

func (e *DuplicateKeyError) Error() string {
	return fmt.Sprintf("JSON body has the key %q more than once", e.Key)
}

// Object is a parsed top-level JSON object. It refers to the parsed bytes,
// which must not change while the Object is in use.
//
// The members of small objects are kept inline, so parsing a typical request
// or answer allocates nothing.
type Object struct {
	src    []byte
	n      int                   // number of members
	inline [inlineMembers]member // the members, while n <= inlineMembers
	more   []member              // all the members, once n > inlineMembers
}

// inlineMembers is the number of members an Object holds without
// allocating.
const inlineMembers = 12

type member struct {
	start      int    // first byte of the key's opening quote
	keyEnd     int    // index of the key's closing quote; -1 if key holds the key
	valueStart int    // first byte of the value
	end        int    // one past the value's last byte
	key        string // the unescaped key, for keys written with escapes or invalid UTF-8
}

// list returns the members in document order.
func (o *Object) list() []member {
	if o.more != nil {
		return o.more
	}
	return o.inline[:o.n]
}

func (o *Object) add(m member) {
	if o.more == nil && o.n < inlineMembers {
		o.inline[o.n] = m
	} else {
		if o.more == nil {
			o.more = make([]member, inlineMembers, 4*inlineMembers)
			copy(o.more, o.inline[:])
		}
		o.more = append(o.more, m)
	}
	o.n++
}

// keyIs reports whether m's unescaped key is key. It does not allocate.
func (o *Object) keyIs(m *member, key string) bool {
	if m.keyEnd < 0 {
		return m.key == key
	}
	return string(o.src[m.start+1:m.keyEnd]) == key
}

// sameKey reports whether a and b have the same unescaped key.
func (o *Object) sameKey(a, b *member) bool {
	if b.keyEnd < 0 {
		return o.keyIs(a, b.key)
	}
	if a.keyEnd < 0 {
		return o.keyIs(b, a.key)
	}
	return bytes.Equal(o.src[a.start+1:a.keyEnd], o.src[b.start+1:b.keyEnd])
}

// keyString returns m's unescaped key (allocating for unescaped keys).
func (o *Object) keyString(m *member) string {
	if m.keyEnd < 0 {
		return m.key
	}
	return string(o.src[m.start+1 : m.keyEnd])
}

// maxLinearMembers is the number of members up to which Parse finds
// duplicate keys without a set.
const maxLinearMembers = 32

// maxDepth is the deepest nesting of arrays and objects Parse accepts, the
// top-level object included: encoding/json's limit, so that both accept the
// same bodies.
const maxDepth = 10000

// Parse validates b and indexes the members of its top-level object, in one
// pass over b.
func Parse(b []byte) (Object, error) {
	var stack nesting
	i := skipSpace(b, 0)
	if i == len(b) {
		return Object{}, ErrInvalid
	}
	if b[i] != '{' {
		end, ok := scanValue(b, i, &stack, maxDepth)
		if !ok || skipSpace(b, end) != len(b) {
			return Object{}, ErrInvalid
		}
		return Object{}, ErrNotObject
	}
	o := Object{src: b}
	// Duplicates are looked up linearly in small objects and in a set in
	// large ones: a linear scan of every key is quadratic, and a body of
	// 50,000 short keys (under 0.5 MB) would take seconds to parse. The
	// first duplicate is reported only once the whole body is known to be
	// valid JSON: invalid JSON is ErrInvalid, whatever its keys.
	var seen map[string]struct{}
	var dup error
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		i++
	} else {
		for {
			if i >= len(b) || b[i] != '"' {
				return Object{}, ErrInvalid
			}
			keyEnd, plain, ok := scanString(b, i)
			if !ok {
				return Object{}, ErrInvalid
			}
			m := member{start: i, keyEnd: keyEnd - 1}
			i = skipSpace(b, keyEnd)
			if i >= len(b) || b[i] != ':' {
				return Object{}, ErrInvalid
			}
			i = skipSpace(b, i+1)
			if i >= len(b) {
				return Object{}, ErrInvalid
			}
			m.valueStart = i
			if i, ok = scanValue(b, i, &stack, maxDepth-1); !ok {
				return Object{}, ErrInvalid
			}
			m.end = i
			if dup == nil {
				if !plain || !utf8.Valid(b[m.start+1:m.keyEnd]) {
					m.key = unquote(b[m.start:keyEnd])
					m.keyEnd = -1
				}
				dup = o.addUnique(m, &seen)
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return Object{}, ErrInvalid
			}
			if b[i] == '}' {
				i++
				break
			}
			if b[i] != ',' {
				return Object{}, ErrInvalid
			}
			i = skipSpace(b, i+1)
		}
	}
	if skipSpace(b, i) != len(b) {
		return Object{}, ErrInvalid
	}
	if dup != nil {
		return Object{}, dup
	}
	return o, nil
}

// addUnique adds m unless its key is taken, which it reports as a
// *DuplicateKeyError.
func (o *Object) addUnique(m member, seen *map[string]struct{}) error {
	if *seen == nil && o.n == maxLinearMembers {
		*seen = make(map[string]struct{}, 2*maxLinearMembers)
		for _, p := range o.list() {
			(*seen)[o.keyString(&p)] = struct{}{}
		}
	}
	if *seen != nil {
		var taken bool
		if m.keyEnd < 0 {
			_, taken = (*seen)[m.key]
		} else {
			_, taken = (*seen)[string(o.src[m.start+1:m.keyEnd])]
		}
		if taken {
			return &DuplicateKeyError{Key: o.keyString(&m)}
		}
		(*seen)[o.keyString(&m)] = struct{}{}
	} else {
		for _, p := range o.list() {
			if o.sameKey(&p, &m) {
				return &DuplicateKeyError{Key: o.keyString(&m)}
			}
		}
	}
	o.add(m)
	return nil
}

// Len reports the number of members.
func (o Object) Len() int { return o.n }

// Raw returns the bytes of the value of key, as written.
func (o Object) Raw(key string) ([]byte, bool) {
	m, ok := o.find(key)
	if !ok {
		return nil, false
	}
	return o.src[m.valueStart:m.end], true
}

// Has reports whether key is present (with any value, null included).
func (o Object) Has(key string) bool {
	_, ok := o.find(key)
	return ok
}

// Keys returns the keys in document order.
func (o Object) Keys() []string {
	ms := o.list()
	keys := make([]string, len(ms))
	for i := range ms {
		keys[i] = o.keyString(&ms[i])
	}
	return keys
}

func (o *Object) find(key string) (member, bool) {
	ms := o.list()
	for i := range ms {
		if o.keyIs(&ms[i], key) {
			return ms[i], true
		}
	}
	return member{}, false
}

// Edit changes one top-level member. A nil Value deletes the member; any
// other Value (which must be valid JSON) replaces it in place or, if the key
// is absent, is appended at the end.
//
// Key is the unescaped key, valid UTF-8, as Keys returns it.
type Edit struct {
	Key   string
	Value []byte
}

// Delete returns an Edit that removes key.
func Delete(key string) Edit { return Edit{Key: key} }

// Set returns an Edit that sets key to the JSON value v.
func Set(key string, v []byte) Edit { return Edit{Key: key, Value: v} }

// AppendEdited appends to dst the object with edits applied and returns the
// extended buffer. Untouched members keep their exact bytes; whitespace
// between members is dropped. Later edits of the same key win.
func (o Object) AppendEdited(dst []byte, edits ...Edit) []byte {
	var buf [inlinePieces][]byte
	pieces := o.editedPieces(buf[:0], edits)
	n := len(dst)
	for _, p := range pieces {
		n += len(p)
	}
	dst = slices.Grow(dst, n-len(dst))
	for _, p := range pieces {
		dst = append(dst, p...)
	}
	return dst
}

// Edited returns the object with edits applied, as AppendEdited writes it,
// in a new buffer of exactly its length. It allocates once and (unlike
// make) does not clear the buffer before filling it, which for bodies of
// megabytes is a good part of the work.
func (o Object) Edited(edits ...Edit) []byte {
	var buf [inlinePieces][]byte
	return bytes.Join(o.editedPieces(buf[:0], edits), nil)
}

// EditedPieces appends to dst the byte slices whose concatenation is the
// object with edits applied, as AppendEdited writes it, without copying the
// object: the pieces point into its bytes, the edits' keys and values, and
// fixed punctuation. They must only be read, and only while those live. A
// body sent this way (net.Buffers) costs no copy of its own.
func (o Object) EditedPieces(dst [][]byte, edits ...Edit) [][]byte {
	// Braces, and at most three pieces per member (comma, key, new value)
	// and five per added member (comma, quotes and colon, key, value).
	n := 3*o.n + 2
	for _, e := range edits {
		if e.Value != nil {
			n += 5
		}
	}
	dst = slices.Grow(dst, n)
	return o.editedPieces(dst, edits)
}

// inlinePieces sizes the stack buffer of AppendEdited and Edited: enough
// for the objects pdx edits without allocating.
const inlinePieces = 3*inlineMembers + 5*8 + 2

// editedPieces appends to pieces the byte slices whose concatenation is the
// edited object. They point into o's bytes, the edits' keys and values, and
// fixed punctuation: the caller must only read them.
func (o *Object) editedPieces(pieces [][]byte, edits []Edit) [][]byte {
	pieces = append(pieces, openBrace)
	first := true
	ms := o.list()
	for i := range ms {
		m := &ms[i]
		e := -1
		for j := len(edits) - 1; j >= 0; j-- {
			if o.keyIs(m, edits[j].Key) {
				e = j
				break
			}
		}
		switch {
		case e < 0:
			if !first {
				pieces = append(pieces, comma)
			}
			first = false
			pieces = append(pieces, o.src[m.start:m.end])
		case edits[e].Value != nil:
			if !first {
				pieces = append(pieces, comma)
			}
			first = false
			// The key as written and the colon, then the new value.
			pieces = append(pieces, o.src[m.start:m.valueStart], edits[e].Value)
		}
	}
	for i, e := range edits {
		if e.Value == nil || o.Has(e.Key) || laterEdit(edits[i+1:], e.Key) {
			continue
		}
		if !first {
			pieces = append(pieces, comma)
		}
		first = false
		if plainKey(e.Key) {
			// A read-only view of the key's bytes: nothing writes to
			// pieces, and building a []byte of it would allocate.
			pieces = append(pieces, quote, unsafe.Slice(unsafe.StringData(e.Key), len(e.Key)), quoteColon, e.Value)
		} else {
			pieces = append(pieces, appendKey(nil, e.Key), colon, e.Value)
		}
	}
	return append(pieces, closeBrace)
}

// The punctuation pieces of editedPieces, never written.
var (
	openBrace  = []byte("{")
	comma      = []byte(",")
	closeBrace = []byte("}")
	quote      = []byte(`"`)
	quoteColon = []byte(`":`)
	colon      = []byte(":")
)

// EditedLen is an upper bound of the length AppendEdited produces, for sizing
// the destination buffer once.
func (o Object) EditedLen(edits ...Edit) int {
	n := len(o.src) + 2
	for _, e := range edits {
		k := len(e.Key)
		if !plainKey(e.Key) {
			k *= 6 // at worst every byte is written as \u00XX
		}
		n += k + len(e.Value) + 4
	}
	return n
}

// appendKey appends key as a JSON string. (strconv.Quote is not JSON: it
// writes \x00 and \a.)
func appendKey(dst []byte, key string) []byte {
	if plainKey(key) {
		dst = append(dst, '"')
		dst = append(dst, key...)
		return append(dst, '"')
	}
	quoted, _ := json.Marshal(key) // a string always marshals
	return append(dst, quoted...)
}

// plainKey reports whether key is printable ASCII that needs no escape.
func plainKey(key string) bool {
	for i := range len(key) {
		if c := key[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' {
			return false
		}
	}
	return true
}

func laterEdit(edits []Edit, key string) bool {
	for i := range edits {
		if edits[i].Key == key {
			return true
		}
	}
	return false
}

// unquote decodes a valid JSON string token. Keys are compared unescaped so
// that "kv_transfer_param\u0073" is seen as the key it means, and with
// invalid UTF-8 replaced by U+FFFD, as encoding/json decodes them (JSON
// validation lets such bytes through): otherwise "a\xff" and "a\ufffd" would
// be two keys to pdx and one to a parser that replaces.
func unquote(tok []byte) string {
	var s string
	if err := json.Unmarshal(tok, &s); err != nil {
		// Unreachable: Parse validated the token.
		panic("jsonedit: decoding the validated key " + string(tok) + ": " + err.Error())
	}
	return s
}

func skipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// stringStop marks the bytes that end a run of plain string content: the
// quote, the backslash and the control characters, which JSON strings must
// escape. Bytes from 0x80 pass: encoding/json accepts invalid UTF-8 in
// strings too (and replaces it when decoding).
var stringStop = func() (t [256]bool) {
	for c := range 0x20 {
		t[c] = true
	}
	t['"'] = true
	t['\\'] = true
	return t
}()

// shortRun is how far scanString looks byte by byte (eight at a time) for
// the end of a run before it hands the run to bytes.IndexByte.
const shortRun = 64

// scanString validates the string starting at b[i] == '"' and returns the
// index just past its closing quote, and whether it has no escapes.
//
// Short runs between escapes are scanned eight bytes at a time. Long ones
// are searched with bytes.IndexByte (vectorized) for the next quote and,
// up to it, the next backslash, then checked for control characters. Every
// byte is looked at a bounded number of times: the search for a backslash
// stops at the next quote, and the next quote is searched for again only
// once an escaped quote has been passed.
func scanString(b []byte, i int) (end int, plain bool, ok bool) {
	plain = true
	i++
	q := -1 // the next quote at or after i, once searched for
	for {
		lim := min(i+shortRun, len(b))
		for i+8 <= lim {
			x := binary.LittleEndian.Uint64(b[i:])
			dq := x ^ ('"' * lsb)
			bs := x ^ ('\\' * lsb)
			if m := ((dq-lsb)&^dq | (bs-lsb)&^bs | (x-0x20*lsb)&^x) & msb; m != 0 {
				// The lowest marked byte is a true stop (a false mark can
				// only sit above a true one).
				i += bits.TrailingZeros64(m) >> 3
				break
			}
			i += 8
		}
		for i < lim && !stringStop[b[i]] {
			i++
		}
		if i == lim && lim < len(b) {
			// A long run: find its end with IndexByte.
			if q < i {
				q = bytes.IndexByte(b[i:], '"')
				if q < 0 {
					return 0, false, false
				}
				q += i
			}
			p := bytes.IndexByte(b[i:q], '\\')
			if p < 0 {
				p = q
			} else {
				p += i
			}
			if !controlFree(b[i:p]) {
				return 0, false, false
			}
			i = p
		}
		if i >= len(b) {
			return 0, false, false
		}
		switch c := b[i]; {
		case c == '"':
			return i + 1, plain, true
		case c == '\\':
			plain = false
			if i+1 >= len(b) {
				return 0, false, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) {
					return 0, false, false
				}
				for _, h := range b[i+2 : i+6] {
					if !isHex(h) {
						return 0, false, false
					}
				}
				i += 6
			default:
				return 0, false, false
			}
		default: // a control character
			return 0, false, false
		}
	}
}

// controlFree reports whether s has no byte below 0x20.
func controlFree(s []byte) bool {
	const k = 0x20 * lsb
	// A byte of x is below 0x20 when it borrows in x-k without having its
	// top bit set; the test is exact for "any byte" (a false hit can only
	// sit above a true one).
	for len(s) >= 32 {
		x0 := binary.LittleEndian.Uint64(s)
		x1 := binary.LittleEndian.Uint64(s[8:])
		x2 := binary.LittleEndian.Uint64(s[16:])
		x3 := binary.LittleEndian.Uint64(s[24:])
		if ((x0-k)&^x0|(x1-k)&^x1|(x2-k)&^x2|(x3-k)&^x3)&msb != 0 {
			return false
		}
		s = s[32:]
	}
	for len(s) >= 8 {
		x := binary.LittleEndian.Uint64(s)
		if (x-k)&^x&msb != 0 {
			return false
		}
		s = s[8:]
	}
	for _, c := range s {
		if c < 0x20 {
			return false
		}
	}
	return true
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// scanNumber validates the number starting at b[i] and returns the index
// just past it.
func scanNumber(b []byte, i int) (int, bool) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b):
		return 0, false
	case b[i] == '0':
		i++
	case '1' <= b[i] && b[i] <= '9':
		i = skipDigits(b, i+1)
	default:
		return 0, false
	}
	if i < len(b) && b[i] == '.' {
		j := skipDigits(b, i+1)
		if j == i+1 {
			return 0, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := skipDigits(b, i)
		if j == i {
			return 0, false
		}
		i = j
	}
	return i, true
}

func skipDigits(b []byte, i int) int {
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	return i
}

// scanLiteral validates that b[i:] starts with lit and returns the index
// just past it.
func scanLiteral(b []byte, i int, lit string) (int, bool) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return 0, false
	}
	return i + len(lit), true
}

// nesting records, one bit per level, whether each open container is an
// object (1) or an array (0).
type nesting [(maxDepth + 63) / 64]uint64

func (s *nesting) set(depth int, object bool) {
	if object {
		s[depth/64] |= 1 << (depth % 64)
	} else {
		s[depth/64] &^= 1 << (depth % 64)
	}
}

func (s *nesting) object(depth int) bool { return s[depth/64]&(1<<(depth%64)) != 0 }

// scanValue validates the JSON value starting at b[i] (not whitespace),
// iteratively, and returns the index just past it. The value may nest at
// most room arrays and objects.
func scanValue(b []byte, i int, stack *nesting, room int) (int, bool) {
	depth := 0 // containers open inside the value
	var ok bool
	for {
		// A value starts at b[i].
		if i >= len(b) {
			return 0, false
		}
		switch c := b[i]; c {
		case '"':
			if i, _, ok = scanString(b, i); !ok {
				return 0, false
			}
		case '{', '[':
			if depth >= room {
				return 0, false
			}
			stack.set(depth, c == '{')
			depth++
			i = skipSpace(b, i+1)
			if i < len(b) && (c == '{' && b[i] == '}' || c == '[' && b[i] == ']') {
				i++
				depth--
				break
			}
			if c == '{' {
				if i, ok = scanKey(b, i); !ok {
					return 0, false
				}
			}
			continue
		case 't':
			if i, ok = scanLiteral(b, i, "true"); !ok {
				return 0, false
			}
		case 'f':
			if i, ok = scanLiteral(b, i, "false"); !ok {
				return 0, false
			}
		case 'n':
			if i, ok = scanLiteral(b, i, "null"); !ok {
				return 0, false
			}
		default:
			if c != '-' && (c < '0' || c > '9') {
				return 0, false
			}
			if i, ok = scanNumber(b, i); !ok {
				return 0, false
			}
		}
		// A value ended just before b[i]: close containers until one
		// continues with a comma.
		for {
			if depth == 0 {
				return i, true
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return 0, false
			}
			object := stack.object(depth - 1)
			if c := b[i]; object && c == '}' || !object && c == ']' {
				i++
				depth--
				continue
			} else if c != ',' {
				return 0, false
			}
			i = skipSpace(b, i+1)
			if object {
				if i, ok = scanKey(b, i); !ok {
					return 0, false
				}
			}
			break
		}
	}
}

// scanKey validates a member's key and colon starting at b[i], and returns
// the index of its value (whitespace skipped).
func scanKey(b []byte, i int) (int, bool) {
	if i >= len(b) || b[i] != '"' {
		return 0, false
	}
	i, _, ok := scanString(b, i)
	if !ok {
		return 0, false
	}
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return 0, false
	}
	return skipSpace(b, i+1), true
}
