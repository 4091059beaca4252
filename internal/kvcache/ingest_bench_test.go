package kvcache

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pdx-router/pdx/internal/kvevents"
)

// The ingestion benchmark's engines: 64 vLLM publishers of 1,000 events
// a second each, the goal (under 5% of a core). A batch is one
// scheduler step's events (vLLM publishes a KVEventBatch a step): every
// 20 ms, 4 BlockStored runs of 4 new blocks (16-token blocks, a step's
// prefill chunks) and the 16 BlockRemoved of the blocks they evicted, one
// each, as vLLM's BlockPool sends them, an engine holding ingestHeld
// blocks in steady state.
const (
	ingestEngines     = 64
	ingestStep        = 20 * time.Millisecond
	ingestRuns        = 4 // BlockStored events a batch
	ingestRunBlocks   = 4
	ingestHeld        = 4096
	ingestBatchEvents = ingestRuns + ingestRuns*ingestRunBlocks
	publisherEnv      = "KVCACHE_BENCH_PUBLISHER"
)

// BenchmarkIngest is the CPU that pdx's whole ingestion (the subscriber's
// sockets and queues, Decode, and the Index) costs, the publishers in
// another process: an op is one event, arriving at the engines' rate, so
// ns/op is the wall time per event and %core what the events cost of one
// core, from this process's CPU time (the test binary's idle runtime
// included).
func BenchmarkIngest(b *testing.B) {
	exe, err := os.Executable()
	require.NoError(b, err)
	cmd := exec.CommandContext(b.Context(), exe)
	cmd.Env = append(os.Environ(), publisherEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(b, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, cmd.Start())
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()
	var endpoints []string
	for sc := bufio.NewScanner(stdout); len(endpoints) < ingestEngines && sc.Scan(); {
		if ep, ok := strings.CutPrefix(sc.Text(), "endpoint "); ok {
			endpoints = append(endpoints, ep)
		}
	}
	require.Len(b, endpoints, ingestEngines, "the publisher's endpoints")

	x := New(Config{})
	engines := make([]kvevents.Engine, ingestEngines)
	for i, ep := range endpoints {
		engines[i] = kvevents.Engine{Addr: benchAddr(i), Endpoint: ep}
		x.Register(benchAddr(i))
	}
	sub, err := kvevents.Start(b.Context(), kvevents.Options{Sink: x, Log: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	defer sub.Close()
	require.NoError(b, sub.SetEngines(engines))
	// Steady state: every engine subscribed and holding its blocks.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		full := 0
		x.mu.RLock()
		for _, e := range x.engines {
			if e.blocks[tierGPU] >= ingestHeld {
				full++
			}
		}
		x.mu.RUnlock()
		if full == ingestEngines {
			break
		}
		require.True(b, time.Now().Before(deadline), "%d of %d engines hold their blocks; %+v, %+v", full, ingestEngines, sub.Stats(), x.Stats())
	}
	b.ResetTimer()
	was, before, start := sub.Stats(), processCPU(), time.Now()
	for sub.Stats().Events-was.Events < uint64(b.N) {
		time.Sleep(5 * time.Millisecond)
	}
	cpu, wall, st := processCPU()-before, time.Since(start), sub.Stats()
	b.StopTimer()
	events := st.Events - was.Events
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(events), "cpu-ns/event")
	b.ReportMetric(100*cpu.Seconds()/wall.Seconds(), "%core")
	b.ReportMetric(float64(events)/wall.Seconds(), "events/s")
	require.Zero(b, st.Dropped-was.Dropped+st.Gaps-was.Gaps+st.DecodeErrors-was.DecodeErrors,
		"every batch applied in order: %+v", st)
}

// runIngestPublisher is BenchmarkIngest's other process (TestMain runs it
// in place of the tests): it publishes until its stdin closes.
func runIngestPublisher() int {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = bufio.NewReader(os.Stdin).ReadByte()
		cancel()
	}()
	pubs := make([]*ingestPublisher, ingestEngines)
	for i := range pubs {
		p, err := newIngestPublisher(ctx, uint64(i))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		pubs[i] = p
		fmt.Printf("endpoint %s\n", p.endpoint)
	}
	// Fill every engine up at once, then step at the rate, the engines'
	// steps spread over the interval; a late tick catches up.
	for _, p := range pubs {
		for p.held < ingestHeld {
			p.step()
		}
	}
	const every = ingestStep / ingestEngines
	tick := time.NewTicker(every)
	defer tick.Stop()
	start, steps := time.Now(), 0
	for {
		select {
		case <-ctx.Done():
			for _, p := range pubs {
				_ = p.sock.Close()
			}
			return 0
		case <-tick.C:
			for due := int(time.Since(start) / every); steps < due; steps++ {
				pubs[steps%ingestEngines].step()
			}
		}
	}
}

