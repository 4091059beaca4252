package engines

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/propagation"

	"github.com/pdx-router/pdx/internal/http1"
)

// Posts to engines, pdx's hot path (every prefill), go over kept-alive
// HTTP/1.1 connections of pdx's own rather than net/http's Transport. A
// call is then one writev of the request's head and body pieces and a
// read or two, on the caller's goroutine. The Transport hands every
// request to a connection's write goroutine and every answer back from its
// read goroutine, and copies a body through a 32 KiB buffer it allocates
// per request (its io.LimitReader hides the pieces from writev); under
// load that was a fifth of pdx's CPU. Answers are read into a buffer the
// connection keeps (package http1: lengths, chunking, interim answers and
// keep-alive as net/http reads them): http.ReadResponse and io.ReadAll were
// 6% of pdx's CPU at 1 KiB prompts and 11 allocations a call.
//
// Without a goroutine reading each idle connection, an engine's closing
// one is seen only when it is next used: a connection idle longer than
// idleTimeout is not used again, and a call whose reused connection fails
// before a byte of the answer came is sent once more on a new one, as
// net/http does.

const (
	// idleTimeout is below the keep-alive timeout of the engines' HTTP
	// servers (uvicorn's, vLLM's and SGLang's: 5 s), so that pdx drops an
	// idle connection before the engine does.
	idleTimeout = 4 * time.Second
	// maxIdlePerHost and maxIdle bound the idle connections kept.
	maxIdlePerHost = 1024
	maxIdle        = 4096
	dialTimeout    = 5 * time.Second
	// keepBufferSize bounds the answer buffer an idle connection keeps:
	// answers are a few hundred bytes to a few KiB; the kv_transfer_params
	// of a long prompt's prefill can be hundreds of KiB.
	keepBufferSize = 64 << 10
)

// conn is a kept-alive connection to one engine.
type conn struct {
	net.Conn
	buf       []byte // the answer is read into it
	read      int    // bytes of the answer read
	idleSince time.Time
	bufs      net.Buffers // scratch for writev
}

// pool holds the idle connections, by address, the most recently used
// last.
type pool struct {
	mu   sync.Mutex
	idle map[string][]*conn
	n    int
	// maxIdleTime overrides idleTimeout (tests).
	maxIdleTime time.Duration
}

// get returns an idle connection to address, or dials one; reused tells
// which. fresh dials one whatever is idle.
func (p *pool) get(ctx context.Context, address string, fresh bool) (c *conn, reused bool, err error) {
	now := time.Now()
	p.mu.Lock()
	list := p.idle[address]
	if n := len(list); n > 0 && !fresh {
		c = list[n-1]
		list[n-1] = nil
		list = list[:n-1]
		var stale []*conn
		if now.Sub(c.idleSince) >= cmp.Or(p.maxIdleTime, idleTimeout) {
			// It and every one below it, idle longer still.
			stale = append(list, c)
			c, list = nil, nil
		}
		p.n -= n - len(list)
		if len(list) == 0 {
			delete(p.idle, address)
		} else {
			p.idle[address] = list
		}
		p.mu.Unlock()
		for _, s := range stale {
			_ = s.Close()
		}
	} else {
		p.mu.Unlock()
	}
	if c != nil {
		return c, true, nil
	}
	nc, err := (&net.Dialer{Timeout: dialTimeout, KeepAlive: 30 * time.Second}).DialContext(ctx, "tcp", address)
	if err != nil {
		return nil, false, err
	}
	return &conn{Conn: nc}, false, nil
}

// put keeps c for the next call to its address, or closes it when the
// pool is full.
func (p *pool) put(address string, c *conn) {
	c.idleSince = time.Now()
	p.mu.Lock()
	if p.n >= maxIdle || len(p.idle[address]) >= maxIdlePerHost {
		p.mu.Unlock()
		_ = c.Close()
		return
	}
	if p.idle == nil {
		p.idle = map[string][]*conn{}
	}
	p.idle[address] = append(p.idle[address], c)
	p.n++
	p.mu.Unlock()
}

// closeIdle closes every idle connection.
func (p *pool) closeIdle() {
	p.mu.Lock()
	idle := p.idle
	p.idle, p.n = nil, 0
	p.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			_ = c.Close()
		}
	}
}

// deadlinePast makes any I/O on a connection fail at once.
var deadlinePast = time.Unix(1, 0)

