package fakeengine_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// Both fakes are engines the connectors can call.
var (
	_ connectors.Engine = (*fakeengine.Engine)(nil)
	_ connectors.Engine = fakeengine.Fixed{}
)

var ep = endpoint.Endpoint{Address: "10.0.0.1:8100", KVAddress: "10.0.0.1:21001"}

func TestReplies(t *testing.T) {
	boom := errors.New("boom")
	e := fakeengine.New().
		On(http.MethodPost, ep.Address, "/exact", fakeengine.Reply{Body: "exact"}).
		On(http.MethodPost, ep.Address, "", fakeengine.Reply{Body: "any path"}).
		On(http.MethodPost, "", "/exact", fakeengine.Reply{Body: "any address"}).
		On(http.MethodPost, "", "", fakeengine.Reply{Err: boom}).
		On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Fn: func(_ context.Context, c fakeengine.Call) ([]byte, error) {
			return []byte(c.Method + " " + c.Endpoint.Address + c.Path), nil
		}})
	post := func(ep endpoint.Endpoint, path string) ([]byte, error) {
		return e.Post(t.Context(), ep, path, "id", endpoint.Rank{}, net.Buffers{[]byte(`{"a":`), []byte(`1}`)})
	}
	other := endpoint.Endpoint{Address: "10.0.0.9:1"}
	for _, tc := range []struct {
		ep   endpoint.Endpoint
		path string
		want string
	}{{ep, "/exact", "exact"}, {ep, "/other", "any path"}, {other, "/exact", "any address"}} {
		got, err := post(tc.ep, tc.path)
		require.NoError(t, err)
		require.Equal(t, tc.want, string(got))
	}
	_, err := post(other, "/other")
	require.ErrorIs(t, err, boom)
	got, err := e.Get(t.Context(), "10.0.0.1:8998", "/query")
	require.NoError(t, err)
	require.Equal(t, "GET 10.0.0.1:8998/query", string(got))

	_, err = e.Get(t.Context(), "10.0.0.1:8998", "/other")
	ee, ok := errors.AsType[*engines.Error](err)
	require.True(t, ok, "unprogrammed calls fail with an *engines.Error, got %T", err)
	require.Equal(t, 404, ee.Status)
	require.Equal(t, endpoint.Endpoint{Address: "10.0.0.1:8998"}, ee.Endpoint)
	require.Contains(t, ee.Message, "GET 10.0.0.1:8998/other")

	calls := e.Calls()
	require.Len(t, calls, 6)
	require.Equal(t, fakeengine.Call{Method: http.MethodPost, Endpoint: ep, Path: "/exact", RequestID: "id", Body: `{"a":1}`}, calls[0])
	require.Equal(t, fakeengine.Call{Method: http.MethodGet, Endpoint: endpoint.Endpoint{Address: "10.0.0.1:8998"}, Path: "/other"}, calls[5])
	calls[0].Body = "changed"
	require.Equal(t, `{"a":1}`, e.Calls()[0].Body, "Calls returns a copy")
}

func TestBlock(t *testing.T) {
	var e fakeengine.Engine // the zero Engine is ready to use
	e.On(http.MethodPost, "", "", fakeengine.Reply{Block: true, Body: "never"})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		_, err := e.Post(ctx, ep, "/p", "id", endpoint.Rank{}, nil)
		done <- err
	}()
	c := <-e.Blocked()
	require.Equal(t, "/p", c.Path)
	require.Empty(t, e.Calls(), "a held call is recorded when it ends")
	cancel()
	err := <-done
	ee, ok := errors.AsType[*engines.Error](err)
	require.True(t, ok, "got %T", err)
	require.Equal(t, ep, ee.Endpoint)
	require.ErrorIs(t, err, context.Canceled)
	calls := e.Calls()
	require.Len(t, calls, 1)
	require.ErrorIs(t, calls[0].CtxErr, context.Canceled)
}

func TestConcurrentUse(t *testing.T) {
	e := fakeengine.New().On(http.MethodPost, "", "", fakeengine.Reply{Body: "ok"})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				_, _ = e.Post(t.Context(), ep, "/p", "id", endpoint.Rank{}, nil)
				_ = e.Calls()
			}
		})
	}
	wg.Wait()
	require.Len(t, e.Calls(), 400)
}

func TestFixedDoesNotAllocate(t *testing.T) {
	var eng connectors.Engine = fakeengine.Fixed{PostAnswer: []byte("post"), GetAnswer: []byte("get")}
	ctx := t.Context()
	allocs := testing.AllocsPerRun(100, func() {
		if b, _ := eng.Post(ctx, ep, "/p", "id", endpoint.Rank{}, nil); string(b) != "post" {
			t.Fatal(string(b))
		}
		if b, _ := eng.Get(ctx, ep.Address, "/q"); string(b) != "get" {
			t.Fatal(string(b))
		}
	})
	require.Zero(t, allocs)
}