type ingestPublisher struct {
	sock     zmq4.Socket
	endpoint string
	r        *rand.Rand
	seq      uint64
	next     uint64     // the next block hash
	chains   [][]uint64 // the blocks held, by chain, oldest first
	held     int
	parent   uint64 // the last block of the chain being grown
	chainLen int
	buf      bytes.Buffer
	enc      *msgpack.Encoder
	tokens   int // token ids a run
}

func newIngestPublisher(ctx context.Context, id uint64) (*ingestPublisher, error) {
	p := &ingestPublisher{sock: zmq4.NewPub(ctx), r: rand.New(rand.NewPCG(id, 9)), next: id << 40}
	if err := p.sock.Listen("tcp://127.0.0.1:0"); err != nil {
		return nil, err
	}
	p.endpoint = "tcp://" + p.sock.Addr().String()
	p.enc = msgpack.NewEncoder(&p.buf)
	p.tokens = ingestRunBlocks * 16
	return p, nil
}

// step publishes one step's batch, in the map encoding of vLLM main.
func (p *ingestPublisher) step() {
	p.buf.Reset()
	e := p.enc
	evict := 0
	if p.held >= ingestHeld {
		evict = ingestRuns * ingestRunBlocks
	}
	_ = e.EncodeMapLen(3)
	_ = e.EncodeString("ts")
	_ = e.EncodeFloat64(float64(time.Now().UnixNano()) / 1e9)
	_ = e.EncodeString("events")
	_ = e.EncodeArrayLen(ingestRuns + evict)
	for range ingestRuns {
		_ = e.EncodeMapLen(12)
		_ = e.EncodeString("type")
		_ = e.EncodeString("BlockStored")
		_ = e.EncodeString("block_hashes")
		_ = e.EncodeArrayLen(ingestRunBlocks)
		first := p.next
		for range ingestRunBlocks {
			_ = e.EncodeUint(p.next)
			p.next++
		}
		_ = e.EncodeString("parent_block_hash")
		if p.chainLen > 0 && p.chainLen < 32 {
			_ = e.EncodeUint(p.parent)
		} else {
			_ = e.EncodeNil()
			p.chainLen = 0
			p.chains = append(p.chains, nil)
		}
		last := &p.chains[len(p.chains)-1]
		for h := first; h < p.next; h++ {
			*last = append(*last, h)
		}
		p.parent, p.chainLen = p.next-1, p.chainLen+ingestRunBlocks
		_ = e.EncodeString("token_ids")
		_ = e.EncodeArrayLen(p.tokens)
		for range p.tokens {
			_ = e.EncodeUint(uint64(p.r.IntN(128000)))
		}
		for _, kv := range []struct {
			k string
			v any
		}{{"block_size", 16}, {"lora_id", nil}, {"medium", "GPU"}, {"lora_name", nil}, {"extra_keys", nil},
			{"group_idx", 0}, {"kv_cache_spec_kind", "full_attention"}, {"kv_cache_spec_sliding_window", nil}} {
			_ = e.EncodeString(kv.k)
			_ = e.Encode(kv.v)
		}
	}
	p.held += ingestRuns * ingestRunBlocks
	// vLLM frees a request's blocks tail first, so its LRU queue evicts
	// the oldest chains from their ends.
	for range evict {
		old := &p.chains[0]
		h := (*old)[len(*old)-1]
		if *old = (*old)[:len(*old)-1]; len(*old) == 0 {
			p.chains = p.chains[1:]
		}
		_ = e.EncodeMapLen(4)
		_ = e.EncodeString("type")
		_ = e.EncodeString("BlockRemoved")
		_ = e.EncodeString("block_hashes")
		_ = e.EncodeArrayLen(1)
		_ = e.EncodeUint(h)
		_ = e.EncodeString("medium")
		_ = e.EncodeString("GPU")
		_ = e.EncodeString("group_idx")
		_ = e.EncodeInt(0)
	}
	p.held -= evict
	_ = e.EncodeString("data_parallel_rank")
	_ = e.EncodeNil()
	seq := binary.BigEndian.AppendUint64(nil, p.seq)
	p.seq++
	_ = p.sock.Send(zmq4.NewMsgFrom([]byte("kv-events"), seq, bytes.Clone(p.buf.Bytes())))
}

// processCPU is this process's user and system CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
