// Package http1 reads HTTP/1.1 answers off a kept-alive connection into one
// buffer the caller keeps from answer to answer. It is for pdx's own engine
// clients (the prefill POSTs and the metrics scrapes), which send one
// request at a time on a connection of their own: net/http's ReadResponse
// cost them a dozen allocations an answer (the Header map, textproto's
// reader, the body's reader) and as much CPU as what they do with the
// answer.
//
// It reads what an engine's answer can be (a Content-Length, chunked or
// close-delimited body, interim 1xx answers before the final one) and
// fails everything else with a clear error; headers other than those that
// frame the body are not returned.
package http1

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// Answer is one final answer. Status and Body are in the buffer Read
// returns: valid until it is read into again.
type Answer struct {
	Code   int
	Status []byte // "404 Not Found": the status line after the version
	Body   []byte // chunking decoded
	// Keep is whether the connection may carry the next request: the
	// server did not ask to close it, and sent nothing after the answer.
	Keep bool
}

const (
	// MaxHead bounds an answer's head (status line and header fields).
	MaxHead = 64 << 10
	// maxChunkLine bounds a chunk-size line (with extensions).
	maxChunkLine = 4 << 10
	// minBuffer is the least buffer Read reads into.
	minBuffer = 2 << 10
	// maxInterim bounds the interim answers before the final one
	// (net/http's Transport allows 5).
	maxInterim = 5
)

var (
	ErrHead     = errors.New("http1: malformed answer")
	ErrChunked  = errors.New("http1: malformed chunked encoding")
	ErrTooLarge = errors.New("http1: answer body too large")
)

// Read reads one answer from conn into buf, of which conn's first n bytes
// are already in buf[:n]. It grows buf as needed and returns it (to be
// kept for the next answer), the answer, and got: how many bytes of an
// answer came in all, n included (0 tells a caller that nothing came, so
// a request on a connection the server had closed can be sent again).
// Interim answers (1xx but 101) are skipped. A body over maxBody bytes is
// ErrTooLarge, with the answer's Code set. After an error, the connection
// is not to be used again.
func Read(conn io.Reader, buf []byte, n, maxBody int) (a Answer, out []byte, got int, err error) {
	if cap(buf) < minBuffer {
		grown := make([]byte, minBuffer)
		copy(grown, buf[:n])
		buf = grown
	}
	r := reader{conn: conn, buf: buf[:cap(buf)], n: n, got: n}
	a, err = r.read(maxBody)
	return a, r.buf, r.got, err
}

// reader fills buf from conn: buf[:n] has been read and not yet consumed.
type reader struct {
	conn io.Reader
	buf  []byte
	n    int
	got  int
}

func (r *reader) read(maxBody int) (Answer, error) {
	for interim := 0; ; interim++ {
		h, headLen, err := r.head()
		if err != nil {
			return Answer{}, err
		}
		if h.code/100 != 1 || h.code == 101 {
			return r.body(h, headLen, maxBody)
		}
		// An interim answer (100 Continue, 103 Early Hints): the final
		// one follows. Bounded as net/http bounds them, so that a server
		// sending nothing else cannot keep a reader busy.
		if interim == maxInterim {
			return Answer{}, fmt.Errorf("%w: more than %d interim answers", ErrHead, maxInterim)
		}
		r.n = copy(r.buf, r.buf[headLen:r.n])
	}
}

// head reads until buf holds a whole head, and parses it.
func (r *reader) head() (h head, n int, err error) {
	for {
		if h, n, err = parseHead(r.buf[:r.n]); err != nil || n > 0 {
			return h, n, err
		}
		if r.n >= MaxHead {
			return head{}, 0, fmt.Errorf("%w: head exceeds %d bytes", ErrHead, MaxHead)
		}
		if err = r.more(r.n + 1); err != nil {
			if errors.Is(err, io.EOF) && r.got > 0 {
				err = io.ErrUnexpectedEOF
			}
			return head{}, 0, err
		}
	}
}

// body reads the body of the answer whose head, h, is buf[:headLen].
func (r *reader) body(h head, headLen, maxBody int) (a Answer, err error) {
	a.Code, a.Status = h.code, h.status
	var end int // of the answer in buf, raw
	switch {
	case h.code == 101:
		// The connection now speaks another protocol.
		return a, nil
	case h.code == 204 || h.code == 304:
		end = headLen // no body, whatever the head says
	case h.chunked:
		var out int
		if out, end, err = r.dechunk(headLen, maxBody); err == nil {
			a.Body = r.buf[headLen:out]
		}
	case h.length >= 0:
		if h.length > int64(maxBody) {
			err = fmt.Errorf("%w: Content-Length %d exceeds %d bytes", ErrTooLarge, h.length, maxBody)
			break
		}
		end = headLen + int(h.length)
		if err = r.more(end); errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		a.Body = r.buf[headLen:end]
	default: // the body ends with the connection
		h.close = true
		for err == nil {
			if r.n-headLen > maxBody {
				err = fmt.Errorf("%w: exceeds %d bytes", ErrTooLarge, maxBody)
				break
			}
			err = r.more(r.n + 1)
		}
		if errors.Is(err, io.EOF) {
			err = nil
		}
		end = r.n
		a.Body = r.buf[headLen:end]
	}
	if err != nil {
		return Answer{Code: a.Code}, err
	}
	a.Keep = !h.close && r.n == end
	return a, nil
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
		r.got += m
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
func (r *reader) dechunk(from, maxBody int) (out, end int, err error) {
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
				return 0, fmt.Errorf("%w: line too long", ErrChunked)
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
		if size > int64(maxBody-(out-from)) {
			return 0, 0, fmt.Errorf("%w: chunks exceed %d bytes", ErrTooLarge, maxBody)
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
			return 0, 0, fmt.Errorf("%w: no CRLF after chunk data", ErrChunked)
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
		return 0, fmt.Errorf("%w: bad size %q", ErrChunked, line)
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
			return 0, fmt.Errorf("%w: bad size %q", ErrChunked, line)
		}
		n = n<<4 | int64(c)
	}
	return n, nil
}

// head is what Read takes of an answer's status line and header.
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
		return head{}, 0, fmt.Errorf("%w: status line %q", ErrHead, statusLine)
	}
	code, _, _ := bytes.Cut(status, []byte(" "))
	if len(code) != 3 || !isDigits(code) {
		return head{}, 0, fmt.Errorf("%w: status line %q", ErrHead, statusLine)
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
			return head{}, 0, fmt.Errorf("%w: header line %q", ErrHead, line)
		}
		value = bytes.Trim(value, " \t")
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			if !isDigits(value) || len(value) > 18 {
				return head{}, 0, fmt.Errorf("%w: Content-Length %q", ErrHead, value)
			}
			l, _ := strconv.ParseInt(string(value), 10, 64)
			if sawLength && l != h.length {
				return head{}, 0, fmt.Errorf("%w: conflicting Content-Length", ErrHead)
			}
			sawLength, h.length = true, l
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			if minor == 0 {
				continue // HTTP/1.0 has none: net/http ignores it too
			}
			if sawEncoding || !bytes.EqualFold(value, []byte("chunked")) {
				return head{}, 0, fmt.Errorf("%w: unsupported Transfer-Encoding %q", ErrHead, value)
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
