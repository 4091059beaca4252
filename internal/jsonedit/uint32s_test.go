package jsonedit

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestUint32s(t *testing.T) {
	for _, tc := range []struct {
		raw  string
		want []uint32
	}{
		{`[]`, []uint32{}},
		{`[ ]`, []uint32{}},
		{`[0,1, 2 ,4294967295]`, []uint32{0, 1, 2, 4294967295}},
		{"[\n7\t]", []uint32{7}},
		{`[4294967296]`, nil},
		{`[-1]`, nil},
		{`[1.5]`, nil},
		{`[1e3]`, nil},
		{`["1"]`, nil},
		{`[01]`, nil},
		{`{"0":1}`, nil},
		{`1`, nil},
	} {
		got, err := Uint32s([]byte(tc.raw))
		if tc.want == nil {
			require.ErrorIs(t, err, ErrNotUint32s, tc.raw)
			continue
		}
		require.NoError(t, err, tc.raw)
		require.Equal(t, tc.want, got, tc.raw)
	}
}
