package jsonedit

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"testing"
	"unicode/utf8"
)

// FuzzParseAppendEdited checks Parse against encoding/json (an independent
// reading of the same bytes) and AppendEdited against a model of its
// contract: edited keys once with their value (or gone), every other member
// with its exact bytes in its order, appended keys at the end, the output
// valid JSON without duplicate keys.
//
// Run it with: go test -run '^$' -fuzz '^FuzzParseAppendEdited$' ./internal/jsonedit/
func FuzzParseAppendEdited(f *testing.F) {
	for _, s := range []struct {
		in, key, value string
		replace, del   uint8
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, "kv_transfer_params", `{"do_remote_decode":true}`, 2, 0},
		{`{"model":"m","prompt":"once upon","max_tokens":16}`, "max_tokens", `1`, 1, 2},
		{`{}`, "bootstrap_room", `9223372036854775807`, 0, 0},
		{` { "a" : 1.50 , "b":[1, 2] } `, "c", `null`, 1, 1},
		{`{"kv_transfer_param\u0073":{"x":1},"strea\u006d":true}`, "kv_transfer_params", `{"y":2}`, 1, 0},
		{`{"room":18446744073709551615,"x":1e400,"n":-0.0e-7}`, "new", `"s"`, 0, 1},
		{`{"o":{"a":{"b":[{"c":"]}\""}]}},"s":"\u00e9\ud83d\ude00"}`, "o", `{}`, 1, 0},
		{`{"model":"a","mod\u0065l":"b"}`, "model", `1`, 0, 0},
		{`[1,2]`, "k", `1`, 0, 0},
		{`{"a":}`, "k", `1`, 0, 0},
		{"{\"a\xff\":1,\"a\\ufffd\":2}", "a\uFFFD", `true`, 1, 0},
		{`{"a":1}`, "ctl\x00\a\x7f\u2028<&>\"\\", `1`, 0, 0},
	} {
		f.Add([]byte(s.in), s.key, []byte(s.value), s.replace, s.del)
	}
	f.Fuzz(func(t *testing.T, in []byte, newKey string, value []byte, replace, del uint8) {
		o, err := Parse(in)
		checkParse(t, in, o, err)
		if err != nil {
			return
		}
		// An Edit's key is a Go string compared with unescaped keys, so
		// it must be valid UTF-8; its value must be valid JSON.
		if !utf8.ValidString(newKey) {
			return
		}
		value = bytes.TrimSpace(value)
		if !json.Valid(value) {
			value, _ = json.Marshal(string(value))
		}
		edits := []Edit{Set(newKey, value)}
		if keys := o.Keys(); len(keys) > 0 {
			edits = append(edits,
				Set(keys[int(replace)%len(keys)], []byte(`["replaced",{"by":"fuzz"}]`)),
				Delete(keys[int(del)%len(keys)]))
		}
		out := o.AppendEdited(nil, edits...)
		if len(out) > o.EditedLen(edits...) {
			t.Fatalf("AppendEdited wrote %d bytes, EditedLen promised at most %d: %q", len(out), o.EditedLen(edits...), out)
		}
		// Appending to a non-empty buffer leaves the buffer's bytes alone.
		if prefixed := o.AppendEdited([]byte("prefix"), edits...); string(prefixed) != "prefix"+string(out) {
			t.Fatalf("AppendEdited to a buffer: %q, want %q", prefixed, "prefix"+string(out))
		}
		if joined := bytes.Join(o.EditedPieces(nil, edits...), nil); !bytes.Equal(joined, out) {
			t.Fatalf("EditedPieces joined: %q, want %q", joined, out)
		}
		want := editModel(o, edits)
		got, err := members(out)
		if err != nil {
			t.Fatalf("output %q of input %q edits %q: %v", out, in, edits, err)
		}
		if !slices.EqualFunc(got, want, func(a, b rawMember) bool { return a.key == b.key && bytes.Equal(a.raw, b.raw) }) {
			t.Fatalf("output %q of input %q edits %q:\n got %q\nwant %q", out, in, edits, got, want)
		}
		po, err := Parse(out)
		if err != nil {
			t.Fatalf("Parse of output %q: %v", out, err)
		}
		checkParse(t, out, po, nil)
	})
}

