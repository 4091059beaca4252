package jsonedit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		keys    []string
		wantErr string
	}{
		{name: "empty object", in: ` { } `, keys: []string{}},
		{name: "order kept", in: `{"z":1,"a":{"b":[1,"]}"]},"m":"x\"y"}`, keys: []string{"z", "a", "m"}},
		{name: "escaped key unescaped", in: `{"kv_transfer_param\u0073":1}`, keys: []string{"kv_transfer_params"}},
		{name: "whitespace everywhere", in: "\n{\t\"a\" :\n 1 , \"b\":true\r}\n", keys: []string{"a", "b"}},
		{name: "invalid", in: `{"a":}`, wantErr: "not valid JSON"},
		{name: "truncated", in: `{"a":1`, wantErr: "not valid JSON"},
		{name: "array", in: `[1,2]`, wantErr: "not an object"},
		{name: "string", in: `"{}"`, wantErr: "not an object"},
		{name: "duplicate", in: `{"model":"a","model":"b"}`, wantErr: `"model" more than once`},
		{name: "duplicate via escape", in: `{"model":"a","mod\u0065l":"b"}`, wantErr: `"model" more than once`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o, err := Parse([]byte(tc.in))
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.keys, o.Keys())
		})
	}
}

func TestRaw(t *testing.T) {
	o, err := Parse([]byte(`{"room": 18446744073709551615 ,"n":null,"s":"a\u00e9", "o":{"x":[1, 2]}}`))
	require.NoError(t, err)
	for key, want := range map[string]string{
		"room": "18446744073709551615",
		"n":    "null",
		"s":    `"a\u00e9"`,
		"o":    `{"x":[1, 2]}`,
	} {
		got, ok := o.Raw(key)
		require.True(t, ok, key)
		require.Equal(t, want, string(got), key)
	}
	_, ok := o.Raw("missing")
	require.False(t, ok)
	require.True(t, o.Has("n"))
}

