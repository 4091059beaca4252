package enginemetrics

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"
)

// direct is one engine's kept-alive HTTP/1.1 connection, used without
// net/http's Transport. A scrape is then one write and a read or two on the
// worker's own goroutine; the Transport adds two goroutines per connection
// and hands every request and answer between them, which at 64 engines
// every 50 ms was a third of the scraper's CPU. The answer is still read by
// net/http (http.ReadResponse): lengths, chunking and keep-alive as usual.
type direct struct {
	address string
	conn    net.Conn
	br      *bufio.Reader
	unwatch func() bool // stops the context.AfterFunc that aborts I/O
	// req is the request for target: a worker sends the same one every
	// scrape, so it is built once.
	target string
	req    []byte
}

// deadlinePast makes any I/O on a connection fail at once.
var deadlinePast = time.Unix(1, 0)

// do sends one GET for target (path and query) and returns the answer; the
// caller reads and closes the body, then calls done. ctx is the worker's:
// when it ends, so does a scrape in flight.
func (d *direct) do(ctx context.Context, target string, timeout time.Duration) (*http.Response, error) {
	deadline := time.Now().Add(timeout)
	reused := d.conn != nil
	resp, err := d.try(ctx, target, deadline)
	if err != nil && reused && ctx.Err() == nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		// The engine (or a proxy before it) may have closed the idle
		// connection as the request went out: once more on a new one, as
		// net/http does.
		resp, err = d.try(ctx, target, deadline)
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() == nil {
			// Name it as net/http would for a timed-out request.
			err = fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
		}
		return nil, fmt.Errorf("GET http://%s%s: %w", d.address, target, err)
	}
	return resp, nil
}

func (d *direct) try(ctx context.Context, target string, deadline time.Time) (*http.Response, error) {
	if d.conn == nil {
		if err := d.dial(ctx, deadline); err != nil {
			return nil, err
		}
	}
	if err := d.conn.SetDeadline(deadline); err != nil {
		d.close()
		return nil, err
	}
	// Had ctx ended before SetDeadline, it would have undone the abort.
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if target != d.target || d.req == nil {
		d.target = target
		d.req = []byte("GET " + target + " HTTP/1.1\r\nHost: " + d.address +
			"\r\nUser-Agent: pdx-enginemetrics\r\nAccept: " + accept + "\r\n\r\n")
	}
	if _, err := d.conn.Write(d.req); err != nil {
		d.close()
		return nil, err
	}
	resp, err := http.ReadResponse(d.br, nil)
	if err != nil {
		d.close()
		return nil, err
	}
	return resp, nil
}

func (d *direct) dial(ctx context.Context, deadline time.Time) error {
	dialCtx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	conn, err := (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext(dialCtx, "tcp", d.address)
	if err != nil {
		return err
	}
	d.conn = conn
	if d.br == nil {
		d.br = bufio.NewReaderSize(conn, 8<<10)
	} else {
		d.br.Reset(conn)
	}
	d.unwatch = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(deadlinePast) })
	return nil
}

// done keeps the connection for the next scrape when the answer was read to
// its end and the engine did not ask to close; otherwise it closes it.
func (d *direct) done(resp *http.Response, readAll bool) {
	if !readAll || resp.Close || d.conn == nil {
		d.close()
	}
}

func (d *direct) close() {
	if d.conn == nil {
		return
	}
	d.unwatch()
	_ = d.conn.Close()
	d.conn = nil
}
