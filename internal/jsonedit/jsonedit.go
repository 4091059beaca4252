// Package jsonedit parses the top level of a JSON object and writes edited
// copies of it without re-encoding: every member pdx does not touch keeps its
// bytes, so key order, number text and string escapes reach the engine as the
// client wrote them. Engines that tokenize what they get (SGLang, TensorRT-LLM)
// and integers above 2^53 (bootstrap_room) depend on that.
package jsonedit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"
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
type Object struct {
	src     []byte
	members []member
}

type member struct {
	key        string
	start      int // first byte of the key's opening quote
	valueStart int
	end        int // one past the value's last byte
}

// maxLinearMembers is the number of members up to which Parse finds
// duplicate keys without a set.
const maxLinearMembers = 32

// Parse validates b and indexes the members of its top-level object.
func Parse(b []byte) (Object, error) {
	if !json.Valid(b) {
		return Object{}, ErrInvalid
	}
	i := skipSpace(b, 0)
	if b[i] != '{' {
		return Object{}, ErrNotObject
	}
	i = skipSpace(b, i+1)
	o := Object{src: b, members: make([]member, 0, 16)}
	// Duplicates are looked up linearly in small objects and in a set in
	// large ones: a linear scan of every key is quadratic, and a body of
	// 50,000 short keys (under 0.5 MB) would take seconds to parse.
	var seen map[string]struct{}
	for b[i] != '}' {
		keyEnd := skipString(b, i)
		key, err := unquote(b[i:keyEnd])
		if err != nil {
			return Object{}, err
		}
		if seen == nil && len(o.members) == maxLinearMembers {
			seen = make(map[string]struct{}, 2*maxLinearMembers)
			for _, m := range o.members {
				seen[m.key] = struct{}{}
			}
		}
		dup := false
		if seen != nil {
			_, dup = seen[key]
			seen[key] = struct{}{}
		} else {
			_, dup = o.find(key)
		}
		if dup {
			return Object{}, &DuplicateKeyError{Key: key}
		}
		vs := skipSpace(b, skipSpace(b, keyEnd)+1) // past the colon
		ve := skipValue(b, vs)
		o.members = append(o.members, member{key: key, start: i, valueStart: vs, end: ve})
		i = skipSpace(b, ve)
		if b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return o, nil
}

// Len reports the number of members.
func (o Object) Len() int { return len(o.members) }

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
	keys := make([]string, len(o.members))
	for i, m := range o.members {
		keys[i] = m.key
	}
	return keys
}

func (o Object) find(key string) (member, bool) {
	for _, m := range o.members {
		if m.key == key {
			return m, true
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
	dst = append(dst, '{')
	first := true
	sep := func() {
		if !first {
			dst = append(dst, ',')
		}
		first = false
	}
	for _, m := range o.members {
		e, edited := lastEdit(edits, m.key)
		switch {
		case !edited:
			sep()
			dst = append(dst, o.src[m.start:m.end]...)
		case e.Value != nil:
			sep()
			dst = append(dst, o.src[m.start:m.valueStart]...) // key as written, colon
			dst = append(dst, e.Value...)
		}
	}
	for i, e := range edits {
		if e.Value == nil || o.Has(e.Key) || laterEdit(edits[i+1:], e.Key) {
			continue
		}
		sep()
		dst = appendKey(dst, e.Key)
		dst = append(dst, ':')
		dst = append(dst, e.Value...)
	}
	return append(dst, '}')
}

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

func lastEdit(edits []Edit, key string) (Edit, bool) {
	for i := len(edits) - 1; i >= 0; i-- {
		if edits[i].Key == key {
			return edits[i], true
		}
	}
	return Edit{}, false
}

func laterEdit(edits []Edit, key string) bool {
	_, ok := lastEdit(edits, key)
	return ok
}

// unquote decodes a JSON string token. Keys are compared unescaped so that
// "kv_transfer_param\u0073" is seen as the key it means, and with invalid
// UTF-8 replaced by U+FFFD, as encoding/json decodes them (json.Valid lets
// such bytes through): otherwise "a\xff" and "a\ufffd" would be two keys to
// pdx and one to a parser that replaces.
func unquote(tok []byte) (string, error) {
	if bytes.IndexByte(tok, '\\') < 0 && utf8.Valid(tok) {
		return string(tok[1 : len(tok)-1]), nil
	}
	var s string
	if err := json.Unmarshal(tok, &s); err != nil {
		return "", fmt.Errorf("%w: bad object key %s", ErrInvalid, tok)
	}
	return s, nil
}

// The skip functions below assume b is valid JSON (Parse checked it).

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

// skipString returns the index just past the string starting at b[i] == '"'.
func skipString(b []byte, i int) int {
	i++
	for {
		j := bytes.IndexAny(b[i:], `"\`)
		i += j
		if b[i] == '"' {
			return i + 1
		}
		i += 2 // backslash and the escaped byte
	}
}

// skipValue returns the index just past the value starting at b[i].
func skipValue(b []byte, i int) int {
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
	default: // number, true, false, null
		for i < len(b) {
			switch b[i] {
			case ',', '}', ']', ' ', '\t', '\n', '\r':
				return i
			}
			i++
		}
		return i
	}
}
