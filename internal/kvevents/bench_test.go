package kvevents

import (
	"context"
	"encoding/binary"
	"log/slog"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
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

// BenchmarkDecode is the cost of decoding one event with a feed's
// Decoder: pdx's goal for ingestion, decode and index, is 64 engines ×
// 1,000 events/s in under 5% of a core, 780 ns an event.
func BenchmarkDecode(b *testing.B) {
	for _, tt := range []struct {
		name   string
		arrays bool
	}{{"map", false}, {"array", true}} {
		b.Run(tt.name, func(b *testing.B) {
			payload, events := benchBatch(b, tt.arrays)
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			var dec Decoder
			for b.Loop() {
				if _, err := dec.Decode(1, payload); err != nil {
					b.Fatal(err)
				}
			}
			perEvent := float64(b.Elapsed().Nanoseconds()) / float64(b.N*events)
			b.ReportMetric(perEvent, "ns/event")
			b.ReportMetric(64*1000*perEvent/1e9*100, "%core@64k/s")
		})
	}
}

// countSink counts what it is given.
type countSink struct{ batches, events atomic.Int64 }

func (c *countSink) Apply(_ string, b *Batch) {
	c.events.Add(int64(len(b.Events)))
	c.batches.Add(1)
}
func (c *countSink) Reset(string, int, string) {}

// BenchmarkSubscriber is the whole path, a ZMQ message to the Sink, over
// loopback: cpu-ns/event is the process's CPU time (publisher included,
// so an upper bound) per event.
func BenchmarkSubscriber(b *testing.B) {
	payload, events := benchBatch(b, false)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	require.NoError(b, pub.Listen("tcp://127.0.0.1:0"))
	ep, err := boundEndpoint(pub)
	require.NoError(b, err)
	sink := &countSink{}
	sub, err := Start(ctx, Options{Sink: sink, Queue: 4096, Log: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	defer sub.Close()
	require.NoError(b, sub.SetEngines([]Engine{{Addr: "eng:8000", Endpoint: ep}}))
	seq := uint64(0)
	send := func() {
		require.NoError(b, pub.SendMulti(zmq4.NewMsgFrom(nil, binary.BigEndian.AppendUint64(nil, seq), payload)))
		seq++
	}
	for sink.batches.Load() == 0 { // subscribed
		send()
		time.Sleep(10 * time.Millisecond)
	}
	const chunk = 256 // sent before waiting, within the queue
	b.ReportAllocs()
	b.ResetTimer()
	start, before := time.Now(), cpuTime()
	done := sink.batches.Load()
	for sent := 0; sent < b.N; {
		n := min(chunk, b.N-sent)
		for range n {
			send()
		}
		sent += n
		for sink.batches.Load() < done+int64(sent) {
			time.Sleep(50 * time.Microsecond)
		}
	}
	cpu, wall := cpuTime()-before, time.Since(start)
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N*events), "cpu-ns/event")
	b.ReportMetric(float64(wall.Nanoseconds())/float64(b.N*events), "wall-ns/event")
	require.Zero(b, sub.Stats().Dropped)
}

// cpuTime is the process's user and system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
