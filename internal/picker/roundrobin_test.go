package picker

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/connectors"
)

func TestRoundRobin(t *testing.T) {
	eps := []connectors.Endpoint{{Address: "127.0.0.1:1"}, {Address: "127.0.0.1:2"}, {Address: "127.0.0.1:3"}}
	rr := NewRoundRobin(eps)
	for i := range 7 {
		require.Equal(t, eps[i%3], rr.Pick())
	}
	require.True(t, rr.Contains(eps[1]))
	require.False(t, rr.Contains(connectors.Endpoint{Address: "10.0.0.1:1"}))
}

func TestRoundRobinConcurrentIsEven(t *testing.T) {
	eps := []connectors.Endpoint{{Address: "127.0.0.1:1"}, {Address: "127.0.0.1:2"}}
	rr := NewRoundRobin(eps)
	var mu sync.Mutex
	counts := map[connectors.Endpoint]int{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				ep := rr.Pick()
				mu.Lock()
				counts[ep]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	require.Equal(t, map[connectors.Endpoint]int{eps[0]: 400, eps[1]: 400}, counts)
}

func BenchmarkRoundRobinPick(b *testing.B) {
	rr := NewRoundRobin([]connectors.Endpoint{{Address: "127.0.0.1:1"}, {Address: "127.0.0.1:2"}})
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			rr.Pick()
		}
	})
}
