package kvevents

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// runPrompts runs the capture's prompts a, b and c on s and returns the
// events of the five batches the Sink gets for them after seq last.
func runPrompts(t *testing.T, s *enginesim.Server, rec *recorder, engine string, last uint64) []Event {
	t.Helper()
	mark := rec.len()
	for _, p := range []string{promptA, promptB, promptC} {
		complete(t, s, p)
	}
	rec.waitFor(t, "the prompts' batches", applied(engine, last+5))
	calls := rec.since(mark)
	require.Equal(t, []uint64{last + 1, last + 2, last + 3, last + 4, last + 5}, appliedSeqs(calls, engine))
	require.Empty(t, resets(calls))
	var events []Event
	for _, c := range calls {
		events = append(events, c.batch.Events...)
	}
	return events
}

// promptEvents are the events of prompts a, b and c on simCapacity.
func promptEvents() []Event {
	a, b, c := tokens(promptA), tokens(promptB), tokens(promptC)
	return []Event{
		simStored(nil, a[:2], simA0),
		simRemoved(simA0),
		simStored(nil, b, simB0, simB1),
		simRemoved(simB1),
		simStored(&simB0, c[2:4], simC1),
	}
}

// TestSubscriberDial subscribes to an engine simulator's publisher in
// either encoding: the prefix cache's changes reach the Sink in order.
func TestSubscriberDial(t *testing.T) {
	for _, enc := range []string{enginesim.EventsMap, enginesim.EventsArray} {
		t.Run(enc, func(t *testing.T) {
			sim := startEngine(t, enginesim.Config{Capacity: &simCapacity,
				KVEvents: &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", Encoding: enc}})
			rec := newRecorder()
			sub := startSub(t, rec, Options{})
			e := simEngine(sim)
			require.NoError(t, sub.SetEngines([]Engine{e}))
			last := syncSim(t, sim, rec, e.Addr, 0)
			require.Equal(t, promptEvents(), runPrompts(t, sim, rec, e.Addr, last))
			st := sub.Stats()
			require.Zero(t, st.Resets+st.Gaps+st.DecodeErrors+st.Malformed, "%+v", st)
			require.GreaterOrEqual(t, st.Events, uint64(6))
		})
	}
}

// TestSubscriberEngineStartsLater is an engine whose publisher listens
// only after pdx subscribed: the dialling goes on until it is there.
func TestSubscriberEngineStartsLater(t *testing.T) {
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", freePorts(t, 1))
	rec := newRecorder()
	sub := startSub(t, rec, Options{})
	require.NoError(t, sub.SetEngines([]Engine{{Addr: "late:8000", Endpoint: ep}}))
	time.Sleep(300 * time.Millisecond) // a few dials refused
	sim := startEngine(t, enginesim.Config{Capacity: &simCapacity, KVEvents: &enginesim.KVEvents{Endpoint: ep}})
	last := syncSim(t, sim, rec, "late:8000", 0)
	require.Equal(t, promptEvents(), runPrompts(t, sim, rec, "late:8000", last))
	require.Empty(t, resets(rec.since(0)), "the first batch's number is taken as it is")
}

// TestSubscriberBind is pdx binding one socket that engines dial (vLLM
// connects to an endpoint without a wildcard), their topics naming them.
func TestSubscriberBind(t *testing.T) {
	t.Run("exact and unknown topics", func(t *testing.T) {
		rec := newRecorder()
		sub := startSub(t, rec, Options{Bind: "tcp://127.0.0.1:0", Topic: "kv@"})
		require.True(t, strings.HasPrefix(sub.Addr(), "tcp://127.0.0.1:"), sub.Addr())
		addr := fmt.Sprintf("127.0.0.1:%d", freePorts(t, 1))
		require.NoError(t, sub.SetEngines([]Engine{{Addr: addr}}))
		sim := startEngineAt(t, addr, enginesim.Config{Capacity: &simCapacity,
			KVEvents: &enginesim.KVEvents{Endpoint: sub.Addr(), Connect: true, Topic: "kv@" + addr + "@pdx-sim"}})
		last := syncSim(t, sim, rec, addr, 0)
		require.Equal(t, promptEvents(), runPrompts(t, sim, rec, addr, last))

		stranger := startEngine(t, enginesim.Config{Capacity: &simCapacity,
			KVEvents: &enginesim.KVEvents{Endpoint: sub.Addr(), Connect: true, Topic: "kv@10.0.0.9:8000@pdx-sim"}})
		deadline := time.Now().Add(10 * time.Second)
		for sub.Stats().UnknownTopics == 0 {
			require.True(t, stranger.ResetPrefixCache())
			require.True(t, time.Now().Before(deadline), "the stranger's batches never came")
			time.Sleep(20 * time.Millisecond)
		}
		for _, c := range rec.since(0) {
			require.Equal(t, addr, c.engine)
		}
	})

	t.Run("host topics", func(t *testing.T) {
		rec := newRecorder()
		sub := startSub(t, rec, Options{Bind: "tcp://127.0.0.1:0"})
		require.NoError(t, sub.SetEngines([]Engine{{Addr: "127.0.0.1:8000"}, {Addr: "10.0.0.1:8000"}}))
		sim := startEngine(t, enginesim.Config{Capacity: &simCapacity,
			KVEvents: &enginesim.KVEvents{Endpoint: sub.Addr(), Connect: true, Topic: "kv@127.0.0.1@pdx-sim"}})
		syncSim(t, sim, rec, "127.0.0.1:8000", 0)

		// A second engine on the host: the topic names neither.
		require.NoError(t, sub.SetEngines([]Engine{{Addr: "127.0.0.1:8000"}, {Addr: "10.0.0.1:8000"}, {Addr: "127.0.0.1:8001"}}))
		before := sub.Stats().UnknownTopics
		require.True(t, sim.ResetPrefixCache())
		require.Eventually(t, func() bool { return sub.Stats().UnknownTopics > before }, 10*time.Second, 10*time.Millisecond)
		require.Empty(t, resets(rec.since(0)), "engines kept are not reset")
	})

	t.Run("DP ranks", func(t *testing.T) {
		// One topic for the engine, each rank's publisher numbering its
		// own batches: the payloads' data_parallel_rank tells them apart.
		rec := newRecorder()
		sub := startSub(t, rec, Options{Bind: "tcp://127.0.0.1:0"})
		require.NoError(t, sub.SetEngines([]Engine{{Addr: "eng:8000", DPSize: 2}}))
		p0 := newTestPub(t, sub.Addr(), true, false, "kv@eng:8000@m")
		p1 := newTestPub(t, sub.Addr(), true, false, "kv@eng:8000@m")
		p1.rank, p1.next = 1, 1000
		p0.sync(rec, "eng:8000")
		p1.sync(rec, "eng:8000")
		p0.send(p0.next)
		p1.send(p1.next)
		rec.waitFor(t, "both ranks' next batches", func(c []call) bool {
			return applied("eng:8000", p0.next)(c) && applied("eng:8000", p1.next)(c)
		})
		require.Empty(t, resets(rec.since(0)), "two ranks' numbers are not one sequence")

		// A rank the engine does not have is a batch that cannot be used.
		p2 := newTestPub(t, sub.Addr(), true, false, "kv@eng:8000@m")
		p2.rank = 2
		require.Eventually(t, func() bool {
			p2.send(7)
			return reset("eng:8000", -1, ReasonDecode)(rec.since(0))
		}, 10*time.Second, 20*time.Millisecond)
	})
}

// TestSubscriberRestart is a publisher that starts again from 0: the Sink
// forgets what it had, whether pdx dials the engine or the engine pdx.
func TestSubscriberRestart(t *testing.T) {
	for _, connect := range []bool{false, true} {
		t.Run(fmt.Sprintf("connect=%v", connect), func(t *testing.T) {
			rec := newRecorder()
			opts := Options{}
			if connect {
				opts.Bind = "tcp://127.0.0.1:0"
			}
			sub := startSub(t, rec, opts)
			addr := fmt.Sprintf("127.0.0.1:%d", freePorts(t, 1))
			kv := &enginesim.KVEvents{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"}
			if connect {
				kv = &enginesim.KVEvents{Endpoint: sub.Addr(), Connect: true, Topic: "kv@" + addr + "@m"}
			}
			sim := startEngineAt(t, addr, enginesim.Config{Capacity: &simCapacity, KVEvents: kv})
			e := Engine{Addr: addr}
			if !connect {
				e = simEngine(sim)
			}
			require.NoError(t, sub.SetEngines([]Engine{e}))
			last := syncSim(t, sim, rec, addr, 0)
			// Well past what the new publisher sends before pdx is back.
			for range 40 {
				require.True(t, sim.ResetPrefixCache())
				last++
			}
			rec.waitFor(t, "the batches before the restart", applied(addr, last))

			require.NoError(t, sim.RestartKVEvents())
			deadline := time.Now().Add(10 * time.Second)
			for !rec.await(50*time.Millisecond, reset(addr, 0, ReasonRestart)) {
				require.True(t, sim.ResetPrefixCache())
				require.True(t, time.Now().Before(deadline), "no restart seen: %v", resets(rec.since(0)))
			}
			require.Equal(t, []call{{engine: addr, rank: 0, reason: ReasonRestart}}, resets(rec.since(0)))
			require.Equal(t, uint64(1), sub.Stats().Restarts)
		})
	}

	t.Run("reconnected with a gap", func(t *testing.T) {
		// The publisher went away and one is back with higher numbers: a
		// gap that replay must not fill, the new publisher's buffer not
		// being the old one's.
		rec := newRecorder()
		sub := startSub(t, rec, Options{})
		p := newTestPub(t, "tcp://127.0.0.1:0", false, true, "")
		e := Engine{Addr: "eng:8000", Endpoint: p.ep, Replay: p.replayEP}
		require.NoError(t, sub.SetEngines([]Engine{e}))
		p.sync(rec, e.Addr)
		p.close()
		again := newTestPub(t, p.ep, false, false, "")
		again.next = p.next + 5
		time.Sleep(300 * time.Millisecond) // redialled
		again.sync(rec, e.Addr)
		require.Equal(t, []call{{engine: e.Addr, rank: 0, reason: ReasonReconnect}}, resets(rec.since(0)))
		require.Equal(t, uint64(1), sub.Stats().Gaps)
		require.Zero(t, sub.Stats().Replays+sub.Stats().ReplayFailures)
	})
}

// TestSubscriberGap is batches lost between publisher and pdx: replayed
// when the replay socket has them, else a Reset.
func TestSubscriberGap(t *testing.T) {
	tests := []struct {
		name    string
		replay  bool
		setup   func(p *testPub, from uint64)
		endp    string // Engine.Replay instead of the publisher's
		replays bool   // the gap is filled
	}{
		{name: "replayed", replay: true, replays: true},
		{name: "replayed without topic frames (vLLM before 0.32)", replay: true, replays: true,
			setup: func(p *testPub, _ uint64) { p.noTopic = true }},
		{name: "no replay endpoint"},
		{name: "no longer buffered", replay: true, setup: func(p *testPub, from uint64) { p.from = from + 1 }},
		{name: "no answer", replay: true, setup: func(p *testPub, _ uint64) { p.mute = true }},
		{name: "replay socket down", endp: fmt.Sprintf("tcp://127.0.0.1:%d", freePorts(t, 1))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := newRecorder()
			sub := startSub(t, rec, Options{ReplayTimeout: 300 * time.Millisecond})
			p := newTestPub(t, "tcp://127.0.0.1:0", false, tt.replay, "")
			e := Engine{Addr: "eng:8000", Endpoint: p.ep, Replay: p.replayEP}
			if tt.endp != "" {
				e.Replay = tt.endp
			}
			require.NoError(t, sub.SetEngines([]Engine{e}))
			p.sync(rec, e.Addr)
			p.drainRequests()
			mark := rec.len()
			n := p.next
			if tt.setup != nil {
				p.mu.Lock()
				tt.setup(p, n+1)
				p.mu.Unlock()
			}
			p.send(n)
			p.skip(n + 1)
			p.skip(n + 2)
			p.send(n + 3)
			rec.waitFor(t, "the batch after the gap", applied(e.Addr, n+3))
			calls := rec.since(mark)
			st := sub.Stats()
			require.Equal(t, uint64(1), st.Gaps)
			if tt.replays {
				require.Equal(t, []uint64{n, n + 1, n + 2, n + 3}, appliedSeqs(calls, e.Addr))
				require.Empty(t, resets(calls))
				require.Equal(t, n+1, <-p.requests, "replay asked from the first batch missed")
				require.Equal(t, uint64(1), st.Replays)
				return
			}
			require.Equal(t, []uint64{n, n + 3}, appliedSeqs(calls, e.Addr))
			require.Equal(t, []call{{engine: e.Addr, rank: 0, reason: ReasonGap}}, resets(calls))
			require.Equal(t, ReasonGap, calls[1].reason, "reset before the batch after the gap")
			require.Zero(t, st.Replays)
			if e.Replay != "" {
				require.Equal(t, uint64(1), st.ReplayFailures)
			}
		})
	}
}

// A subscriber that joins a publisher after it published (pdx started
// after the engine, or restarted) begins with what the publisher's replay
// socket still holds of the batches before the first it hears: the
// blocks stored before, which no later event names again.
func TestSubscriberCatchUp(t *testing.T) {
	for _, tc := range []struct {
		name   string
		oldest uint64 // the replay buffer's oldest batch
		replay bool
	}{
		{name: "all buffered", oldest: 0, replay: true},
		{name: "the oldest no longer buffered", oldest: 3, replay: true},
		{name: "no replay socket"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := newRecorder()
			sub := startSub(t, rec, Options{ReplayTimeout: time.Second, CatchUp: true})
			p := newTestPub(t, "tcp://127.0.0.1:0", false, tc.replay, "")
			for seq := range uint64(6) {
				p.skip(seq) // published before pdx subscribed
			}
			p.from = tc.oldest
			e := Engine{Addr: "eng:8000", Endpoint: p.ep, Replay: p.replayEP}
			require.NoError(t, sub.SetEngines([]Engine{e}))
			if !tc.replay {
				p.next = 6
				p.sync(rec, e.Addr)
				got := appliedSeqs(rec.since(0), e.Addr)
				require.Greater(t, got[0], uint64(5), "nothing from before")
				require.Zero(t, sub.Stats().CatchUps)
				return
			}
			rec.waitFor(t, "the last batch published before", applied(e.Addr, 5))
			var want []uint64
			for seq := tc.oldest; seq < 6; seq++ {
				want = append(want, seq)
			}
			require.Equal(t, want, appliedSeqs(rec.since(0), e.Addr), "what the buffer held, before any batch is published")
			require.Empty(t, resets(rec.since(0)))
			// Counted once the replay has ended, after its batches.
			require.Eventually(t, func() bool { return sub.Stats().CatchUps == 1 }, 5*time.Second, time.Millisecond)
			require.Equal(t, uint64(0), <-p.requests, "asked from the start")
		})
	}
}

// TestSubscriberDPRanks dials each DP rank's publisher on the port offset
// by its rank; each rank has its own sequence.
func TestSubscriberDPRanks(t *testing.T) {
	base := freePorts(t, 2)
	p0 := newTestPub(t, fmt.Sprintf("tcp://127.0.0.1:%d", base), false, false, "")
	p1 := newTestPub(t, fmt.Sprintf("tcp://127.0.0.1:%d", base+1), false, false, "")
	p1.rank, p1.next = 1, 1000
	rec := newRecorder()
	sub := startSub(t, rec, Options{})
	require.NoError(t, sub.SetEngines([]Engine{{Addr: "eng:8000", Endpoint: p0.ep, DPSize: 2}}))
	p0.sync(rec, "eng:8000")
	p1.sync(rec, "eng:8000")
	p1.send(p1.next + 1) // rank 1 misses one
	p0.send(p0.next)
	rec.waitFor(t, "both ranks' batches", func(c []call) bool {
		return applied("eng:8000", p1.next+1)(c) && applied("eng:8000", p0.next)(c)
	})
	require.Equal(t, []call{{engine: "eng:8000", rank: 1, reason: ReasonGap}}, resets(rec.since(0)))
}

// TestSubscriberOverflow is a Sink that falls behind a publisher: the
// reader goes on reading, drops what does not fit and resets once.
func TestSubscriberOverflow(t *testing.T) {
	rec := newRecorder()
	sub := startSub(t, rec, Options{Queue: 4})
	p := newTestPub(t, "tcp://127.0.0.1:0", false, false, "")
	require.NoError(t, sub.SetEngines([]Engine{{Addr: "eng:8000", Endpoint: p.ep}}))
	p.sync(rec, "eng:8000")
	release := rec.holdApplies(t)
	first := p.next
	// The first in the Sink before the rest are sent, so that which ones
	// are queued does not depend on when the Sink takes it.
	p.send(p.next)
	p.next++
	require.Eventually(t, func() bool { return rec.applying("eng:8000") }, 10*time.Second, time.Millisecond)
	for range 99 {
		p.send(p.next)
		p.next++
	}
	// One in the Sink, four queued, the rest dropped while the Sink is
	// stuck: the socket is still read.
	require.Eventually(t, func() bool { return sub.Stats().Dropped == 95 }, 10*time.Second, 10*time.Millisecond)
	release()
	rec.waitFor(t, "the batches kept", applied("eng:8000", first+4))
	// Until the queue has drained to half, batches are still dropped; now
	// it is empty.
	p.send(p.next)
	rec.waitFor(t, "the batch after the flood", applied("eng:8000", p.next))
	require.Equal(t, []call{{engine: "eng:8000", rank: 0, reason: ReasonOverflow}}, resets(rec.since(0)))
	st := sub.Stats()
	require.Equal(t, uint64(1), st.Overflows)
	require.Equal(t, uint64(95), st.Dropped)
	require.Zero(t, st.Gaps, "after the reset the next batch's number is taken as it is")
}

// TestSubscriberMalformed is input that is not KV events: counted,
// dropped, and the subscription goes on.
func TestSubscriberMalformed(t *testing.T) {
	rec := newRecorder()
	sub := startSub(t, rec, Options{})
	p := newTestPub(t, "tcp://127.0.0.1:0", false, false, "")
	require.NoError(t, sub.SetEngines([]Engine{{Addr: "eng:8000", Endpoint: p.ep}}))
	p.sync(rec, "eng:8000")
	mark := rec.len()
	n := p.next
	seq := binary.BigEndian.AppendUint64(nil, n)
	p.sendFrames(nil, seq)                              // two frames
	p.sendFrames(nil, []byte{0, 0, 0, 1}, p.batch(n))   // a short sequence
	p.sendFrames(nil, endReplay, p.batch(n))            // seq -1
	p.sendFrames(nil, seq, []byte{0x92, 0xcb, 1, 2, 3}) // a truncated payload, batch n
	p.send(n + 1)
	rec.waitFor(t, "the batch after", applied("eng:8000", n+1))
	calls := rec.since(mark)
	require.Equal(t, []call{{engine: "eng:8000", rank: 0, reason: ReasonDecode}}, resets(calls))
	require.Equal(t, []uint64{n + 1}, appliedSeqs(calls, "eng:8000"))
	st := sub.Stats()
	require.Equal(t, uint64(3), st.Malformed)
	require.Equal(t, uint64(1), st.DecodeErrors)
	require.Zero(t, st.Gaps)
}

// TestSubscriberSetEngines is engines coming and going.
func TestSubscriberSetEngines(t *testing.T) {
	rec := newRecorder()
	sub := startSub(t, rec, Options{})
	p := newTestPub(t, "tcp://127.0.0.1:0", false, true, "")
	e := Engine{Addr: "eng:8000", Endpoint: p.ep}
	// A publisher that never speaks, nor listens, blocks nothing.
	silent := Engine{Addr: "silent:8000", Endpoint: fmt.Sprintf("tcp://127.0.0.1:%d", freePorts(t, 1))}
	require.NoError(t, sub.SetEngines([]Engine{e, silent}))
	p.sync(rec, e.Addr)

	require.NoError(t, sub.SetEngines([]Engine{silent, e}), "the same engines again")
	p.send(p.next)
	rec.waitFor(t, "a batch on the subscription kept", applied(e.Addr, p.next))
	p.next++
	require.Empty(t, resets(rec.since(0)))

	// Changed settings: unsubscribed, reset, subscribed anew.
	e.Replay = p.replayEP
	require.NoError(t, sub.SetEngines([]Engine{silent, e}))
	require.Equal(t, []call{{engine: e.Addr, rank: -1, reason: ReasonRemoved}}, resets(rec.since(0)))
	p.sync(rec, e.Addr)

	require.NoError(t, sub.SetEngines([]Engine{silent}))
	calls := rec.since(0)
	require.Equal(t, call{engine: e.Addr, rank: -1, reason: ReasonRemoved}, calls[len(calls)-1], "the last call")
	p.send(p.next)
	time.Sleep(100 * time.Millisecond)
	require.Len(t, rec.since(0), len(calls), "nothing after the engine left")

	require.NoError(t, sub.Close())
	require.ErrorContains(t, sub.SetEngines([]Engine{e}), "after Close")
}

// TestEngineSettings is the engines SetEngines refuses.
func TestEngineSettings(t *testing.T) {
	tests := []struct {
		name    string
		engines []Engine
		want    string
	}{
		{"no port", []Engine{{Addr: "eng"}}, "not host:port"},
		{"negative DP", []Engine{{Addr: "eng:1", DPSize: -1}}, "DPSize -1"},
		{"ipc", []Engine{{Addr: "eng:1", Endpoint: "ipc:///tmp/kv"}}, "only tcp://"},
		{"no endpoint port", []Engine{{Addr: "eng:1", Endpoint: "tcp://host"}}, "not tcp://host:port"},
		{"ranks past 65535", []Engine{{Addr: "eng:1", Replay: "tcp://host:65535", DPSize: 2}}, "no port for each of 2 ranks"},
		{"twice", []Engine{{Addr: "eng:1"}, {Addr: "eng:1"}}, "given twice"},
	}
	sub := startSub(t, newRecorder(), Options{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.ErrorContains(t, sub.SetEngines(tt.engines), tt.want)
		})
	}
	e, err := Engine{Addr: "eng:1", Endpoint: "10.0.0.1:5557", DPSize: 3}.normalized()
	require.NoError(t, err)
	require.Equal(t, "tcp://10.0.0.1:5557", e.Endpoint, "host:port taken as tcp://")
	require.Equal(t, "tcp://10.0.0.1:5559", rankEndpoint(e.Endpoint, 2))
	require.Equal(t, "tcp://[::1]:5558", rankEndpoint("tcp://[::1]:5557", 1))
}

// TestStartBindFails is a Bind endpoint that cannot be listened on.
func TestStartBindFails(t *testing.T) {
	_, err := Start(t.Context(), Options{Sink: newRecorder(), Bind: "tcp://256.0.0.1:1"})
	require.ErrorContains(t, err, "kvevents: bind tcp://256.0.0.1:1")
	_, err = Start(t.Context(), Options{})
	require.ErrorContains(t, err, "Sink is required")
}
