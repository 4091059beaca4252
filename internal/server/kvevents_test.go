package server

import (
	"encoding/binary"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/kvevents"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// counting is the token ids from, n of them.
func counting(from, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = uint32(from + i)
	}
	return ids
}

// A pdx with kv_events subscribes at start, exports what it reads and
// stops its subscriptions at shutdown: in mode bind an engine's publisher
// that dials it is read, in mode dial a publisher that is not up yet is
// not an error.
func TestKVEventsLifecycle(t *testing.T) {
	for _, kv := range []string{
		`{mode: bind, bind_address: "tcp://127.0.0.1:0"}`,
		`{port: 1}`, // nothing listens on the engines' port 1
	} {
		t.Run(kv, func(t *testing.T) {
			cfg, err := config.Parse(fmt.Appendf(nil, `
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
kv_events: %s
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`, kv))
			require.NoError(t, err)
			s, err := Start(cfg, discard)
			require.NoError(t, err)
			if addr := s.KVEventsAddr(); addr != "" {
				pub := zmq4.NewPub(t.Context())
				require.NoError(t, pub.Dial(addr))
				// The topic names an engine pdx does not know: counted.
				require.Eventually(t, func() bool {
					_ = pub.Send(zmq4.NewMsgFrom([]byte("kv@10.9.9.9:8000@m"), make([]byte, 8), []byte{0x93, 0x00, 0x90, 0xc0}))
					_, body, err := get(t, "http://"+s.AdminAddr()+"/metrics")
					return err == nil && strings.Contains(body, `pdx_kv_events_total{kind="unknown_topics"}`) &&
						!strings.Contains(body, `pdx_kv_events_total{kind="unknown_topics"} 0`)
				}, guard, 20*time.Millisecond)
				require.NoError(t, pub.Close())
			} else {
				code, body, err := get(t, "http://"+s.AdminAddr()+"/metrics")
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, code)
				require.Contains(t, body, `pdx_kv_events_total{kind="batches"} 0`)
				require.Contains(t, body, `pdx_kv_cache_ignored_total{kind="orphans_dropped"} 0`)
				require.Contains(t, body, `pdx_kv_cache_orphans_joined_total 0`)
			}
			require.NoError(t, shutdown(t, s))
		})
	}
}

// churnConfig is a pool of one prefill and one decode endpoint whose
// engines dial pdx with their KV events, in 4-token blocks. Its prefill
// policy weighs tokens alone (least_work): the picks that find where an
// engine's events put the prompt are of a few tokens, answered at once,
// which the forecast's learned times, microseconds apart, would outweigh.
const churnConfig = `
kv_events: {mode: bind, bind_address: "tcp://127.0.0.1:0", block_size: 4}
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
  prefill_picker: {policy: least_work}
`

// churnRig is a routing table with kv_events, the subscription following
// it, and a publisher that speaks for any engine (its topics name them).
type churnRig struct {
	table *routing.Table
	pool  *routing.Pool
	cache *kvcache.Index
	sub   *kvevents.Subscriber
	f     *engineFollower
	pub   zmq4.Socket
	seq   map[string]uint64
}

func newChurnRig(t *testing.T) *churnRig {
	cfg, err := config.Parse([]byte(churnConfig))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	pool, ok := table.Pool("p")
	require.True(t, ok)
	r := &churnRig{table: table, pool: pool, cache: table.PrefixCache(), seq: map[string]uint64{}}
	r.sub, err = kvevents.Start(t.Context(), kvevents.Options{Sink: r.cache, Bind: cfg.GetKvEvents().GetBindAddress(), Log: discard})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, r.sub.Close()) })
	r.f = &engineFollower{k: cfg.GetKvEvents(), sub: r.sub, cache: r.cache, table: func() *routing.Table { return table }, log: discard}
	r.pub = zmq4.NewPub(t.Context())
	require.NoError(t, r.pub.Dial(r.sub.Addr()))
	t.Cleanup(func() { _ = r.pub.Close() })
	return r
}

// publish sends one batch of engine's: a BlockStored of prompt, a chain's
// start, in llm-d-inference-sim's positional layout (parent 0).
func (r *churnRig) publish(t *testing.T, engine string, prompt []uint32) {
	t.Helper()
	hashes := make([]any, len(prompt)/4)
	for i := range hashes {
		hashes[i] = uint64(len(r.seq)+1)<<8 | uint64(i)
	}
	payload, err := msgpack.Marshal([]any{1.0, []any{[]any{"BlockStored", hashes, uint64(0), prompt, 4, nil, "GPU", nil, nil}}, 0})
	require.NoError(t, err)
	seq := r.seq[engine]
	r.seq[engine] = seq + 1
	require.NoError(t, r.pub.Send(zmq4.NewMsgFrom([]byte("kv@"+engine+"@m"), binary.BigEndian.AppendUint64(nil, seq), payload)))
}

// held picks a prefill endpoint for prompt through the pool, as a request
// with its rendered tokens does, and returns it and how many of its
// tokens the pick read it held.
func (r *churnRig) held(t *testing.T, prompt []uint32) (string, int) {
	t.Helper()
	blocks := kvcache.HashTokens(nil, 0, prompt, 4, 0)
	l, err := r.pool.PickPrefill(endpoint.Endpoint{Address: "127.0.0.1:2"},
		picker.Request{TokenBlocks: blocks, TokenBlockSize: 4, Tokens: len(prompt)})
	require.NoError(t, err)
	defer l.End(picker.Succeeded)
	held, _ := l.Held()
	return l.Endpoint().Address, held
}

