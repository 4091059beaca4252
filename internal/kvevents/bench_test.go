package kvevents

import (
	"testing"
)

// benchBatch is a busy vLLM step in the map encoding: a 4-block prefill
// of 16-token blocks stored (token ids of a 128k vocabulary) and the 4
// blocks it evicted, one BlockRemoved each, as vLLM's BlockPool emits.
func benchBatch(tb testing.TB, arrays bool) (payload []byte, events int) {
	ids := make([]uint32, 64)
	for i := range ids {
		ids[i] = uint32(1000 + i*1999%128000)
	}
	b := Batch{TS: 1.7e9, HasDPRank: true, Events: []Event{{Kind: BlockStored,
		Hashes: []Hash{{Lo: 0x8f3a0c1d2e4b5a69}, {Lo: 0x1b2c3d4e5f607182}, {Lo: 0xa1b2c3d4e5f60718}, {Lo: 0x7a6b5c4d3e2f1a0b}},
		Parent: Hash{Lo: 0x99aabbccddeeff00}, HasParent: true, TokenIDs: ids, BlockSize: 16, Medium: "GPU",
		ExtraKeys: nil, SpecKind: "full_attention"}}}
	for i := range 4 {
		b.Events = append(b.Events, Event{Kind: BlockRemoved, Hashes: []Hash{{Lo: 0xf0e1d2c3b4a59687 + uint64(i)}}, Medium: "GPU"})
	}
	return encodeBatch(tb, &b, arrays), len(b.Events)
}

// BenchmarkDecode is the cost of ingesting one event: pdx's goal is 64
// engines × 1,000 events/s in under 5% of a core, 780 ns an event.
func BenchmarkDecode(b *testing.B) {
	for _, tt := range []struct {
		name   string
		arrays bool
	}{{"map", false}, {"array", true}} {
		b.Run(tt.name, func(b *testing.B) {
			payload, events := benchBatch(b, tt.arrays)
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Decode(1, payload); err != nil {
					b.Fatal(err)
				}
			}
			perEvent := float64(b.Elapsed().Nanoseconds()) / float64(b.N*events)
			b.ReportMetric(perEvent, "ns/event")
			b.ReportMetric(64*1000*perEvent/1e9*100, "%core@64k/s")
		})
	}
}
