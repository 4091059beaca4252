package engines

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// newEngine returns an engine whose idle connections are closed when the test
// ends, so that no keep-alive connection outlives its test server.
func newEngine(t *testing.T) *HTTP {
	t.Helper()
	e := NewHTTP()
	t.Cleanup(e.CloseIdleConnections)
	return e
}

// endpointOf is the endpoint.Endpoint of a test server: Post takes "ip:port", not a URL.
func endpointOf(srv *httptest.Server) endpoint.Endpoint {
	return endpoint.Endpoint{Address: srv.Listener.Addr().String()}
}

func TestHTTPPostRequest(t *testing.T) {
	const body = `{"model":"m","prompt":"hi","max_tokens":1}`
	const answer = `{"id":"cmpl-1","choices":[{"text":"x"}]}`
	type seen struct {
		method, path, contentType, requestID, rank string
		body                                       []byte
	}
	got := make(chan seen, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		got <- seen{r.Method, r.URL.Path, r.Header.Get("Content-Type"), r.Header.Get("X-Request-Id"), r.Header.Get("X-data-parallel-rank"), b}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	}))
	defer srv.Close()

	out, err := newEngine(t).Post(t.Context(), endpointOf(srv), "/v1/completions", "req-42", endpoint.Rank{}, net.Buffers{[]byte(body)})
	require.NoError(t, err)
	require.Equal(t, answer, string(out))

	s := <-got
	require.Equal(t, http.MethodPost, s.method)
	require.Equal(t, "/v1/completions", s.path)
	require.Equal(t, "application/json", s.contentType)
	require.Equal(t, "req-42", s.requestID)
	require.Equal(t, body, string(s.body), "the body must reach the engine byte for byte")
	require.Empty(t, s.rank, "no DP rank named")

	for _, rank := range []int{0, 7, 130} {
		_, err = newEngine(t).Post(t.Context(), endpointOf(srv), "/v1/completions", "req-43", endpoint.RankOf(rank), net.Buffers{[]byte(body)})
		require.NoError(t, err)
		require.Equal(t, strconv.Itoa(rank), (<-got).rank, "the DP rank, in vLLM's X-data-parallel-rank")
	}
}

func TestHTTPPostErrorAnswer(t *testing.T) {
	long := strings.Repeat("x", 300)
	tests := []struct {
		name    string
		status  int
		answer  string
		message string
	}{
		{
			name:    "OpenAI error object",
			status:  http.StatusBadRequest,
			answer:  `{"error":{"message":"max_tokens is too large","type":"invalid_request_error","code":400}}`,
			message: "max_tokens is too large",
		},
		{
			name:    "vLLM older top-level message",
			status:  http.StatusBadRequest,
			answer:  `{"object":"error","message":"prompt too long","type":"BadRequestError","code":400}`,
			message: "prompt too long",
		},
		{
			name:    "nested message wins over top-level",
			status:  http.StatusInternalServerError,
			answer:  `{"error":{"message":"inner"},"message":"outer"}`,
			message: "inner",
		},
		{
			// A string "error" is not OpenAI's shape; the raw answer is kept.
			name:    "error as a string",
			status:  http.StatusBadGateway,
			answer:  `{"error":"boom"}`,
			message: `{"error":"boom"}`,
		},
		{
			name:    "plain text",
			status:  http.StatusServiceUnavailable,
			answer:  "upstream overloaded",
			message: "upstream overloaded",
		},
		{
			// Engines may answer with an HTML page; a log line needs a prefix only.
			name:    "long plain text is truncated",
			status:  http.StatusInternalServerError,
			answer:  long,
			message: long[:200] + "...",
		},
		{
			name:    "empty",
			status:  http.StatusNotFound,
			answer:  "",
			message: "",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				io.WriteString(w, tc.answer)
			}))
			defer srv.Close()
			ep := endpointOf(srv)

			out, err := newEngine(t).Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
			require.Nil(t, out)
			ee, ok := errors.AsType[*Error](err)
			require.True(t, ok, "want *Error, got %T: %v", err, err)
			require.Equal(t, ep, ee.Endpoint)
			require.Equal(t, tc.status, ee.Status)
			require.Equal(t, tc.message, ee.Message)
			require.NoError(t, ee.Err, "an error answer is not a transport failure")
			require.Contains(t, err.Error(), fmt.Sprintf("prefill engine %s answered %d", ep.Address, tc.status))
		})
	}
}