// tracked publishes prompt as engine's until a pick through the pool
// finds the engine holding it: the subscriber's first messages on a new
// connection may be lost.
func (r *churnRig) tracked(t *testing.T, engine string, prompt []uint32) {
	t.Helper()
	require.Eventually(t, func() bool {
		r.publish(t, engine, prompt)
		addr, held := r.held(t, prompt)
		return addr == engine && held == len(prompt)
	}, guard, 5*time.Millisecond, "%s's blocks held", engine)
}

func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// A pool whose pods come and go, through discovery's Pool.SetEndpoints
// and the subscription following the table, over four times as many
// addresses as the index has slots: the engines that leave free theirs,
// so that new engines are still tracked, and what pdx keeps stays the
// same size.
func TestKVEventsChurn(t *testing.T) {
	r := newChurnRig(t)
	const rounds, pods = 40, 100 // 4,000 addresses, MaxEngines 1,024
	require.Greater(t, rounds*pods, 3*kvcache.MaxEngines)
	// Picks run all along, as requests do.
	done := make(chan struct{})
	picking := make(chan struct{})
	go func() {
		defer close(picking)
		blocks := kvcache.HashTokens(nil, 0, counting(0, 8), 4, 0)
		for {
			select {
			case <-done:
				return
			default:
			}
			if l, err := r.pool.PickPrefill(endpoint.Endpoint{Address: "127.0.0.1:2"},
				picker.Request{TokenBlocks: blocks, TokenBlockSize: 4, Tokens: 8}); err == nil {
				l.End(picker.Succeeded)
			}
			time.Sleep(time.Millisecond)
		}
	}()
	defer func() { close(done); <-picking }()

	var heap, goroutines [2]int
	for round := range rounds {
		var prefill, decode []endpoint.Endpoint
		for i := range pods {
			ep := endpoint.Endpoint{Address: fmt.Sprintf("10.%d.%d.%d:8000", round/200, round%200, i)}
			if i%2 == 0 {
				prefill = append(prefill, ep)
			} else {
				decode = append(decode, ep)
			}
		}
		r.pool.SetEndpoints(prefill, decode)
		r.f.follow()
		// A new engine of the round publishes; the pool's picks find it.
		r.tracked(t, prefill[round%len(prefill)].Address, counting(100*round, 8))
		st := r.cache.Stats()
		require.Zero(t, st.NoSlot, "round %d", round)
		require.LessOrEqual(t, len(st.Engines), pods, "round %d: the engines that left are forgotten", round)
		for _, e := range st.Engines {
			require.Less(t, e.Slot&(kvcache.MaxEngines-1), int32(2*pods), "round %d: slots are reused", round)
		}
		switch round {
		case 9, rounds - 1:
			i := min(round/10, 1)
			heap[i], goroutines[i] = int(heapInUse()), runtime.NumGoroutine()
		}
	}
	t.Logf("heap %d then %d bytes, goroutines %d then %d", heap[0], heap[1], goroutines[0], goroutines[1])
	require.InDelta(t, goroutines[0], goroutines[1], 10, "a subscription's goroutines leave with its engine")
	require.Less(t, heap[1], heap[0]+4<<20, "after 3,000 more addresses")
}

// An engine that leaves and comes back while its slot is being freed: a
// pool's view registered it again before the index freed its slot, so
// that the view's handle names no engine, not even the engine that takes
// the slot next; the follower's refresh gives the view the engine's new
// slot.
func TestKVEventsEngineBack(t *testing.T) {
	r := newChurnRig(t)
	a, b := "10.0.0.1:8000", "10.0.0.2:8000"
	prompt := counting(0, 8)
	r.pool.SetEndpoints([]endpoint.Endpoint{{Address: a}}, []endpoint.Endpoint{{Address: "127.0.0.1:2"}})
	r.f.follow()
	r.tracked(t, a, prompt)
	// tracked may have published more than the index needed: one more,
	// on the live subscription, lands after all of them, so that none
	// registers a again once its slot is freed below.
	marker := counting(50, 8)
	r.publish(t, a, marker)
	require.Eventually(t, func() bool { _, held := r.held(t, marker); return held == len(marker) }, guard, 5*time.Millisecond)
	old := r.cache.Slot(a)

	// The follower's turn takes a snapshot without a; a comes back, its
	// view registering it (its slot as it is), then the turn frees the
	// slot of the engine the snapshot has not.
	r.pool.SetEndpoints([]endpoint.Endpoint{{Address: a}}, []endpoint.Endpoint{{Address: "127.0.0.1:2"}})
	require.Equal(t, 1, r.cache.Retain([]string{"127.0.0.1:2"}))
	// b takes a's old slot and holds the prompt.
	r.cache.Apply(b, &kvevents.Batch{Events: []kvevents.Event{{Kind: kvevents.BlockStored, Hashes: []kvevents.Hash{{Lo: 1}, {Lo: 2}},
		TokenIDs: prompt, BlockSize: 4}}})
	require.Equal(t, old&(kvcache.MaxEngines-1), r.cache.Slot(b)&(kvcache.MaxEngines-1), "a's old slot")
	addr, held := r.held(t, prompt)
	require.Equal(t, a, addr)
	require.Zero(t, held, "a's stale handle reads nothing, not b's blocks")

	// The next turn subscribes a again and refreshes the views: a's events
	// are matched under its new slot.
	r.f.follow()
	r.tracked(t, a, prompt)
	require.NotEqual(t, old, r.cache.Slot(a))
}
