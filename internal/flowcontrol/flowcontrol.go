// Package flowcontrol orders the requests that wait for a saturated leg of
// a pool, as llm-d's flow control does: in priority bands (a request's
// objective names its band; negative priorities are sheddable), fairly
// across the flows of a band (round robin, or fewest tokens served), and
// within a flow by arrival or by deadline.
//
// A pool has one Controller. A request asks it for a Ticket before it
// picks on a leg; while the leg has room and nobody waits, that costs an
// atomic load and no allocation. Otherwise the request waits in the
// queue of its leg (a Room, and the endpoint group it must pick in), and
// the queue's dispatcher admits one request at a time whenever the leg
// has room, the best by band, flow and order. An admitted request picks
// and then Releases its ticket, and the dispatcher looks again: it never
// admits a crowd into room for one.
//
// The queue holds the waiting requests' handles, never their bodies; what
// it holds of a request lives in the request's stream until the ticket
// is released.
package flowcontrol

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// Room is a leg of a pool as the queue sees it (picker.Set).
type Room interface {
	// Saturated reports whether every endpoint of group ("": every
	// endpoint) is saturated.
	Saturated(group string) bool
	// AwaitRoom waits until some endpoint of group is not saturated, for
	// up to maxWait; it fails when maxWait passes or ctx ends first.
	AwaitRoom(ctx context.Context, group string, maxWait time.Duration) error
}

// Request is what the queue knows of a waiting request.
type Request struct {
	// Objective is the objective the request named; its priority is the
	// Controller's to look up. Flow is its fairness id; "" puts it in its
	// objective's flow.
	Objective, Flow string
	// Tokens is the prompt's length, which token-usage fairness counts.
	Tokens int
	// Bytes is the request body's size, which the pool's bound counts.
	Bytes int
	// Deadline orders the request within its flow under EDF; zero: after
	// every request with one.
	Deadline time.Time
}

// Errors of Wait; each is a 429 to the client.
var (
	// ErrTimedOut: the leg had no room for the request within its band's
	// longest wait.
	ErrTimedOut = errors.New("no room within the band's longest wait")
	// ErrFull: the pool's waiting requests are at their bound and none of
	// a lower band could make room.
	ErrFull = errors.New("the pool's queue is full")
	// ErrDisplaced: a request of a higher band took the request's place
	// in the full queue.
	ErrDisplaced = errors.New("displaced by a request of a higher priority")
)

// Fairness is how the flows of one band take turns.
type Fairness int

const (
	// RoundRobin serves each flow with a waiting request in turn.
	RoundRobin Fairness = iota
	// TokenUsage serves the flow that has had the fewest prompt tokens
	// admitted (a virtual token counter); a flow that starts waiting
	// starts level with the band's least served, so that idling earns it
	// no credit.
	TokenUsage
)

// Ordering is how the requests of one flow are ordered.
type Ordering int

const (
	// FCFS orders by arrival.
	FCFS Ordering = iota
	// EDF orders by Request.Deadline, earliest first; requests without
	// one come after, by arrival.
	EDF
)

// Config is a Controller's policy.
type Config struct {
	// Priorities maps objectives to their priority; an objective not in
	// it has priority 0.
	Priorities map[string]int
	Fairness   Fairness
	Ordering   Ordering
	// MaxRequests and MaxBytes bound the pool's waiting requests and
	// their bodies' bytes (0: 10,000 and 1 GiB).
	MaxRequests int
	MaxBytes    int64
	// MaxWait is a band's longest wait by priority; MaxWaitDefault that
	// of bands it does not list. A wait of 0 refuses at once.
	MaxWait        map[int]time.Duration
	MaxWaitDefault time.Duration
}

const (
	defaultMaxRequests = 10_000
	defaultMaxBytes    = 1 << 30
	// admitGrace bounds how long the dispatcher waits for an admitted
	// request to count on the leg (Ticket.Release) before it looks again.
	admitGrace = 50 * time.Millisecond
	// lookAgain bounds a dispatcher's wait for room, after which it
	// looks whether anyone still waits.
	lookAgain = 250 * time.Millisecond
)