func TestAppendEdited(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		edits []Edit
		want  string
	}{
		{name: "no edits compacts only between members", in: `{ "a" : 1.50 , "b":[1, 2] }`, want: `{"a" : 1.50,"b":[1, 2]}`},
		{name: "replace in place", in: `{"a":1,"b":2,"c":3}`, edits: []Edit{Set("b", []byte(`false`))}, want: `{"a":1,"b":false,"c":3}`},
		{name: "delete first", in: `{"a":1,"b":2}`, edits: []Edit{Delete("a")}, want: `{"b":2}`},
		{name: "delete last", in: `{"a":1,"b":2}`, edits: []Edit{Delete("b")}, want: `{"a":1}`},
		{name: "delete absent", in: `{"a":1}`, edits: []Edit{Delete("z")}, want: `{"a":1}`},
		{name: "append", in: `{"a":1}`, edits: []Edit{Set("z", []byte(`{"k":null}`))}, want: `{"a":1,"z":{"k":null}}`},
		{name: "append to empty", in: `{}`, edits: []Edit{Set("z", []byte(`1`))}, want: `{"z":1}`},
		{name: "delete all", in: `{"a":1}`, edits: []Edit{Delete("a")}, want: `{}`},
		{name: "later edit wins", in: `{"a":1}`, edits: []Edit{Set("a", []byte(`2`)), Delete("a")}, want: `{}`},
		{name: "later append wins", in: `{}`, edits: []Edit{Set("z", []byte(`1`)), Set("z", []byte(`2`))}, want: `{"z":2}`},
		{name: "escaped key replaced", in: `{"strea\u006d":true}`, edits: []Edit{Set("stream", []byte(`false`))}, want: `{"strea\u006d":false}`},
		{name: "big integer kept", in: `{"room":9223372036854775807,"x":1e400}`, edits: []Edit{Delete("x")}, want: `{"room":9223372036854775807}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o, err := Parse([]byte(tc.in))
			require.NoError(t, err)
			got := o.AppendEdited(nil, tc.edits...)
			require.Equal(t, tc.want, string(got))
			require.LessOrEqual(t, len(got), o.EditedLen(tc.edits...))
			_, err = Parse(got)
			require.NoError(t, err)
		})
	}
}

// TestParseManyKeys covers objects past maxLinearMembers, where duplicates
// are found with a set: a linear scan per key made Parse quadratic (a body
// of 40,000 short keys, 430 kB, took 2.5 s).
func TestParseManyKeys(t *testing.T) {
	body := func(n int, extra string) []byte {
		b := []byte("{")
		for i := range n {
			if i > 0 {
				b = append(b, ',')
			}
			b = fmt.Appendf(b, `"k%d":%d`, i, i)
		}
		return append(append(b, extra...), '}')
	}
	o, err := Parse(body(20000, ""))
	require.NoError(t, err)
	require.Equal(t, 20000, o.Len())
	raw, ok := o.Raw("k19999")
	require.True(t, ok)
	require.Equal(t, "19999", string(raw))

	for _, n := range []int{maxLinearMembers - 1, maxLinearMembers, maxLinearMembers + 1, 1000} {
		_, err = Parse(body(n, `,"k0":0`))
		require.ErrorContains(t, err, `"k0" more than once`, n)
		_, err = Parse(body(n, fmt.Sprintf(`,"\u006b%d":0`, n-1)))
		require.ErrorContains(t, err, fmt.Sprintf(`"k%d" more than once`, n-1), n)
	}
}

func TestAppendEditedNewKeyIsJSON(t *testing.T) {
	o, err := Parse([]byte(`{}`))
	require.NoError(t, err)
	edits := []Edit{Set("a\x00\a\"\\\u2028é", []byte(`1`))}
	got := o.AppendEdited(nil, edits...)
	require.LessOrEqual(t, len(got), o.EditedLen(edits...))
	back, err := Parse(got)
	require.NoError(t, err, "%q", got)
	require.Equal(t, []string{edits[0].Key}, back.Keys())
}

// TestParseAgreesWithValid compares Parse's validation with encoding/json's
// on inputs that exercise each part of the scanner.
func TestParseAgreesWithValid(t *testing.T) {
	deep := func(n int, open, close string) string {
		return `{"a":` + strings.Repeat(open, n-1) + strings.Repeat(close, n-1) + `}`
	}
	inputs := []string{
		``, ` `, `{`, `}`, `{"a"}`, `{"a":1,}`, `{,}`, `{"a":1 "b":2}`, `{"a":1}x`, `{"a":1} `, `{"a":1}{}`,
		`{"a":[1,]}`, `{"a":[,1]}`, `{"a":[1 2]}`, `{"a":[]}`, `{"a":[ ]}`, `{"a":{ }}`, `{"a":{"b":}}`, `{"a":{"b" 1}}`,
		`{"a":{"b":1,}}`, `{"a":[{}]}`, `{"a":[[[]]]}`, `{"a":[}`, `{"a":{]}`, `{"a":[1}]}`,
		`{"a":-}`, `{"a":-0}`, `{"a":01}`, `{"a":1.}`, `{"a":.5}`, `{"a":1e}`, `{"a":1e+}`, `{"a":1E-2}`, `{"a":1.5e10}`,
		`{"a":-01}`, `{"a":+1}`, `{"a":0x1}`, `{"a":1.2.3}`, `{"a":NaN}`, `{"a":Infinity}`,
		`{"a":tru}`, `{"a":true}`, `{"a":trueee}`, `{"a":nul}`, `{"a":null}`, `{"a":false}`, `{"a":fals}`,
		`{"a":"\u12"}`, `{"a":"\u12g4"}`, `{"a":"\uABCD"}`, `{"a":"\x"}`, `{"a":"\/\b\f\n\r\t\"\\"}`, `{"a":"\'"}`,
		"{\"a\":\"\x01\"}", "{\"a\":\"\x7f\"}", "{\"a\":\"\xff\xfe\"}", "{\"a\":\"é\"}", "{\"a\":\"\t\"}",
		`{"a":"0123456789abcdef0123456789abcdef"}`, `{"a":"0123456789abcdef0123456789abcde\"f"}`,
		"{\"a\":\"0123456789abcdef0123456789abcde\x1ff\"}", `{"a":"0123456789abcdef0123456789abcde\\f"}`,
		`{"a":"unterminated0123456789`, `{"a":"unterminated\`, `{"a":"\u`, `"abc"`, `1`, `[1]`, ` [1,{"a":2}] `, `[1`,
		"{\"a\"\n:\r1\t}", "\v{}", "{}\x00", `{"a":1}` + "\xa0",
		deep(maxDepth, "[", "]"), deep(maxDepth+1, "[", "]"), deep(maxDepth-1, "[", "]"),
		strings.Repeat("[", maxDepth) + strings.Repeat("]", maxDepth),
		strings.Repeat("[", maxDepth+1) + strings.Repeat("]", maxDepth+1),
	}
	for _, in := range inputs {
		_, err := Parse([]byte(in))
		valid := json.Valid([]byte(in))
		if errors.Is(err, ErrInvalid) == valid {
			t.Errorf("Parse(%.60q) = %v; json.Valid = %v", in, err, valid)
		}
	}
}

// TestParseInvalidBeforeDuplicate keeps ErrInvalid ahead of a duplicate key
// found earlier in an invalid body, as when Parse validated first.
func TestParseInvalidBeforeDuplicate(t *testing.T) {
	_, err := Parse([]byte(`{"a":1,"a":2,"b":}`))
	require.ErrorIs(t, err, ErrInvalid)
	_, err = Parse([]byte(`{"a":1,"a":2,"b":3}`))
	require.ErrorAs(t, err, new(*DuplicateKeyError))
}

// TestParseManyMembersInline covers objects around the inline capacity.
func TestParseManyMembersInline(t *testing.T) {
	for n := inlineMembers - 1; n <= inlineMembers+2; n++ {
		b := []byte("{")
		for i := range n {
			if i > 0 {
				b = append(b, ',')
			}
			b = fmt.Appendf(b, `"k\u0030%d":"v%d"`, i, i)
		}
		b = append(b, '}')
		o, err := Parse(b)
		require.NoError(t, err)
		require.Equal(t, n, o.Len())
		for i := range n {
			raw, ok := o.Raw(fmt.Sprintf("k0%d", i))
			require.True(t, ok)
			require.Equal(t, fmt.Sprintf(`"v%d"`, i), string(raw))
		}
		o2, err := Parse(o.AppendEdited(nil, Delete("k00")))
		require.NoError(t, err)
		require.Equal(t, n-1, o2.Len())
	}
}

// TestEditedMatchesAppendEdited checks that Edited writes what AppendEdited
// appends, at its exact length, and EditedPieces joins to it.
func TestEditedMatchesAppendEdited(t *testing.T) {
	for _, tc := range []struct {
		in    string
		edits []Edit
	}{
		{`{}`, nil},
		{` { "a" : 1.50 , "b":[1, 2] } `, []Edit{Delete("a"), Set("c", []byte(`{"x":1}`))}},
		{`{"strea\u006d":true,"x":"y"}`, []Edit{Set("stream", []byte(`false`)), Set("new\u2028\"key", []byte(`1`)), Set("plain", []byte(`2`))}},
		{`{"a":1}`, []Edit{Delete("a"), Set("z", []byte(`1`)), Set("z", []byte(`2`))}},
	} {
		o, err := Parse([]byte(tc.in))
		require.NoError(t, err)
		want := o.AppendEdited(nil, tc.edits...)
		got := o.Edited(tc.edits...)
		require.Equal(t, string(want), string(got), tc.in)
		require.Equal(t, len(got), cap(got), tc.in)
		require.Equal(t, string(want), string(bytes.Join(o.EditedPieces(nil, tc.edits...), nil)), tc.in)
	}
}

// TestParseAndEditAllocs keeps the hot path of a typical request free of
// allocations but the output buffer.
func TestParseAndEditAllocs(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"hi \"there\"\n"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7}`)
	one := []byte("1")
	allocs := testing.AllocsPerRun(100, func() {
		o, err := Parse(body)
		if err != nil || !o.Has("max_tokens") {
			t.Fatal(err)
		}
		_ = o.Edited(Set("stream", one), Delete("stream_options"), Set("max_tokens", one), Set("kv_transfer_params", one))
	})
	require.LessOrEqual(t, allocs, 1.0)
}
