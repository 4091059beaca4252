package flowcontrol

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// room is a leg with free places for requests: a request the queue
// admits takes one (as its pick would count on an endpoint), and the test
// gives them.
type room struct {
	mu   sync.Mutex
	free int
	ch   chan struct{}
}

func newRoom(free int) *room { return &room{free: free, ch: make(chan struct{})} }

func (r *room) Saturated(string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.free <= 0
}

func (r *room) AwaitRoom(ctx context.Context, _ string, maxWait time.Duration) error {
	t := time.NewTimer(maxWait)
	defer t.Stop()
	for {
		r.mu.Lock()
		free, ch := r.free, r.ch
		r.mu.Unlock()
		if free > 0 {
			return nil
		}
		select {
		case <-ch:
		case <-t.C:
			return errors.New("saturated")
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// give makes n more places.
func (r *room) give(n int) {
	r.mu.Lock()
	r.free += n
	close(r.ch)
	r.ch = make(chan struct{})
	r.mu.Unlock()
}

func (r *room) take() {
	r.mu.Lock()
	r.free--
	r.mu.Unlock()
}

// waitFor waits until c holds n waiting requests.
func waitFor(t *testing.T, c *Controller, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return c.waiting.Load() == int64(n) }, 5*time.Second, time.Millisecond)
}

type result struct {
	name string
	err  error
}

// enqueue starts a request named name that waits on r, takes a place when
// admitted and releases its ticket; what became of it goes to out. It
// returns once the request is queued: each is queued before the next
// starts.
func enqueue(t *testing.T, ctx context.Context, c *Controller, r *room, name string, req Request, out chan<- result) {
	t.Helper()
	before := c.waiting.Load()
	start(ctx, c, r, name, req, out)
	require.Eventually(t, func() bool { return c.waiting.Load() == before+1 }, 5*time.Second, time.Millisecond)
}

// start is enqueue without the wait, for a request that displaces
// another: the queue's length stays, and the displaced one's answer tells
// that it is queued.
func start(ctx context.Context, c *Controller, r *room, name string, req Request, out chan<- result) {
	go func() {
		tk, err := c.Wait(ctx, r, "", &req)
		if err == nil {
			r.take()
			tk.Release()
		}
		out <- result{name, err}
	}()
}

// admitOrder gives one place at a time and returns the requests in the
// order the queue admitted them.
func admitOrder(t *testing.T, r *room, out <-chan result, n int) []string {
	t.Helper()
	var order []string
	for range n {
		r.give(1)
		res := <-out
		require.NoError(t, res.err, res.name)
		order = append(order, res.name)
	}
	return order
}

func TestAdmitsAtOnceWithRoom(t *testing.T) {
	c := New(Config{MaxWaitDefault: time.Second})
	r := newRoom(1)
	req := &Request{Objective: "chat", Bytes: 100}
	allocs := testing.AllocsPerRun(100, func() {
		tk, err := c.Wait(t.Context(), r, "", req)
		require.NoError(t, err)
		tk.Release()
	})
	require.Zero(t, allocs, "the unsaturated path allocates nothing")
}

func TestOrder(t *testing.T) {
	at := time.Now()
	for _, tt := range []struct {
		name     string
		cfg      Config
		requests []Request // named r0, r1, ... in arrival order
		want     []string
	}{
		{
			name:     "fcfs in one flow",
			requests: []Request{{}, {}, {}},
			want:     []string{"r0", "r1", "r2"},
		},
		{
			name: "higher bands first, sheddable last",
			cfg:  Config{Priorities: map[string]int{"batch": -1, "critical": 10}},
			requests: []Request{
				{Objective: "batch"}, {}, {Objective: "critical"}, {Objective: "unknown"}, {Objective: "critical"},
			},
			want: []string{"r2", "r4", "r1", "r3", "r0"},
		},
		{
			name: "round robin across flows",
			requests: []Request{
				{Flow: "a"}, {Flow: "a"}, {Flow: "a"}, {Flow: "a"}, {Flow: "b"}, {Flow: "b"}, {Flow: "c"},
			},
			want: []string{"r0", "r4", "r6", "r1", "r5", "r2", "r3"},
		},
		{
			name: "the objective is the flow without a fairness id",
			requests: []Request{
				{Objective: "x"}, {Objective: "x"}, {Objective: "y"},
			},
			want: []string{"r0", "r2", "r1"},
		},
		{
			name: "token usage: the flow served fewest tokens first",
			cfg:  Config{Fairness: TokenUsage},
			requests: []Request{
				{Flow: "big", Tokens: 1000}, {Flow: "big", Tokens: 1000}, {Flow: "small", Tokens: 10},
				{Flow: "small", Tokens: 10}, {Flow: "small", Tokens: 10},
			},
			// big's first takes 1,000 tokens: small's three go before its second.
			want: []string{"r0", "r2", "r3", "r4", "r1"},
		},
		{
			name: "edf: earliest deadline first, none last",
			cfg:  Config{Ordering: EDF},
			requests: []Request{
				{}, {Deadline: at.Add(3 * time.Second)}, {Deadline: at.Add(time.Second)}, {}, {Deadline: at.Add(2 * time.Second)},
			},
			want: []string{"r2", "r4", "r1", "r0", "r3"},
		},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.MaxWaitDefault = time.Minute
			c := New(tt.cfg)
			r := newRoom(0)
			out := make(chan result, len(tt.requests))
			for i, req := range tt.requests {
				enqueue(t, t.Context(), c, r, fmt.Sprintf("r%d", i), req, out)
			}
			require.Equal(t, tt.want, admitOrder(t, r, out, len(tt.requests)))
			waitFor(t, c, 0)
		})
	}
}