// Controller is a pool's flow control. It is safe for concurrent use.
type Controller struct {
	cfg Config
	// objectives, when set, are priorities learnt at run time (Kubernetes'
	// InferenceObjectives) under cfg.Priorities, which win.
	objectives atomic.Pointer[map[string]int]
	// waiting counts the requests in every queue: the fast path's one
	// look.
	waiting atomic.Int64

	mu     sync.Mutex
	queues map[queueKey]*queue
	bytes  int64
	seq    uint64
}

type queueKey struct {
	room  Room
	group string
}

// New returns a Controller with cfg.
func New(cfg Config) *Controller {
	if cfg.MaxRequests <= 0 {
		cfg.MaxRequests = defaultMaxRequests
	}
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = defaultMaxBytes
	}
	return &Controller{cfg: cfg, queues: map[queueKey]*queue{}}
}

// SetObjectives replaces the priorities learnt at run time.
func (c *Controller) SetObjectives(priorities map[string]int) {
	c.objectives.Store(&priorities)
}

// Priority is the priority of objective: the config's, else the one learnt
// at run time, else 0.
func (c *Controller) Priority(objective string) int {
	if objective == "" {
		return 0
	}
	if p, ok := c.cfg.Priorities[objective]; ok {
		return p
	}
	if m := c.objectives.Load(); m != nil {
		return (*m)[objective]
	}
	return 0
}

// MaxWait is the longest a request of priority waits.
func (c *Controller) MaxWait(priority int) time.Duration {
	if d, ok := c.cfg.MaxWait[priority]; ok {
		return d
	}
	return c.cfg.MaxWaitDefault
}

// Waiting calls fn with the number of requests waiting in each band, by
// priority, every leg and group together: the bands the config names (0,
// its objectives', its bands') always, others while requests wait in them.
func (c *Controller) Waiting(fn func(priority, n int)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := map[int]int{0: 0}
	for _, p := range c.cfg.Priorities {
		n[p] = 0
	}
	for p := range c.cfg.MaxWait {
		n[p] = 0
	}
	if m := c.objectives.Load(); m != nil {
		for _, p := range *m {
			n[p] = 0
		}
	}
	for _, q := range c.queues {
		for _, b := range q.bands {
			n[b.priority] += b.n
		}
	}
	for p, k := range n {
		fn(p, k)
	}
}

// Ticket is a request's admission to a leg. The zero Ticket (admitted at
// once) needs no Release, though it may be given one.
type Ticket struct {
	w *waiter // nil unless admitted after waiting
	// waited is how long the request waited, admitted or not.
	waited time.Duration
}

// Waited is how long the request waited, also when Wait failed.
func (t Ticket) Waited() time.Duration { return t.waited }

// Release tells the queue that the admitted request counts on the leg now
// (it picked) or will not (it failed), so that the next may be admitted.
// Later Releases do nothing.
func (t Ticket) Release() {
	if t.w != nil {
		t.w.release()
	}
}

