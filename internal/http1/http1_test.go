package http1

import (
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// pieces is a connection that delivers each piece in a Read of its own (a
// piece larger than the buffer takes several), then io.EOF.
type pieces struct {
	parts []string
	reads int
}

func (p *pieces) Read(b []byte) (int, error) {
	for len(p.parts) > 0 && p.parts[0] == "" {
		p.parts = p.parts[1:]
	}
	if len(p.parts) == 0 {
		return 0, io.EOF
	}
	p.reads++
	n := copy(b, p.parts[0])
	p.parts[0] = p.parts[0][n:]
	return n, nil
}

// bytewise splits s into pieces of one byte.
func bytewise(s string) []string { return strings.Split(s, "") }

// chunked is body in chunks of size bytes, the last shorter.
func chunked(body string, size int) string {
	var b strings.Builder
	for len(body) > 0 {
		n := min(size, len(body))
		b.WriteString(strconv.FormatInt(int64(n), 16) + "\r\n" + body[:n] + "\r\n")
		body = body[n:]
	}
	return b.String() + "0\r\n\r\n"
}

func TestRead(t *testing.T) {
	t.Parallel()
	big := strings.Repeat("vllm:num_requests_running 1\n", 5000) // 140 KB: many reads, a grown buffer
	bigChunked := chunked(big, 3000)
	tests := []struct {
		name   string
		parts  []string
		code   int    // want
		status string // want
		body   string // want
		keep   bool   // want
	}{
		{
			name:  "content-length",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"},
			code:  200, status: "200 OK", body: "ok", keep: true,
		},
		{
			name:  "content-length, head and body apart",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", "ok"},
			code:  200, status: "200 OK", body: "ok", keep: true,
		},
		{
			name:  "split at every byte",
			parts: bytewise("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
			code:  200, status: "200 OK", body: "hello", keep: true,
		},
		{
			name:  "large content-length",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: " + strconv.Itoa(len(big)) + "\r\n\r\n", big},
			code:  200, status: "200 OK", body: big, keep: true,
		},
		{
			name:  "chunked, extensions and trailers",
			parts: []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=1\r\nok\r\n3 \r\n!!!\r\n0\r\nX-Trailer: 1\r\n\r\n"},
			code:  200, status: "200 OK", body: "ok!!!", keep: true,
		},
		{
			name:  "chunked, split everywhere",
			parts: bytewise("HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n" + chunked("vllm:num_requests_running 1\n", 5)),
			code:  200, status: "200 OK", body: "vllm:num_requests_running 1\n", keep: true,
		},
		{
			name:  "chunked, large",
			parts: []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", bigChunked},
			code:  200, status: "200 OK", body: big, keep: true,
		},
		{
			name:  "connection close",
			parts: []string{"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"},
			code:  200, status: "200 OK", body: "ok", keep: false,
		},
		{
			name:  "HTTP/1.0 body to the end",
			parts: []string{"HTTP/1.0 200 OK\r\n\r\n", "all ", "of it"},
			code:  200, status: "200 OK", body: "all of it", keep: false,
		},
		{
			name:  "HTTP/1.0 keep-alive",
			parts: []string{"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok"},
			code:  200, status: "200 OK", body: "ok", keep: true,
		},
		{
			name:  "bare newlines",
			parts: []string{"HTTP/1.1 200 OK\nContent-Length: 2\n\nok"},
			code:  200, status: "200 OK", body: "ok", keep: true,
		},
		{
			name:  "error status",
			parts: []string{"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found"},
			code:  404, status: "404 Not Found", body: "not found", keep: true,
		},
		{
			name:  "no content",
			parts: []string{"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n"},
			code:  204, status: "204 No Content", body: "", keep: true,
		},
		{
			name:  "interim answers first",
			parts: []string{"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"},
			code:  200, status: "200 OK", body: "ok", keep: true,
		},
		{
			name:  "switching protocols",
			parts: []string{"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n"},
			code:  101, status: "101 Switching Protocols", body: "", keep: false,
		},
		{
			name:  "length and chunked: chunked, then closed",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"},
			code:  200, status: "200 OK", body: "ok", keep: false,
		},
		{
			name:  "more than the answer: not reused",
			parts: []string{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1"},
			code:  200, status: "200 OK", body: "ok", keep: false,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			all := strings.Join(tt.parts, "")
			a, buf, got, err := Read(&pieces{parts: tt.parts}, nil, 0, 1<<20)
			require.NoError(t, err)
			require.Equal(t, tt.code, a.Code)
			require.Equal(t, tt.status, string(a.Status))
			require.Equal(t, tt.body, string(a.Body))
			require.Equal(t, tt.keep, a.Keep)
			require.GreaterOrEqual(t, cap(buf), len(a.Body))
			if tt.keep {
				require.Equal(t, len(all), got, "a kept connection has been read to the answer's end")
			}
		})
	}
}

func TestReadKeepsWhatWasReadBefore(t *testing.T) {
	t.Parallel()
	// The caller read the first bytes itself (the scraper's raw read).
	buf := make([]byte, 16)
	n := copy(buf, "HTTP/1.1 200 OK\r")
	a, _, got, err := Read(&pieces{parts: []string{"\nContent-Length: 2\r\n\r\nok"}}, buf, n, 1<<20)
	require.NoError(t, err)
	require.Equal(t, "ok", string(a.Body))
	require.True(t, a.Keep)
	require.Equal(t, len("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"), got)
}

func TestReadReusesTheBuffer(t *testing.T) {
	answer := "HTTP/1.1 200 OK\r\nContent-Length: 28\r\n\r\nvllm:num_requests_running 1\n"
	buf := make([]byte, 4<<10)
	conn := &pieces{}
	allocs := testing.AllocsPerRun(50, func() {
		conn.parts = append(conn.parts[:0], answer)
		var err error
		// Read uses the buffer's capacity, whatever its length.
		if _, buf, _, err = Read(conn, buf[:0], 0, 1<<20); err != nil {
			panic(err)
		}
	})
	require.Zero(t, allocs)
}

func TestReadBadAnswersFail(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		parts []string
		want  error  // errors.Is
		text  string // in the message
		got   int    // want, when not 0
	}{
		{"not HTTP/1", []string{"HTTP/2 200 OK\r\n\r\n"}, ErrHead, "status line", 0},
		{"not HTTP", []string{"SSH-2.0-OpenSSH_9.6\r\n"}, ErrHead, "status line", 0},
		{"bad code", []string{"HTTP/1.1 2x0 OK\r\n\r\n"}, ErrHead, "status line", 0},
		{"header line without colon", []string{"HTTP/1.1 200 OK\r\nContent-Length 2\r\n\r\nok"}, ErrHead, "header line", 0},
		{"bad content-length", []string{"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\nok"}, ErrHead, "Content-Length", 0},
		{"conflicting content-lengths", []string{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"}, ErrHead, "conflicting", 0},
		{"unsupported transfer-encoding", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"}, ErrHead, "gzip", 0},
		{"bad chunk size", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"}, ErrChunked, "bad size", 0},
		{"no CRLF after chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n"}, ErrChunked, "CRLF", 0},
		{"chunk line too long", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;" + strings.Repeat("x", maxChunkLine+1)}, ErrChunked, "line too long", 0},
		{"too large", []string{"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n"}, ErrTooLarge, "exceeds", 0},
		{"too large chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffff\r\n"}, ErrTooLarge, "exceed", 0},
		{"too large chunks", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + strings.Repeat("8\r\n12345678\r\n", 200)}, ErrTooLarge, "exceed", 0},
		{"too large to the end", []string{"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", strings.Repeat("x", 2000)}, ErrTooLarge, "exceeds", 0},
		{"head too large", []string{"HTTP/1.1 200 OK\r\n", "X: " + strings.Repeat("a", MaxHead) + "\r\n\r\n"}, ErrHead, "head exceeds", 0},
		{"nothing", nil, io.EOF, "", 0},
		{"cut in the head", []string{"HTTP/1.1 200 OK\r\nContent-Le"}, io.ErrUnexpectedEOF, "", 27},
		{"cut in the body", []string{"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nvllm:num_req"}, io.ErrUnexpectedEOF, "", 0},
		{"cut in a chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nvllm:"}, io.ErrUnexpectedEOF, "", 0},
		{"cut before the last chunk", []string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n"}, io.ErrUnexpectedEOF, "", 0},
		{"too many interim answers", []string{strings.Repeat("HTTP/1.1 103 Early Hints\r\n\r\n", maxInterim+1) + "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"}, ErrHead, "interim answers", 0},
		{"cut after an interim answer", []string{"HTTP/1.1 100 Continue\r\n\r\n"}, io.ErrUnexpectedEOF, "", 25},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, _, got, err := Read(&pieces{parts: tt.parts}, nil, 0, 1000)
			require.ErrorIs(t, err, tt.want)
			require.ErrorContains(t, err, tt.text)
			if tt.got != 0 {
				require.Equal(t, tt.got, got)
			}
			if tt.parts == nil {
				require.Zero(t, got, "nothing of an answer came")
			}
		})
	}
}

func TestReadTooLargeHasTheCode(t *testing.T) {
	t.Parallel()
	a, _, _, err := Read(&pieces{parts: []string{"HTTP/1.1 503 Busy\r\nContent-Length: 5000\r\n\r\n"}}, nil, 0, 1000)
	require.True(t, errors.Is(err, ErrTooLarge))
	require.Equal(t, 503, a.Code)
}
