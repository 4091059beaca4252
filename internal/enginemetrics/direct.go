package enginemetrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"time"
)

// direct is one engine's kept-alive HTTP/1.1 connection, used without
// net/http's Transport. A scrape is then one write and a read or two on the
// worker's own goroutine (on Linux, raw system calls: see send); the Transport adds two goroutines per connection
// and hands every request and answer between them, which at 64 engines
// every 50 ms was a third of the scraper's CPU. The answer is read whole
// into one buffer kept from scrape to scrape, and its head parsed for what
// a GET's answer needs (status, Content-Length, chunking, Connection):
// http.ReadResponse cost a dozen allocations and as much CPU as the
// exposition's parse.
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

const (
	// readSize is the buffer's least size: a filtered answer fits in one
	// read.
	readSize = 8 << 10
	// maxHeadBytes bounds an answer's head (status line and header).
	maxHeadBytes = 64 << 10
	// maxChunkLine bounds a chunk-size line (with extensions).
	maxChunkLine = 4 << 10
)

var (
	errTooLarge = fmt.Errorf("enginemetrics: exposition exceeds %d bytes", maxBodyBytes)
	errHead     = errors.New("enginemetrics: malformed HTTP answer")
	errChunked  = errors.New("enginemetrics: malformed chunked encoding")
)

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
		return answer{}, fmt.Errorf("GET http://%s%s: %w", d.address, target, err)
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

// read reads one answer into buf, of which send read the first n bytes.
// keep is whether the connection may carry the next scrape: the engine did
// not ask to close, and sent nothing after the answer.
func (d *direct) read(n int) (a answer, got int, keep bool, err error) {
	r := reader{conn: d.conn, buf: d.buf[:cap(d.buf)], n: n}
	defer func() { d.buf = r.buf }()

	var h head
	var headLen int
	for {
		if h, headLen, err = parseHead(r.buf[:r.n]); err != nil || headLen > 0 {
			break
		}
		if r.n >= maxHeadBytes {
			err = fmt.Errorf("%w: head exceeds %d bytes", errHead, maxHeadBytes)
			break
		}
		if err = r.more(r.n + 1); err != nil {
			if errors.Is(err, io.EOF) && r.n > 0 {
				err = io.ErrUnexpectedEOF
			}
			break
		}
	}
	if err != nil {
		return answer{}, r.n, false, err
	}
	a.code = h.code
	if h.code != 200 {
		a.status = string(h.status)
	}
	var end int // of the answer in buf, raw
	switch {
	case h.code/100 == 1 || h.code == 204 || h.code == 304:
		end = headLen // no body, whatever the head says
	case h.chunked:
		var out int
		if out, end, err = r.dechunk(headLen); err == nil {
			a.body = r.buf[headLen:out]
		}
	case h.length >= 0:
		if h.length > maxBodyBytes {
			err = errTooLarge
			break
		}
		end = headLen + int(h.length)
		if err = r.more(end); errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		a.body = r.buf[headLen:end]
	default: // the body ends with the connection
		h.close = true
		for err == nil {
			if r.n-headLen > maxBodyBytes {
				err = errTooLarge
				break
			}
			err = r.more(r.n + 1)
		}
		if errors.Is(err, io.EOF) {
			err = nil
		}
		end = r.n
		a.body = r.buf[headLen:end]
	}
	if err != nil {
		return answer{}, r.n, false, err
	}
	return a, r.n, !h.close && r.n == end, nil
}

// reader fills buf from conn: buf[:n] has been read.
type reader struct {
	conn net.Conn
	buf  []byte
	n    int
}

// more reads until buf holds at least want bytes, growing it as needed.
func (r *reader) more(want int) error {
	if want > len(r.buf) {
		grown := make([]byte, max(want, 2*len(r.buf)))
		copy(grown, r.buf[:r.n])
		r.buf = grown
	}
	for r.n < want {
		// Read as much as there is room for: one read takes the whole
		// answer when it has come.
		m, err := r.conn.Read(r.buf[r.n:])
		r.n += m
		if err != nil {
			if r.n >= want {
				return nil
			}
			return err
		}
	}
	return nil
}

// dechunk decodes a chunked body starting at buf[from], in place: the
// data ends at out; the raw body (with trailers) ends at end.
func (r *reader) dechunk(from int) (out, end int, err error) {
	out, p := from, from // decoded data ends at out; the next chunk line starts at p
	// need reads until buf[:p+k] is there; the data decoded so far stays,
	// the raw bytes already decoded are dropped first.
	need := func(k int) error {
		if p+k <= r.n {
			return nil
		}
		if p > out {
			r.n = out + copy(r.buf[out:], r.buf[p:r.n])
			p = out
		}
		err := r.more(p + k)
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return err
	}
	// line returns the length of the line at p, with its '\n'.
	line := func() (int, error) {
		for {
			if i := bytes.IndexByte(r.buf[p:r.n], '\n'); i >= 0 {
				return i + 1, nil
			}
			if r.n-p > maxChunkLine {
				return 0, fmt.Errorf("%w: line too long", errChunked)
			}
			if err := need(r.n - p + 1); err != nil {
				return 0, err
			}
		}
	}
	for {
		n, err := line()
		if err != nil {
			return 0, 0, err
		}
		size, err := chunkSize(r.buf[p : p+n])
		if err != nil {
			return 0, 0, err
		}
		if size > int64(maxBodyBytes-(out-from)) {
			return 0, 0, errTooLarge
		}
		if size == 0 {
			// Trailers, up to an empty line; they are not read.
			for {
				p += n
				if n, err = line(); err != nil {
					return 0, 0, err
				}
				if len(trimCR(r.buf[p:p+n-1])) == 0 {
					return out, p + n, nil
				}
			}
		}
		k := n + int(size) + 2
		if err := need(k); err != nil {
			return 0, 0, err
		}
		data := r.buf[p+n : p+k-2]
		if string(r.buf[p+k-2:p+k]) != "\r\n" {
			return 0, 0, fmt.Errorf("%w: no CRLF after chunk data", errChunked)
		}
		out += copy(r.buf[out:], data)
		p += k
	}
}

