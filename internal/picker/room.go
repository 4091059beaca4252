package picker

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"
)

// ErrSaturated is AwaitRoom's error when no endpoint had room in time.
var ErrSaturated = errors.New("every endpoint is saturated")

// AwaitRoom waits until some endpoint of group (every endpoint: "") has
// room, i.e. the Set does not find them all Saturated, for up to maxWait.
// It returns nil at once when saturation is off or there is room,
// ErrSaturated when maxWait is 0 or passes first, and ctx's error when ctx
// ends first.
//
// A waiter looks again when something may have made room: a lease ending
// or moving, a load observed, an endpoint re-admitted, new endpoints, an
// ejection running out or a saturating load going stale.
func (s *Set) AwaitRoom(ctx context.Context, group string, maxWait time.Duration) error {
	if !s.Saturated(group) {
		return nil
	}
	if maxWait <= 0 {
		return ErrSaturated
	}
	// Counted before the first look: a change after it wakes this waiter.
	s.room.waiters.Add(1)
	defer s.room.waiters.Add(-1)
	deadline := time.NewTimer(maxWait)
	defer deadline.Stop()
	var due *time.Timer // when the Set changes by itself
	defer func() {
		if due != nil {
			due.Stop()
		}
	}()
	for {
		changed := s.room.changed()
		saturated, next := s.saturated(group)
		if !saturated {
			return nil
		}
		var dueC <-chan time.Time
		if next != math.MaxInt64 {
			d := time.Duration(max(next-s.elapsed(), 0))
			if due == nil {
				due = time.NewTimer(d)
			} else {
				due.Reset(d)
			}
			dueC = due.C
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			return ErrSaturated
		case <-changed:
		case <-dueC:
		}
	}
}

// room tells the requests waiting in AwaitRoom that something changed.
// With nobody waiting, wake costs one atomic load.
type room struct {
	waiters atomic.Int32
	mu      sync.Mutex
	// ch is closed on the next wake; nil when nobody asked for it.
	ch chan struct{}
}

// changed returns a channel closed on the next wake.
func (r *room) changed() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ch == nil {
		r.ch = make(chan struct{})
	}
	return r.ch
}

// wake wakes every waiter, for each to look again.
func (r *room) wake() {
	if r.waiters.Load() == 0 {
		return
	}
	r.mu.Lock()
	if r.ch != nil {
		close(r.ch)
		r.ch = nil
	}
	r.mu.Unlock()
}
