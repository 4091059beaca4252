package connectors

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestEngineIDs(t *testing.T) {
	t.Run("concurrent misses share one query", func(t *testing.T) {
		c := NewEngineIDs(time.Minute)
		var queries atomic.Int32
		release := make(chan struct{})
		query := func(context.Context) ([]byte, error) {
			queries.Add(1)
			<-release
			return []byte(`"e1"`), nil
		}
		var wg sync.WaitGroup
		ids := make([][]byte, 50)
		for i := range ids {
			wg.Go(func() {
				id, err := c.get(t.Context(), "10.0.0.1:8998", query)
				require.NoError(t, err)
				ids[i] = id
			})
		}
		time.Sleep(10 * time.Millisecond) // let them pile up on the one query
		close(release)
		wg.Wait()
		require.EqualValues(t, 1, queries.Load())
		for _, id := range ids {
			require.Equal(t, `"e1"`, string(id))
		}
	})

	t.Run("expired ids and forgotten ids are asked again", func(t *testing.T) {
		c := NewEngineIDs(time.Minute)
		now := time.Now()
		c.now = func() time.Time { return now }
		n := 0
		query := func(context.Context) ([]byte, error) {
			n++
			return []byte(`"e` + string(rune('0'+n)) + `"`), nil
		}
		get := func() string {
			id, err := c.get(t.Context(), "a", query)
			require.NoError(t, err)
			return string(id)
		}
		require.Equal(t, `"e1"`, get())
		require.Equal(t, `"e1"`, get())
		now = now.Add(time.Minute + time.Second)
		require.Equal(t, `"e2"`, get(), "expired")
		c.forget("a", []byte(`"e1"`))
		require.Equal(t, `"e2"`, get(), "forgetting an older id keeps the newer one")
		c.forget("a", []byte(`"e2"`))
		require.Equal(t, `"e3"`, get())
	})

	t.Run("failed queries are not kept", func(t *testing.T) {
		c := NewEngineIDs(time.Minute)
		fail := true
		query := func(context.Context) ([]byte, error) {
			if fail {
				return nil, errors.New("down")
			}
			return []byte(`"e"`), nil
		}
		_, err := c.get(t.Context(), "a", query)
		require.Error(t, err)
		fail = false
		id, err := c.get(t.Context(), "a", query)
		require.NoError(t, err)
		require.Equal(t, `"e"`, string(id))
	})

	t.Run("a waiter whose query-maker went away asks itself", func(t *testing.T) {
		c := NewEngineIDs(time.Minute)
		started := make(chan struct{})
		first, cancel := context.WithCancel(t.Context())
		go func() {
			_, _ = c.get(first, "a", func(ctx context.Context) ([]byte, error) {
				close(started)
				<-ctx.Done()
				return nil, ctx.Err()
			})
		}()
		<-started
		done := make(chan []byte)
		go func() {
			id, err := c.get(t.Context(), "a", func(context.Context) ([]byte, error) { return []byte(`"mine"`), nil })
			require.NoError(t, err)
			done <- id
		}()
		time.Sleep(10 * time.Millisecond)
		cancel()
		require.Equal(t, `"mine"`, string(<-done))
	})

	t.Run("nil asks every time", func(t *testing.T) {
		var c *EngineIDs
		n := 0
		for range 3 {
			_, err := c.get(t.Context(), "a", func(context.Context) ([]byte, error) { n++; return []byte(`"e"`), nil })
			require.NoError(t, err)
		}
		c.forget("a", nil)
		require.Equal(t, 3, n)
	})
}

// The Mooncake connector asks a bootstrap server once for many requests,
// and again after a prefill on that engine failed.
func TestMooncakeEngineIDCached(t *testing.T) {
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().
		On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: `{"0":{"engine_id":"e1"}}`}).
		On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
	env := Env{Engine: eng, EngineIDs: NewEngineIDs(time.Minute)}
	queries := func() (n int) {
		for _, c := range eng.Calls() {
			if c.Method == http.MethodGet {
				n++
			}
		}
		return n
	}
	for range 5 {
		d, err := MooncakeVLLMConnector{}.Prepare(t.Context(), env, req)
		require.NoError(t, err)
		require.NoError(t, <-d.Prefill.Done())
	}
	require.Equal(t, 1, queries())

	eng.On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Err: &engines.Error{Status: 0, Message: "connection refused"}})
	d, err := MooncakeVLLMConnector{}.Prepare(t.Context(), env, req)
	require.NoError(t, err)
	require.Error(t, <-d.Prefill.Done())
	eng.On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
	d, err = MooncakeVLLMConnector{}.Prepare(t.Context(), env, req)
	require.NoError(t, err)
	require.NoError(t, <-d.Prefill.Done())
	require.Equal(t, 2, queries(), "asked again after the engine failed")
}