// checkParse compares Parse's result (o, err) for in with encoding/json's
// reading of in.
func checkParse(t *testing.T, in []byte, o Object, err error) {
	t.Helper()
	want, werr := members(in)
	if err == nil {
		if !json.Valid(in) {
			t.Fatalf("Parse accepted invalid JSON %q", in)
		}
		if werr != nil {
			t.Fatalf("Parse accepted %q; encoding/json: %v", in, werr)
		}
		if o.Len() != len(want) || !slices.Equal(o.Keys(), keysOf(want)) {
			t.Fatalf("Parse(%q) keys %q, encoding/json reads %q", in, o.Keys(), keysOf(want))
		}
		for _, m := range want {
			raw, ok := o.Raw(m.key)
			if !ok || !bytes.Equal(raw, m.raw) || !o.Has(m.key) {
				t.Fatalf("Parse(%q).Raw(%q) = %q, %v; encoding/json reads %q", in, m.key, raw, ok, m.raw)
			}
		}
		return
	}
	var dup *DuplicateKeyError
	switch {
	case errors.Is(err, ErrInvalid):
		if json.Valid(in) {
			t.Fatalf("Parse(%q) = %v for valid JSON", in, err)
		}
	case errors.Is(err, ErrNotObject):
		if !errors.Is(werr, ErrNotObject) {
			t.Fatalf("Parse(%q) = %v; encoding/json: %v", in, err, werr)
		}
	case errors.As(err, &dup):
		if !errors.As(werr, new(*DuplicateKeyError)) {
			t.Fatalf("Parse(%q) = %v; encoding/json: %v", in, err, werr)
		}
	default:
		t.Fatalf("Parse(%q) = unexpected error %v", in, err)
	}
}

// rawMember is a top-level member as encoding/json reads it: the unescaped
// key and the value's bytes.
type rawMember struct {
	key string
	raw []byte
}

func keysOf(ms []rawMember) []string {
	keys := make([]string, len(ms))
	for i, m := range ms {
		keys[i] = m.key
	}
	return keys
}

// members reads the top-level members of b with encoding/json, returning
// the same errors Parse would.
func members(b []byte) ([]rawMember, error) {
	if !json.Valid(b) {
		return nil, ErrInvalid
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber() // a top-level 1e400 is valid JSON, not a float64
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if tok != json.Delim('{') {
		return nil, ErrNotObject
	}
	ms := []rawMember{}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		if seen[key] {
			return nil, &DuplicateKeyError{Key: key}
		}
		seen[key] = true
		ms = append(ms, rawMember{key: key, raw: raw})
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, errors.New("object does not end")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("data after the object")
	}
	return ms, nil
}

// editModel returns the members AppendEdited must write: o's members in
// order, each replaced by its last edit's value or dropped by it, then the
// keys o lacks in the order of their last edits.
func editModel(o Object, edits []Edit) []rawMember {
	var out []rawMember
	for _, key := range o.Keys() {
		raw, _ := o.Raw(key)
		if i := lastIndex(edits, key); i >= 0 {
			if edits[i].Value == nil {
				continue
			}
			raw = edits[i].Value
		}
		out = append(out, rawMember{key: key, raw: raw})
	}
	for i, e := range edits {
		if e.Value == nil || o.Has(e.Key) || lastIndex(edits, e.Key) != i {
			continue
		}
		out = append(out, rawMember{key: e.Key, raw: e.Value})
	}
	return out
}

func lastIndex(edits []Edit, key string) int {
	for i := len(edits) - 1; i >= 0; i-- {
		if edits[i].Key == key {
			return i
		}
	}
	return -1
}