// chunkSize reads a chunk-size line (with its newline).
func chunkSize(line []byte) (int64, error) {
	line = trimCR(line[:len(line)-1])
	if i := bytes.IndexByte(line, ';'); i >= 0 {
		line = line[:i] // a chunk extension
	}
	line = bytes.TrimRight(line, " \t")
	if len(line) == 0 || len(line) > 15 {
		return 0, fmt.Errorf("%w: bad size %q", errChunked, line)
	}
	var n int64
	for _, c := range line {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0, fmt.Errorf("%w: bad size %q", errChunked, line)
		}
		n = n<<4 | int64(c)
	}
	return n, nil
}

// head is what get reads of an answer's status line and header.
type head struct {
	code    int
	status  []byte // "200 OK"
	length  int64  // Content-Length; -1 if none
	chunked bool
	close   bool // the connection ends after this answer
}

// parseHead parses the head at the start of b; n is its length, 0 when b
// does not hold all of it yet. Like net/http, it takes a bare '\n' for a
// line end.
func parseHead(b []byte) (h head, n int, err error) {
	i := bytes.IndexByte(b, '\n')
	if i < 0 {
		return head{}, 0, nil
	}
	statusLine := trimCR(b[:i])
	rest := b[i+1:]
	n = i + 1
	proto, status, _ := bytes.Cut(statusLine, []byte(" "))
	minor, ok := http1Minor(proto)
	if !ok {
		return head{}, 0, fmt.Errorf("%w: status line %q", errHead, statusLine)
	}
	code, _, _ := bytes.Cut(status, []byte(" "))
	if len(code) != 3 || !isDigits(code) {
		return head{}, 0, fmt.Errorf("%w: status line %q", errHead, statusLine)
	}
	h = head{code: int(code[0]-'0')*100 + int(code[1]-'0')*10 + int(code[2]-'0'), status: status, length: -1}
	h.close = minor == 0 // HTTP/1.0 closes unless it says keep-alive
	var sawLength, sawEncoding bool
	for {
		i := bytes.IndexByte(rest, '\n')
		if i < 0 {
			return head{}, 0, nil
		}
		line := trimCR(rest[:i])
		rest = rest[i+1:]
		n += i + 1
		if len(line) == 0 {
			break
		}
		if line[0] == ' ' || line[0] == '\t' {
			continue // an obsolete folded line: none of the fields read here
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok || len(name) == 0 {
			return head{}, 0, fmt.Errorf("%w: header line %q", errHead, line)
		}
		value = bytes.Trim(value, " \t")
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if !isDigits(value) || len(value) > 18 {
				return head{}, 0, fmt.Errorf("%w: Content-Length %q", errHead, value)
			}
			l, _ := strconv.ParseInt(string(value), 10, 64)
			if sawLength && l != h.length {
				return head{}, 0, fmt.Errorf("%w: conflicting Content-Length", errHead)
			}
			sawLength, h.length = true, l
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			if minor == 0 {
				continue // HTTP/1.0 has none: net/http ignores it too
			}
			if sawEncoding || !bytes.EqualFold(value, []byte("chunked")) {
				return head{}, 0, fmt.Errorf("%w: unsupported Transfer-Encoding %q", errHead, value)
			}
			sawEncoding, h.chunked = true, true
		case bytes.EqualFold(name, []byte("Connection")):
			for tok := range bytes.SplitSeq(value, []byte(",")) {
				tok = bytes.Trim(tok, " \t")
				switch {
				case bytes.EqualFold(tok, []byte("close")):
					h.close = true
				case bytes.EqualFold(tok, []byte("keep-alive")) && minor == 0:
					h.close = false
				}
			}
		}
	}
	if h.chunked {
		// RFC 9112 §6.1: with both, the length is wrong, and so may be
		// what follows this answer on the connection.
		h.length = -1
		h.close = h.close || sawLength
	}
	return h, n, nil
}

// http1Minor reads "HTTP/1.x".
func http1Minor(proto []byte) (int, bool) {
	if len(proto) != len("HTTP/1.1") || string(proto[:7]) != "HTTP/1." || !isDigits(proto[7:]) {
		return 0, false
	}
	return int(proto[7] - '0'), true
}

func isDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return len(b) > 0
}

func trimCR(b []byte) []byte {
	if len(b) > 0 && b[len(b)-1] == '\r' {
		return b[:len(b)-1]
	}
	return b
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
