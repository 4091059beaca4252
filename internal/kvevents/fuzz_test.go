package kvevents

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

// FuzzDecode decodes anything without panicking, and whatever decodes is
// a batch that, encoded again either way, decodes to the same events.
func FuzzDecode(f *testing.F) {
	for _, p := range readFrames(f) {
		f.Add(p)
	}
	f.Add(deep(40))
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, payload []byte) {
		b, err := Decode(9, payload)
		if err != nil {
			require.Equal(t, Batch{}, b)
			return
		}
		want := reencoded(b)
		for _, arrays := range []bool{true, false} {
			again, err := Decode(9, encodeBatch(t, &b, arrays))
			require.NoError(t, err)
			if math.IsNaN(again.TS) {
				again.TS = 0
			}
			require.Equal(t, want, again, "arrays %v", arrays)
		}
	})
}

// reencoded is what b decodes to once encodeBatch has written it: no
// skipped events, bytes hashes folded from their 16 bytes.
func reencoded(b Batch) Batch {
	b.Skipped = 0
	if math.IsNaN(b.TS) {
		b.TS = 0
	}
	events := make([]Event, len(b.Events))
	for i, e := range b.Events {
		if e.Hashes != nil {
			hs := make([]Hash, len(e.Hashes))
			for j, h := range e.Hashes {
				hs[j] = roundTripped(h)
			}
			e.Hashes = hs
		}
		e.Parent = roundTripped(e.Parent)
		events[i] = e
	}
	if b.Events != nil {
		b.Events = events
	}
	return b
}