// A newcomer waits behind those already waiting, even when room appears
// just as it comes: it does not jump the queue.
func TestNoJumpingTheQueue(t *testing.T) {
	c := New(Config{MaxWaitDefault: time.Minute, Priorities: map[string]int{"low": -1}})
	r := newRoom(0)
	out := make(chan result, 2)
	enqueue(t, t.Context(), c, r, "first", Request{Objective: "low"}, out)
	enqueue(t, t.Context(), c, r, "second", Request{}, out)
	require.Equal(t, []string{"second", "first"}, admitOrder(t, r, out, 2))
}

func TestLeaving(t *testing.T) {
	t.Run("band's longest wait", func(t *testing.T) {
		c := New(Config{MaxWaitDefault: time.Minute, MaxWait: map[int]time.Duration{-1: 20 * time.Millisecond},
			Priorities: map[string]int{"batch": -1}})
		r := newRoom(0)
		tk, err := c.Wait(t.Context(), r, "", &Request{Objective: "batch"})
		require.ErrorIs(t, err, ErrTimedOut)
		require.GreaterOrEqual(t, tk.Waited(), 20*time.Millisecond, "what it waited, though refused")
		waitFor(t, c, 0)
	})
	t.Run("a wait of 0 refuses at once", func(t *testing.T) {
		c := New(Config{})
		_, err := c.Wait(t.Context(), newRoom(0), "", &Request{})
		require.ErrorIs(t, err, ErrTimedOut)
	})
	t.Run("a client that goes away leaves at once", func(t *testing.T) {
		c := New(Config{MaxWaitDefault: time.Minute})
		r := newRoom(0)
		ctx, cancel := context.WithCancel(t.Context())
		out := make(chan result, 2)
		enqueue(t, ctx, c, r, "gone", Request{}, out)
		enqueue(t, t.Context(), c, r, "stays", Request{}, out)
		cancel()
		res := <-out
		require.Equal(t, "gone", res.name)
		require.ErrorIs(t, res.err, context.Canceled)
		waitFor(t, c, 1)
		require.Equal(t, []string{"stays"}, admitOrder(t, r, out, 1))
	})
}