func TestHTTPPostAnswerSize(t *testing.T) {
	tests := []struct {
		name   string
		status int
		size   int
		tooBig bool
	}{
		{name: "at the limit", status: http.StatusOK, size: maxAnswerBytes},
		{name: "over the limit", status: http.StatusOK, size: maxAnswerBytes + 1, tooBig: true},
		// The size check comes first, so a huge error page is not parsed.
		{name: "error answer over the limit", status: http.StatusInternalServerError, size: maxAnswerBytes + 1, tooBig: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				w.WriteHeader(tc.status)
				w.Write(make([]byte, tc.size))
			}))
			defer srv.Close()

			out, err := newEngine(t).Post(t.Context(), endpointOf(srv), "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
			if !tc.tooBig {
				require.NoError(t, err)
				require.Len(t, out, tc.size)
				return
			}
			require.Nil(t, out)
			require.ErrorIs(t, err, ErrBadAnswer)
			ee, ok := errors.AsType[*Error](err)
			require.True(t, ok, "want *Error, got %T: %v", err, err)
			require.Equal(t, tc.status, ee.Status)
		})
	}
}

func TestHTTPPostConnectionRefused(t *testing.T) {
	// A free loopback port is one nobody listens on.
	ep := endpoint.Endpoint{Address: loopback.FreeAddr(t)}

	out, err := newEngine(t).Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
	require.Nil(t, out)
	ee, ok := errors.AsType[*Error](err)
	require.True(t, ok, "want *Error, got %T: %v", err, err)
	require.Equal(t, ep, ee.Endpoint)
	require.Zero(t, ee.Status, "no answer was received")
	require.ErrorIs(t, err, syscall.ECONNREFUSED, "the cause must stay visible through Error")
	require.Contains(t, err.Error(), "prefill engine "+ep.Address)
	// *url.Error's prefix would repeat the address Error already names.
	require.NotContains(t, err.Error(), `Post "http://`)
}

func TestHTTPPostContextEnds(t *testing.T) {
	tests := []struct {
		name string
		// ctx returns the call's context and, for a cancellation, the function
		// to call once the engine holds the request.
		ctx  func(t *testing.T) (context.Context, func())
		want error
	}{
		{
			name: "cancelled",
			ctx: func(t *testing.T) (context.Context, func()) {
				ctx, cancel := context.WithCancel(t.Context())
				return ctx, cancel
			},
			want: context.Canceled,
		},
		{
			name: "deadline",
			ctx: func(t *testing.T) (context.Context, func()) {
				ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
				t.Cleanup(cancel)
				return ctx, func() {}
			},
			want: context.DeadlineExceeded,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			arrived := make(chan struct{})
			// The handler hangs like a stuck engine until the client goes away.
			// The server notices a closed connection only once the body is read.
			srv := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				close(arrived)
				<-r.Context().Done()
			}))
			defer srv.Close()

			ctx, cancel := tc.ctx(t)
			e := newEngine(t)
			done := make(chan error, 1)
			go func() {
				_, err := e.Post(ctx, endpointOf(srv), "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
				done <- err
			}()
			// A deadline may pass before the request arrives; either way the
			// context has ended by the time Post returns.
			select {
			case <-arrived:
			case <-ctx.Done():
			}
			cancel()

			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second): // a guard against hanging, not a speed check
				t.Fatal("Post did not return after its context ended")
			}
			require.ErrorIs(t, err, tc.want)
			ee, ok := errors.AsType[*Error](err)
			require.True(t, ok, "want *Error, got %T: %v", err, err)
			require.Zero(t, ee.Status)
			require.NotContains(t, err.Error(), `Post "http://`)
		})
	}
}