// post sends one POST to address and reads its answer, at most
// maxAnswerBytes of it: the status and the body. A connection that
// failed, was not read to its end or that the engine asked to close is
// not kept. The error is ctx's when ctx ended first; status is not 0 with
// an error when the answer's body failed.
func (p *pool) post(ctx context.Context, address string, head []byte, body net.Buffers) (status int, answer []byte, err error) {
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return 0, nil, err
		}
		// The retry dials: the connections idle beside the dead one went
		// idle with it and are likely dead too (an engine's keep-alive
		// timer runs from its answer, pdx's from reading it, later on a
		// starved machine).
		c, reused, gerr := p.get(ctx, address, attempt > 0)
		if gerr != nil {
			return 0, nil, gerr
		}
		var keep bool
		status, answer, keep, err = c.roundTrip(ctx, head, body)
		if err == nil {
			if keep {
				p.put(address, c)
			} else {
				_ = c.Close()
			}
			return status, answer, nil
		}
		_ = c.Close()
		if cerr := ctx.Err(); cerr != nil {
			return 0, nil, cerr
		}
		if !reused || c.read > 0 || attempt > 0 {
			return status, nil, err
		}
		// The engine closed the idle connection as the request went out.
	}
}

// roundTrip writes head and body on c and reads the answer. ctx's end
// aborts the I/O in flight.
func (c *conn) roundTrip(ctx context.Context, head []byte, body net.Buffers) (status int, answer []byte, keep bool, err error) {
	if err := c.SetDeadline(time.Time{}); err != nil {
		return 0, nil, false, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(deadlinePast) })
	defer func() {
		if !stop() {
			keep = false // aborted, or being aborted: its deadline is past
		}
	}()
	c.read = 0
	c.bufs = append(append(c.bufs[:0], head), body...)
	w := c.bufs // WriteTo consumes its slice; c.bufs keeps the array
	_, err = w.WriteTo(c.Conn)
	clear(c.bufs) // keeps no reference to the body
	if err != nil {
		return 0, nil, false, err
	}
	a, buf, got, err := http1.Read(c.Conn, c.buf, 0, maxAnswerBytes)
	c.read = got
	if cap(buf) <= keepBufferSize {
		c.buf = buf
	} else {
		c.buf = nil // a rare large answer's buffer is not kept idle
	}
	if errors.Is(err, http1.ErrTooLarge) {
		return a.Code, nil, false, fmt.Errorf("%w: answer over %d bytes", ErrBadAnswer, maxAnswerBytes)
	}
	if err != nil {
		return a.Code, nil, false, err // the Code when only the body failed
	}
	// The caller keeps the answer; the connection's buffer goes on.
	return a.Code, bytes.Clone(a.Body), a.Keep, nil
}

// errHeaderValue refuses a request line or header that would not be one.
var errHeaderValue = errors.New("invalid character in request path or id")

// headerSafe reports whether s can go into a request line or a header
// value as it is: printable ASCII, no spaces.
func headerSafe(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return true
}

// requestHead is a POST's request line and headers: those net/http would
// send for Post, and the trace context of ctx's span (W3C traceparent),
// so that the engine's span is its child; with tracing off, none.
func requestHead(ctx context.Context, dst []byte, address, path, requestID string, rank int, hasRank bool, length int64) []byte {
	dst = append(dst, "POST "...)
	dst = append(dst, path...)
	dst = append(dst, " HTTP/1.1\r\nHost: "...)
	dst = append(dst, address...)
	dst = append(dst, "\r\nUser-Agent: pdx\r\nContent-Type: application/json\r\nX-Request-Id: "...)
	dst = append(dst, requestID...)
	if hasRank {
		dst = append(dst, "\r\n"+RankHeader+": "...)
		dst = strconv.AppendInt(dst, int64(rank), 10)
	}
	dst = append(dst, "\r\nContent-Length: "...)
	dst = strconv.AppendInt(dst, length, 10)
	dst = append(dst, "\r\n"...)
	h := headCarrier{dst: dst}
	propagation.TraceContext{}.Inject(ctx, &h)
	return append(h.dst, "\r\n"...)
}

// headCarrier appends the headers a propagator sets to a request head.
type headCarrier struct{ dst []byte }

func (h *headCarrier) Get(string) string { return "" }
func (h *headCarrier) Keys() []string    { return nil }
func (h *headCarrier) Set(key, value string) {
	h.dst = append(append(append(append(h.dst, key...), ": "...), value...), "\r\n"...)
}