// A full queue makes room by displacing the newest request of the lowest
// band below the newcomer's; a newcomer with nothing below it is refused.
func TestBounds(t *testing.T) {
	c := New(Config{MaxWaitDefault: time.Minute, MaxRequests: 3, Priorities: map[string]int{"batch": -1, "bulk": -2}})
	r := newRoom(0)
	out := make(chan result, 8)
	enqueue(t, t.Context(), c, r, "bulk", Request{Objective: "bulk"}, out)
	enqueue(t, t.Context(), c, r, "batch-1", Request{Objective: "batch"}, out)
	enqueue(t, t.Context(), c, r, "batch-2", Request{Objective: "batch"}, out)
	bands := map[int]int{}
	c.Waiting(func(p, n int) { bands[p] = n })
	require.Equal(t, map[int]int{-2: 1, -1: 2, 0: 0}, bands, "the config's bands always, empty or not")

	// Full: a sheddable newcomer displaces only a lower band; a request
	// of band 0 the newest of the lowest band.
	for _, step := range []struct{ newcomer, objective, displaced string }{
		{"batch-3", "batch", "bulk"},
		{"chat", "", "batch-3"},
		{"chat-2", "", "batch-2"},
		{"chat-3", "", "batch-1"},
	} {
		start(t.Context(), c, r, step.newcomer, Request{Objective: step.objective}, out)
		res := <-out
		require.Equal(t, step.displaced, res.name, step.newcomer)
		require.ErrorIs(t, res.err, ErrDisplaced)
		waitFor(t, c, 3)
	}
	// Nothing below band 0's own: refused.
	_, err := c.Wait(t.Context(), r, "", &Request{})
	require.ErrorIs(t, err, ErrFull)
	_, err = c.Wait(t.Context(), r, "", &Request{Objective: "batch"})
	require.ErrorIs(t, err, ErrFull)

	clear(bands)
	c.Waiting(func(p, n int) { bands[p] = n })
	require.Equal(t, map[int]int{-2: 0, -1: 0, 0: 3}, bands)
	require.Equal(t, []string{"chat", "chat-2", "chat-3"}, admitOrder(t, r, out, 3))
}

func TestByteBound(t *testing.T) {
	c := New(Config{MaxWaitDefault: time.Minute, MaxBytes: 1000, Priorities: map[string]int{"batch": -1}})
	r := newRoom(0)
	out := make(chan result, 4)
	enqueue(t, t.Context(), c, r, "batch", Request{Objective: "batch", Bytes: 600}, out)
	_, err := c.Wait(t.Context(), r, "", &Request{Bytes: 2000})
	require.ErrorIs(t, err, ErrFull, "larger than the bound: displaces nobody")
	start(t.Context(), c, r, "chat", Request{Bytes: 600}, out)
	res := <-out
	require.Equal(t, "batch", res.name)
	require.ErrorIs(t, res.err, ErrDisplaced)
	require.Equal(t, []string{"chat"}, admitOrder(t, r, out, 1))
}

// Each group of a leg is a queue of its own: a saturated group does not
// hold up requests for another.
func TestGroups(t *testing.T) {
	c := New(Config{MaxWaitDefault: time.Minute})
	full := newRoom(0)
	out := make(chan result, 1)
	enqueue(t, t.Context(), c, full, "waits", Request{}, out)
	tk, err := c.Wait(t.Context(), newRoom(1), "", &Request{})
	require.NoError(t, err, "another leg with room admits at once")
	tk.Release()
	require.Equal(t, []string{"waits"}, admitOrder(t, full, out, 1))
}

// BenchmarkQueued reports what the queue holds a waiting request with,
// beyond its body: 10,000 requests waiting on a saturated leg.
func BenchmarkQueued(b *testing.B) {
	const waiting = 10_000
	for range b.N {
		c := New(Config{MaxWaitDefault: time.Minute})
		r := newRoom(0)
		ctx, cancel := context.WithCancel(b.Context())
		var wg sync.WaitGroup
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for i := range waiting {
			wg.Go(func() {
				req := Request{Objective: "chat", Flow: fmt.Sprintf("user-%d", i%100), Tokens: 1000, Bytes: 4000}
				c.Wait(ctx, r, "", &req) //nolint:errcheck // cancelled below
			})
		}
		for c.waiting.Load() < waiting {
			time.Sleep(time.Millisecond)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		// Goroutine stacks are the streams' own (each request has one
		// anyway); the heap is what the queue adds.
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/waiting, "heap-B/waiting")
		cancel()
		wg.Wait()
	}
}
