package enginemetrics

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/http1"
)

// rawEngine answers every request on every connection with parts, written
// one by one with a pause between them (so the scraper must read more than
// once), and closes the connection after it if closeAfter.
type rawEngine struct {
	addr  string
	conns atomic.Int64 // connections accepted
	reqs  atomic.Int64 // requests read
}

func newRawEngine(t *testing.T, closeAfter bool, parts ...string) *rawEngine {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	e := &rawEngine{addr: l.Addr().String()}
	answer := make([][]byte, len(parts))
	for i, p := range parts {
		answer[i] = []byte(p)
	}
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			e.conns.Add(1)
			go e.serve(conn, closeAfter, answer)
		}
	}()
	return e
}

func (e *rawEngine) serve(conn net.Conn, closeAfter bool, answer [][]byte) {
	defer conn.Close()
	buf := make([]byte, 4<<10)
	for {
		n := 0
		for !bytes.Contains(buf[:n], []byte("\r\n\r\n")) {
			m, err := conn.Read(buf[n:])
			if err != nil {
				return
			}
			n += m
		}
		e.reqs.Add(1)
		for i, p := range answer {
			if i > 0 {
				time.Sleep(time.Millisecond)
			}
			if _, err := conn.Write(p); err != nil {
				return
			}
		}
		if closeAfter {
			return
		}
	}
}

// The answers' parsing is package http1's (its tests have the cases);
// these are about reading them over a connection, and its reuse.
func TestDirectReadsAnswers(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("vllm:num_requests_running 1\n", 5000) // 140 KB: many reads, a grown buffer
	tests := []struct {
		name       string
		parts      []string
		closeAfter bool   // the engine closes the connection after answering
		code       int    // want
		status     string // want, when code is not 200
		body       string // want
		keep       bool   // want the connection kept
	}{
		{
			name:  "content-length",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"},
			code:  200, body: "hello", keep: true,
		},
		{
			name:  "content-length, head and body apart",
			parts: []string{"HTTP/1.1 200 OK\r\nCont", "ent-Length: 11\r\n\r", "\nhello", " world"},
			code:  200, body: "hello world", keep: true,
		},
		{
			name: "chunked, split everywhere",
			parts: []string{"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n", "5", "\r", "\nhel", "lo\r", "\n6\r\n wor", "ld", "\r\n",
				"0\r\n", "\r\n"},
			code: 200, body: "hello world", keep: true,
		},
		{
			name:  "large content-length",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: 140000\r\n\r\n", big[:70000], big[70000:]},
			code:  200, body: big, keep: true,
		},
		{
			name:  "connection close",
			parts: []string{"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"}, closeAfter: true,
			code: 200, body: "ok", keep: false,
		},
		{
			name:  "HTTP/1.0 body to the end",
			parts: []string{"HTTP/1.0 200 OK\r\n\r\nuntil ", "eof"}, closeAfter: true,
			code: 200, body: "until eof", keep: false,
		},
		{
			name:  "error status",
			parts: []string{"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\nstarting\n"},
			code:  503, status: "503 Service Unavailable", body: "starting\n", keep: true,
		},
		{
			name:  "more than the answer: not reused",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1"},
			code:  200, body: "ok", keep: false,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRawEngine(t, tt.closeAfter, tt.parts...)
			d := &direct{address: e.addr}
			t.Cleanup(d.close)
			for range 2 { // the second on the kept connection, or a new one
				a, err := d.get(t.Context(), "/metrics", eventually)
				require.NoError(t, err)
				require.Equal(t, tt.code, a.code)
				require.Equal(t, tt.status, a.status)
				require.Equal(t, tt.body, string(a.body))
				require.Equal(t, tt.keep, d.conn != nil, "connection kept")
			}
			want := int64(2)
			if tt.keep {
				want = 1
			}
			require.Equal(t, want, e.conns.Load(), "connections")
		})
	}
}

func TestDirectBadAnswersFail(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		parts []string
		want  error  // errors.Is, when set
		text  string // in the message
	}{
		{"not HTTP", []string{"SSH-2.0-OpenSSH_9.6\r\n"}, http1.ErrHead, "status line"},
		{"bad chunk size", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"}, http1.ErrChunked, "bad size"},
		{"too large", []string{"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n"}, errTooLarge, "exceeds"},
		{"too large chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffff\r\n"}, errTooLarge, "exceed"},
		{"cut in the head", []string{"HTTP/1.1 200 OK\r\nContent-Le"}, io.ErrUnexpectedEOF, ""},
		{"cut in the body", []string{"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nvllm:num_req"}, io.ErrUnexpectedEOF, ""},
		{"cut in a chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nvllm:"}, io.ErrUnexpectedEOF, ""},
		{"cut before the last chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n"}, io.ErrUnexpectedEOF, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRawEngine(t, true, tt.parts...)
			d := &direct{address: e.addr}
			t.Cleanup(d.close)
			_, err := d.get(t.Context(), "/metrics", eventually)
			require.ErrorIs(t, err, tt.want)
			require.ErrorContains(t, err, tt.text)
			require.ErrorContains(t, err, "GET /metrics: ")
			require.Nil(t, d.conn, "a connection that failed is not reused")
		})
	}
}

func TestDirectTimesOut(t *testing.T) {
	t.Parallel()
	e := newRawEngine(t, false, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nnot all")
	d := &direct{address: e.addr}
	t.Cleanup(d.close)
	_, err := d.get(t.Context(), "/metrics", 50*time.Millisecond)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.EqualValues(t, 1, e.reqs.Load(), "a timed-out scrape is not retried")
}

func TestDirectKeptAliveAllocatesNothing(t *testing.T) {
	// Not parallel: it counts the process's allocations.
	e := newRawEngine(t, false, "HTTP/1.1 200 OK\r\nContent-Length: 28\r\n\r\nvllm:num_requests_running 1\n")
	d := &direct{address: e.addr}
	t.Cleanup(d.close)
	ctx := t.Context()
	_, err := d.get(ctx, "/metrics", eventually) // dials
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(50, func() {
		if _, err := d.get(ctx, "/metrics", eventually); err != nil {
			panic(err)
		}
	})
	require.Less(t, allocs, 1.0)
}

func TestDirectRetriesAConnectionClosedWhileIdle(t *testing.T) {
	t.Parallel()
	// Answers keep-alive, then closes: the scraper finds out only when it
	// sends the next request.
	e := newRawEngine(t, true, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	d := &direct{address: e.addr}
	t.Cleanup(d.close)
	for i := range 3 {
		a, err := d.get(t.Context(), "/metrics", eventually)
		require.NoError(t, err, "scrape %d", i)
		require.Equal(t, "ok", string(a.body))
		require.NotNil(t, d.conn, "the answer did not ask to close")
		time.Sleep(10 * time.Millisecond) // the engine closes meanwhile
	}
	require.EqualValues(t, 3, e.conns.Load())
	require.EqualValues(t, 3, e.reqs.Load(), "each request reached the engine once")
}