// countingServer serves handler and counts the connections it accepts.
func countingServer(t *testing.T, handler http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	srv := httptest.NewUnstartedServer(handler)
	var conns atomic.Int64
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

func TestHTTPReusesConnections(t *testing.T) {
	var calls atomic.Int64
	srv, conns := countingServer(t, func(w http.ResponseWriter, _ *http.Request) {
		// Every other answer is an error: reading error answers to the end
		// must keep their connections reusable too.
		if calls.Add(1)%2 == 0 {
			http.Error(w, `{"error":{"message":"busy"}}`, http.StatusServiceUnavailable)
			return
		}
		io.WriteString(w, `{"ok":true}`)
	})

	e := newEngine(t)
	for i := range 20 {
		_, err := e.Post(t.Context(), endpointOf(srv), "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
		if i%2 == 0 {
			require.NoError(t, err, "call %d", i)
		} else {
			require.Error(t, err, "call %d", i)
		}
	}
	require.EqualValues(t, 20, calls.Load())
	require.EqualValues(t, 1, conns.Load(), "sequential calls must share one keep-alive connection")
}

func TestNewTransport(t *testing.T) {
	tr := NewTransport()
	// Go's default of 2 idle connections per host makes a busy router redial.
	require.GreaterOrEqual(t, tr.MaxIdleConnsPerHost, 100*http.DefaultMaxIdleConnsPerHost)
	require.True(t, tr.MaxIdleConns == 0 || tr.MaxIdleConns >= tr.MaxIdleConnsPerHost,
		"the pool-wide cap must not undercut the per-host one")
	// Engines are addressed directly; HTTP_PROXY in the environment must not apply.
	require.Nil(t, tr.Proxy)
}

// rawEngine is an HTTP/1.1 engine on a bare listener: serve handles each
// connection, and conns counts them.
func rawEngine(t *testing.T, serve func(c net.Conn, br *bufio.Reader)) (endpoint.Endpoint, *atomic.Int64) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	var conns atomic.Int64
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer c.Close()
				serve(c, bufio.NewReader(c))
			}()
		}
	}()
	return endpoint.Endpoint{Address: l.Addr().String()}, &conns
}

// answerOK reads one request from br and answers it with a kept-alive 200.
func answerOK(t *testing.T, c net.Conn, br *bufio.Reader) bool {
	req, err := http.ReadRequest(br)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, req.Body)
	_, err = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}")
	return err == nil
}

// An engine that closes a kept-alive connection after its answer, without
// saying so (as an HTTP server's idle timeout does): the next call finds
// the connection dead before a byte of its answer came and is sent again
// on a new one.
func TestHTTPPostRetriesAClosedIdleConnection(t *testing.T) {
	ep, conns := rawEngine(t, func(c net.Conn, br *bufio.Reader) { answerOK(t, c, br) })
	e := newEngine(t)
	for i := range 3 {
		out, err := e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
		require.NoError(t, err, "call %d", i)
		require.JSONEq(t, `{"ok":true}`, string(out))
		time.Sleep(20 * time.Millisecond) // the engine's close arrives
	}
	require.EqualValues(t, 3, conns.Load(), "a connection for each call")
}

// When every idle connection died together (the engine's keep-alive
// timeout after a burst), the retry dials a new one rather than taking the
// next dead one.
func TestHTTPPostRetriesOnANewConnection(t *testing.T) {
	var opened sync.WaitGroup
	opened.Add(2)
	var accepted atomic.Int64
	ep, conns := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		if accepted.Add(1) <= 2 {
			opened.Done()
			opened.Wait() // both calls of the burst hold a connection
		}
		answerOK(t, c, br)
	})
	e := newEngine(t)
	var burst sync.WaitGroup
	for range 2 {
		burst.Go(func() {
			_, err := e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
			require.NoError(t, err)
		})
	}
	burst.Wait()
	time.Sleep(20 * time.Millisecond) // the engine's closes arrive
	out, err := e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
	require.NoError(t, err)
	require.JSONEq(t, `{"ok":true}`, string(out))
	require.EqualValues(t, 3, conns.Load(), "the burst's two, then a new one")
}

// An engine that closes a connection in the middle of its answer is not
// sent the request again: it may be computing it.
func TestHTTPPostDoesNotRetryAPartialAnswer(t *testing.T) {
	var calls atomic.Int64
	ep, _ := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for {
			if calls.Add(1) > 1 {
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial")
				return
			}
			if !answerOK(t, c, br) {
				return
			}
		}
	})
	e := newEngine(t)
	_, err := e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
	require.NoError(t, err)
	_, err = e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
	ee, ok := errors.AsType[*Error](err)
	require.True(t, ok, "want *Error, got %T: %v", err, err)
	require.Equal(t, 200, ee.Status)
	require.Equal(t, "reading answer", ee.Message)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	require.EqualValues(t, 2, calls.Load(), "sent once")
}

