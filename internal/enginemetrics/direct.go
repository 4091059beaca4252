package enginemetrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/pdx-router/pdx/internal/http1"
)

// direct is one engine's kept-alive HTTP/1.1 connection, used without
// net/http's Transport. A scrape is then one write and a read or two on the
// worker's own goroutine (on Linux, raw system calls: see send); the
// Transport adds two goroutines per connection and hands every request and
// answer between them, which at 64 engines every 50 ms was a third of the
// scraper's CPU. The answer is read whole into one buffer kept from scrape
// to scrape (package http1): http.ReadResponse cost a dozen allocations and
// as much CPU as the exposition's parse.
type direct struct {
	address string
	conn    net.Conn
	sys     sendSys     // what send needs of conn, per OS
	unwatch func() bool // stops the context.AfterFunc that aborts I/O
	// req is the request for target: a worker sends the same one every
	// scrape, so it is built once.
	target string
	req    []byte
	// buf holds one answer, head and body; the body is decoded in place.
	buf []byte
}

// answer is what get read. body is in direct's buffer: valid until the
// next get.
type answer struct {
	code   int
	status string // "404 Not Found"; only when code is not 200
	body   []byte
}

// readSize is the buffer's least size: a filtered answer fits in one read.
const readSize = 8 << 10

var errTooLarge = errors.New("enginemetrics: exposition too large")

// deadlinePast makes any I/O on a connection fail at once.
var deadlinePast = time.Unix(1, 0)

// get sends one GET for target (path and query) and reads its answer. ctx
// is the worker's: when it ends, so does a scrape in flight.
func (d *direct) get(ctx context.Context, target string, timeout time.Duration) (answer, error) {
	if cap(d.buf) > keepBytes {
		// A rare huge exposition, parsed by now, does not stay allocated
		// for every engine.
		d.buf = nil
	}
	deadline := time.Now().Add(timeout)
	reused := d.conn != nil
	a, got, err := d.try(ctx, target, deadline)
	if err != nil && reused && got == 0 && ctx.Err() == nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		// The engine (or a proxy before it) may have closed the idle
		// connection as the request went out: once more on a new one, as
		// net/http does when nothing of an answer came.
		a, _, err = d.try(ctx, target, deadline)
	}
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) && ctx.Err() == nil {
			// Name it as net/http would for a timed-out request.
			err = fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
		}
		// The path without the query: the filter's query is half a kilobyte
		// of escaped family names, and the log says which engine.
		path, _, _ := strings.Cut(target, "?")
		return answer{}, fmt.Errorf("GET %s: %w", path, err)
	}
	return a, nil
}

// try is one attempt of get; got is how many bytes of an answer came.
func (d *direct) try(ctx context.Context, target string, deadline time.Time) (a answer, got int, err error) {
	if d.conn == nil {
		if err := d.dial(ctx, deadline); err != nil {
			return answer{}, 0, err
		}
	}
	if err := d.conn.SetDeadline(deadline); err != nil {
		d.close()
		return answer{}, 0, err
	}
	// Had ctx ended before SetDeadline, it would have undone the abort.
	if err := ctx.Err(); err != nil {
		return answer{}, 0, err
	}
	if target != d.target || d.req == nil {
		d.target = target
		d.req = []byte("GET " + target + " HTTP/1.1\r\nHost: " + d.address +
			"\r\nUser-Agent: pdx-enginemetrics\r\nAccept: " + accept + "\r\n\r\n")
	}
	if cap(d.buf) < readSize {
		d.buf = make([]byte, readSize)
	}
	n, err := d.send()
	if err != nil {
		d.close()
		return answer{}, 0, err
	}
	a, got, keep, err := d.read(n)
	if err != nil || !keep {
		d.close()
	}
	return a, got, err
}

// read reads the answer of which send read the first n bytes into buf.
func (d *direct) read(n int) (a answer, got int, keep bool, err error) {
	var h http1.Answer
	h, d.buf, got, err = http1.Read(d.conn, d.buf, n, maxBodyBytes)
	if err != nil {
		if errors.Is(err, http1.ErrTooLarge) {
			err = fmt.Errorf("%w: %w", errTooLarge, err)
		}
		return answer{}, got, false, err
	}
	a = answer{code: h.Code, body: h.Body}
	if h.Code != http.StatusOK {
		a.status = string(h.Status)
	}
	return a, got, h.Keep, nil
}

func (d *direct) dial(ctx context.Context, deadline time.Time) error {
	dialCtx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	conn, err := (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext(dialCtx, "tcp", d.address)
	if err != nil {
		return err
	}
	if err := d.sys.init(d, conn); err != nil {
		_ = conn.Close()
		return err
	}
	d.conn = conn
	d.unwatch = context.AfterFunc(ctx, func() { _ = conn.SetDeadline(deadlinePast) })
	return nil
}

func (d *direct) close() {
	if d.conn == nil {
		return
	}
	d.unwatch()
	_ = d.conn.Close()
	d.conn = nil
}