// Wait admits req to group of room: at once when the leg has room and
// nobody waits for it, else when the queue's dispatcher admits it. It
// fails with ErrTimedOut, ErrFull or ErrDisplaced, or ctx's error when
// the client goes away first (the request leaves the queue at once).
func (c *Controller) Wait(ctx context.Context, room Room, group string, req *Request) (Ticket, error) {
	if c.waiting.Load() == 0 && !room.Saturated(group) {
		return Ticket{}, nil
	}
	priority := c.Priority(req.Objective)
	maxWait := c.MaxWait(priority)
	c.mu.Lock()
	key := queueKey{room, group}
	q := c.queues[key]
	if (q == nil || q.n == 0) && !room.Saturated(group) {
		c.mu.Unlock()
		return Ticket{}, nil
	}
	if maxWait <= 0 {
		c.mu.Unlock()
		return Ticket{}, ErrTimedOut
	}
	if err := c.makeRoom(priority, req.Bytes); err != nil {
		c.mu.Unlock()
		return Ticket{}, err
	}
	if q == nil {
		q = &queue{c: c, room: room, group: group, released: make(chan *waiter, 1)}
		c.queues[key] = q
	}
	c.seq++
	w := &waiter{
		q: q, priority: priority, tokens: req.Tokens, bytes: int64(req.Bytes), deadline: req.Deadline,
		seq: c.seq, since: time.Now(), ready: make(chan struct{}),
	}
	q.push(w, req.Flow, req.Objective)
	c.waiting.Add(1)
	c.bytes += w.bytes
	if !q.running {
		q.running = true
		go q.dispatch()
	}
	c.mu.Unlock()

	timer := time.NewTimer(maxWait)
	defer timer.Stop()
	var err error
	select {
	case <-w.ready:
	case <-ctx.Done():
		err = ctx.Err()
	case <-timer.C:
		err = ErrTimedOut
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	w.waited = time.Since(w.since)
	if w.state == stateWaiting {
		// Gone before its turn: it leaves the queue at once.
		c.remove(w)
		return Ticket{waited: w.waited}, err
	}
	if w.state == stateDisplaced {
		return Ticket{waited: w.waited}, ErrDisplaced
	}
	// Admitted, perhaps just as it gave up: a client gone gives its turn
	// back at once.
	if ctx.Err() != nil {
		w.release()
		return Ticket{waited: w.waited}, ctx.Err()
	}
	return Ticket{w: w, waited: w.waited}, nil
}

// makeRoom makes room for a request of priority and bytes within the
// bound, displacing the newest waiting requests of the lowest band below
// priority; ErrFull when it cannot. c.mu is held.
func (c *Controller) makeRoom(priority int, bytes int) error {
	for c.waiting.Load()+1 > int64(c.cfg.MaxRequests) || c.bytes+int64(bytes) > c.cfg.MaxBytes {
		if int64(bytes) > c.cfg.MaxBytes {
			return ErrFull
		}
		var victim *waiter
		for _, q := range c.queues {
			if w := q.newestLowest(); w != nil && w.priority < priority &&
				(victim == nil || w.priority < victim.priority || w.priority == victim.priority && w.seq > victim.seq) {
				victim = w
			}
		}
		if victim == nil {
			return ErrFull
		}
		c.remove(victim)
		victim.state = stateDisplaced
		victim.waited = time.Since(victim.since)
		close(victim.ready)
	}
	return nil
}

// remove takes w out of its queue. c.mu is held.
func (c *Controller) remove(w *waiter) {
	w.q.remove(w)
	c.waiting.Add(-1)
	c.bytes -= w.bytes
}

type waiterState uint8

const (
	stateWaiting waiterState = iota
	stateAdmitted
	stateDisplaced
)

// waiter is a request in a queue: in its band's arrival list and in its
// flow's order, by intrusive links, so that leaving is O(1) (FCFS) or
// O(log n) (EDF) and costs no allocation.
type waiter struct {
	q        *queue
	f        *flow
	priority int
	tokens   int
	bytes    int64
	deadline time.Time
	seq      uint64
	since    time.Time
	waited   time.Duration
	state    waiterState
	// ready is closed when the request is admitted or displaced.
	ready    chan struct{}
	released atomic.Bool
	// prev, next link the flow's FCFS list; heapIndex is its place in the
	// flow's EDF heap.
	prev, next *waiter
	heapIndex  int
	// older, newer link the band's arrival list (displacement).
	older, newer *waiter
}

// release tells the dispatcher, if it still waits for w, that w counts on
// the leg.
func (w *waiter) release() {
	if w.released.CompareAndSwap(false, true) {
		select {
		case w.q.released <- w:
		default:
		}
	}
}