// An interim answer (103 Early Hints, or a 100 Continue pdx did not ask
// for) is passed over for the final one, and the connection stays usable.
func TestHTTPPostSkipsInterimAnswers(t *testing.T) {
	ep, conns := rawEngine(t, func(c net.Conn, br *bufio.Reader) {
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, req.Body)
			_, _ = io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
			time.Sleep(time.Millisecond)
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"); err != nil {
				return
			}
		}
	})
	e := newEngine(t)
	for range 2 {
		out, err := e.Post(t.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
		require.NoError(t, err)
		require.JSONEq(t, `{"ok":true}`, string(out))
	}
	require.EqualValues(t, 1, conns.Load(), "one connection for both")
}

// Connections idle longer than the engines' keep-alive timeout are not
// used again, and an answer that asks to close its connection closes it.
func TestHTTPPostIdleConnections(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Request-Id") == "close" {
			w.Header().Set("Connection", "close")
		}
		io.WriteString(w, `{"ok":true}`)
	})
	e := newEngine(t)
	e.conns.maxIdleTime = 50 * time.Millisecond
	post := func(id string) {
		_, err := e.Post(t.Context(), endpointOf(srv), "/v1/completions", id, endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
		require.NoError(t, err)
	}
	post("a")
	post("b")
	require.EqualValues(t, 1, conns.Load(), "kept alive")
	time.Sleep(100 * time.Millisecond)
	post("c")
	require.EqualValues(t, 2, conns.Load(), "too long idle: a new one")
	post("close")
	post("d")
	require.EqualValues(t, 3, conns.Load(), "closed at the engine's word")
}

// What goes into the request line and headers as it is must be one token.
func TestHTTPPostRefusesHeaderInjection(t *testing.T) {
	ep, conns := rawEngine(t, func(c net.Conn, br *bufio.Reader) { answerOK(t, c, br) })
	e := newEngine(t)
	for _, tc := range []struct{ path, id string }{
		{"/v1/completions", "r\r\nX-Evil: 1"},
		{"/v1/completions HTTP/1.0\r\n", "r"},
	} {
		_, err := e.Post(t.Context(), ep, tc.path, tc.id, endpoint.Rank{}, net.Buffers{[]byte(`{}`)})
		require.ErrorIs(t, err, errHeaderValue, "%q %q", tc.path, tc.id)
	}
	require.Zero(t, conns.Load(), "nothing was sent")
}

// BenchmarkPost is a prefill call (a prompt of 1 or 32 KiB in three
// pieces, a small answer) over loopback to a Go HTTP server in the same
// process, side by side through net/http's Transport (as Post was before
// it had its own connections) and through Post. The server's work is in
// both.
func BenchmarkPost(b *testing.B) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"cmpl-1","choices":[{"text":"x"}],"kv_transfer_params":{"remote_block_ids":[1,2,3]}}`)
	}))
	defer srv.Close()
	ep := endpointOf(srv)
	for _, size := range []int{1 << 10, 32 << 10} {
		prompt := []byte(strings.Repeat("x", size))
		body := net.Buffers{[]byte(`{"model":"m","prompt":"`), prompt, []byte(`","max_tokens":1}`)}
		b.Run(fmt.Sprintf("net-http/%dKiB", size>>10), func(b *testing.B) {
			client := &http.Client{Transport: NewTransport()}
			defer client.CloseIdleConnections()
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				req, err := http.NewRequestWithContext(b.Context(), http.MethodPost, srv.URL+"/v1/completions", io.MultiReader(
					bytes.NewReader(body[0]), bytes.NewReader(body[1]), bytes.NewReader(body[2])))
				if err != nil {
					b.Fatal(err)
				}
				req.ContentLength = int64(len(body[0]) + len(body[1]) + len(body[2]))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Request-Id", "r")
				resp, err := client.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
		})
		b.Run(fmt.Sprintf("pdx/%dKiB", size>>10), func(b *testing.B) {
			e := NewHTTP()
			defer e.CloseIdleConnections()
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := e.Post(b.Context(), ep, "/v1/completions", "r", endpoint.Rank{}, body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
