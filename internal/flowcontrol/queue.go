package flowcontrol

import (
	"container/heap"
	"context"
	"slices"
	"time"
)

// queue holds the requests waiting for one group of one leg. Every field
// is guarded by its Controller's mu.
type queue struct {
	c     *Controller
	room  Room
	group string
	n     int
	// running: a dispatcher serves the queue.
	running bool
	// released hears the admitted requests that count on the leg.
	released chan *waiter
	// bands with waiting requests, highest priority first.
	bands []*band
}

// band is one priority's waiting requests.
type band struct {
	priority int
	flows    map[string]*flow
	// active are the flows with waiting requests, in the order round
	// robin serves them; next is the one whose turn it is.
	active []*flow
	next   int
	n      int
	// oldest, newest: the band's requests by arrival.
	oldest, newest *waiter
}

// flow is one fairness id's waiting requests within a band.
type flow struct {
	name string
	// head, tail: the FCFS list; edf: the EDF heap.
	head, tail *waiter
	edf        edfHeap
	n          int
	// served counts the prompt tokens admitted (TokenUsage).
	served int64
}

func (q *queue) band(priority int) *band {
	i, found := slices.BinarySearchFunc(q.bands, priority, func(b *band, p int) int { return p - b.priority })
	if found {
		return q.bands[i]
	}
	b := &band{priority: priority, flows: map[string]*flow{}}
	q.bands = slices.Insert(q.bands, i, b)
	return b
}

// push adds w to the queue, in the flow named flowName (else objective).
func (q *queue) push(w *waiter, flowName, objective string) {
	b := q.band(w.priority)
	if flowName == "" {
		flowName = objective
	}
	f := b.flows[flowName]
	if f == nil {
		f = &flow{name: flowName}
		b.flows[flowName] = f
	}
	if f.n == 0 {
		if q.c.cfg.Fairness == TokenUsage && len(b.active) > 0 {
			// Idling earns no credit: a flow starts level with the least
			// served of those waiting.
			f.served = max(f.served, minServed(b.active))
		}
		b.active = append(b.active, f)
	}
	w.f = f
	if q.c.cfg.Ordering == EDF {
		heap.Push(&f.edf, w)
	} else {
		w.prev = f.tail
		if f.tail != nil {
			f.tail.next = w
		} else {
			f.head = w
		}
		f.tail = w
	}
	f.n++
	w.older = b.newest
	if b.newest != nil {
		b.newest.newer = w
	} else {
		b.oldest = w
	}
	b.newest = w
	b.n++
	q.n++
}

func minServed(flows []*flow) int64 {
	m := flows[0].served
	for _, f := range flows[1:] {
		m = min(m, f.served)
	}
	return m
}

// remove takes w out of the queue.
func (q *queue) remove(w *waiter) {
	b, f := q.band(w.priority), w.f
	if q.c.cfg.Ordering == EDF {
		heap.Remove(&f.edf, w.heapIndex)
	} else {
		if w.prev != nil {
			w.prev.next = w.next
		} else {
			f.head = w.next
		}
		if w.next != nil {
			w.next.prev = w.prev
		} else {
			f.tail = w.prev
		}
		w.prev, w.next = nil, nil
	}
	f.n--
	if w.older != nil {
		w.older.newer = w.newer
	} else {
		b.oldest = w.newer
	}
	if w.newer != nil {
		w.newer.older = w.older
	} else {
		b.newest = w.older
	}
	w.older, w.newer = nil, nil
	b.n--
	q.n--
	if f.n == 0 {
		i := slices.Index(b.active, f)
		b.active = slices.Delete(b.active, i, i+1)
		if i < b.next {
			b.next--
		}
		delete(b.flows, f.name)
	}
	if b.oldest == nil {
		i := slices.Index(q.bands, b)
		q.bands = slices.Delete(q.bands, i, i+1)
	}
}

// best is the request to admit next: the highest band's, from the flow
// whose turn it is, first in the flow's order; nil when none waits.
func (q *queue) best() *waiter {
	if len(q.bands) == 0 {
		return nil
	}
	b := q.bands[0]
	var f *flow
	if q.c.cfg.Fairness == TokenUsage {
		for i, o := range b.active {
			if i == 0 || o.served < f.served {
				f = o
			}
		}
	} else {
		if b.next >= len(b.active) {
			b.next = 0
		}
		f = b.active[b.next]
		// The next flow's turn after this one; remove keeps it in step
		// when this flow empties.
		b.next++
	}
	f.served += int64(max(f.first().tokens, 1))
	return f.first()
}

func (f *flow) first() *waiter {
	if len(f.edf) > 0 {
		return f.edf[0]
	}
	return f.head
}

// newestLowest is the newest request of the lowest band, nil when none
// waits: the first to be displaced.
func (q *queue) newestLowest() *waiter {
	if len(q.bands) == 0 {
		return nil
	}
	return q.bands[len(q.bands)-1].newest
}

// dispatch admits the queue's requests one at a time while the leg has
// room, and returns when nobody waits.
func (q *queue) dispatch() {
	c := q.c
	grace := time.NewTimer(admitGrace)
	grace.Stop()
	for {
		c.mu.Lock()
		if q.n == 0 {
			q.running = false
			delete(c.queues, queueKey{q.room, q.group})
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		if q.room.AwaitRoom(context.Background(), q.group, lookAgain) != nil {
			continue
		}
		c.mu.Lock()
		w := q.best()
		if w == nil {
			c.mu.Unlock()
			continue
		}
		c.remove(w)
		w.state = stateAdmitted
		close(w.ready)
		c.mu.Unlock()
		// The next looks once this one counts on the leg, or after a
		// grace for one that never says.
		grace.Reset(admitGrace)
	await:
		for {
			select {
			case r := <-q.released:
				if r == w {
					break await
				}
				// One admitted before, late: it counts already.
			case <-grace.C:
				break await
			}
		}
		grace.Stop()
	}
}

// edfHeap orders a flow's requests by deadline, those without one last,
// ties by arrival.
type edfHeap []*waiter

func (h edfHeap) Len() int { return len(h) }
func (h edfHeap) Less(i, j int) bool {
	a, b := h[i], h[j]
	switch {
	case a.deadline.IsZero() != b.deadline.IsZero():
		return !a.deadline.IsZero()
	case !a.deadline.Equal(b.deadline):
		return a.deadline.Before(b.deadline)
	}
	return a.seq < b.seq
}
func (h edfHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIndex, h[j].heapIndex = i, j
}
func (h *edfHeap) Push(x any) {
	w := x.(*waiter)
	w.heapIndex = len(*h)
	*h = append(*h, w)
}
func (h *edfHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return w
}
