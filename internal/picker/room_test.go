package picker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
)

func TestAwaitRoomAtOnce(t *testing.T) {
	full := Load{Waiting: 9, At: time.Now()}
	for _, tc := range []struct {
		name    string
		sat     Saturation
		full    []endpoint.Endpoint // say their queue is full
		group   string
		maxWait time.Duration
		want    error
	}{
		{name: "saturation off", full: abc, want: nil},
		{name: "room", sat: Saturation{QueueDepth: 5}, full: []endpoint.Endpoint{epA, epB}, maxWait: time.Minute, want: nil},
		{name: "no waiting", sat: Saturation{QueueDepth: 5}, full: abc, want: ErrSaturated},
		{name: "a group without endpoints has room (its pick fails instead)", sat: Saturation{QueueDepth: 5}, full: abc, group: "g", want: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := NewSet(abc, Options{Saturation: tc.sat})
			for _, ep := range tc.full {
				set.Observe(ep.Address, full)
			}
			start := time.Now()
			require.Equal(t, tc.want, set.AwaitRoom(t.Context(), tc.group, tc.maxWait))
			require.Less(t, time.Since(start), 10*time.Second, "at once, not after maxWait")
		})
	}
}

// A waiter looks again when something may have made room, long before
// its maxWait of a minute.
func TestAwaitRoomWakes(t *testing.T) {
	one := []endpoint.Endpoint{epA}
	byQueue := Options{Saturation: Saturation{QueueDepth: 5}}
	byCount := Options{Saturation: Saturation{MaxInFlight: 1}}
	full := func(set *Set, ep endpoint.Endpoint) { set.Observe(ep.Address, Load{Waiting: 9, At: time.Now()}) }
	for _, tc := range []struct {
		name string
		// setup returns a saturated leg, and what to do while a request
		// waits.
		setup func(t *testing.T) (set *Set, after func())
	}{
		{"a lease ends", func(t *testing.T) (*Set, func()) {
			set := NewSet(one, byCount)
			lease := hold(t, set, epA, nil, 0)
			return set, func() { lease.End(Released) }
		}},
		{"a lease moves away", func(t *testing.T) (*Set, func()) {
			set := NewSet([]endpoint.Endpoint{epA, epB}, byCount)
			lease := hold(t, set, epA, nil, 0)
			hold(t, set, epB, nil, 0)
			return set, func() { lease.Move(epC) }
		}},
		{"a lighter load", func(t *testing.T) (*Set, func()) {
			set := NewSet(one, byQueue)
			full(set, epA)
			return set, func() { set.Observe(epA.Address, Load{Waiting: 1, At: time.Now()}) }
		}},
		{"an endpoint re-admitted", func(t *testing.T) (*Set, func()) {
			set := NewSet([]endpoint.Endpoint{epA, epB}, Options{Saturation: byQueue.Saturation, FailureThreshold: 1, CoolDown: time.Hour})
			full(set, epA)
			set.Report(epB, false)
			return set, func() { set.Report(epB, true) }
		}},
		{"new endpoints", func(t *testing.T) (*Set, func()) {
			set := NewSet(one, byQueue)
			full(set, epA)
			return set, func() { set.SetEndpoints(abc) }
		}},
		{"an ejection runs out", func(t *testing.T) (*Set, func()) {
			set := NewSet([]endpoint.Endpoint{epA, epB}, Options{Saturation: byQueue.Saturation, FailureThreshold: 1, CoolDown: 50 * time.Millisecond})
			full(set, epA)
			set.Report(epB, false)
			return set, func() {} // nobody tells the Set
		}},
		{"a saturating load goes stale", func(t *testing.T) (*Set, func()) {
			set := NewSet(one, Options{Saturation: byQueue.Saturation, StaleAfter: 50 * time.Millisecond})
			full(set, epA)
			return set, func() {}
		}},
		{"a lease on the Set a reload replaced ends", func(t *testing.T) (*Set, func()) {
			old := NewSet(one, byCount)
			lease := hold(t, old, epA, nil, 0)
			return NewSet(one, Options{Saturation: byCount.Saturation, Inherit: old}), func() { lease.End(Released) }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set, after := tc.setup(t)
			require.True(t, set.Saturated(""))
			done := make(chan error, 1)
			go func() { done <- set.AwaitRoom(t.Context(), "", time.Minute) }()
			require.Eventually(t, func() bool { return set.room.waiters.Load() == 1 }, 10*time.Second, time.Millisecond, "waiting")
			after()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("still waiting, long after room came")
			}
			require.Zero(t, set.room.waiters.Load())
		})
	}
}

func TestAwaitRoomGivesUp(t *testing.T) {
	set := NewSet([]endpoint.Endpoint{epA}, Options{Saturation: Saturation{MaxInFlight: 1}})
	lease := hold(t, set, epA, nil, 0)
	defer lease.End(Released)

	t.Run("maxWait passes", func(t *testing.T) {
		require.ErrorIs(t, set.AwaitRoom(t.Context(), "", 20*time.Millisecond), ErrSaturated)
	})
	t.Run("ctx ends", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- set.AwaitRoom(ctx, "", time.Minute) }()
		require.Eventually(t, func() bool { return set.room.waiters.Load() == 1 }, 10*time.Second, time.Millisecond)
		cancel()
		select {
		case err := <-done:
			require.True(t, errors.Is(err, context.Canceled), "%v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("still waiting after ctx ended")
		}
	})
	require.Zero(t, set.room.waiters.Load())
}

// Waking costs a picking request nothing when nobody waits.
func TestWakeWithoutWaitersDoesNotAllocate(t *testing.T) {
	set := NewSet(abc, Options{Saturation: Saturation{MaxInFlight: 5}})
	l := newLeg(set, new(RoundRobin), RoleDecode)
	require.Zero(t, testing.AllocsPerRun(100, func() {
		lease, _ := l.Pick(Request{})
		lease.End(Released)
	}))
	require.Nil(t, set.room.ch, "no channel made")
}
