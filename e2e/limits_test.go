package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// h2cClient speaks HTTP/2 without TLS (prior knowledge), as gRPC-style and
// many load-balancer clients do.
func h2cClient(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}
}

// Every body over max_body_bytes gets 413 in OpenAI JSON: over HTTP/1.1
// with a content-length, chunked, and over HTTP/2; in BUFFERED and
// FULL_DUPLEX_STREAMED mode; with a sequential and a concurrent connector
// (whose table asks Envoy for the decode's response headers, so that Envoy's
// own 413 reaches pdx while pdx waits for the body). pdx answers bodies
// between max_body_bytes and Envoy's buffer limit, Envoy the larger ones.
func TestOversizedBodies(t *testing.T) {
	const maxBody = 64 << 10 // Envoy buffers max_body_bytes + 1 MiB
	sizes := []struct {
		name  string
		bytes int
		by    string // who answers: pdx's message or Envoy's details
	}{
		{"just over max_body_bytes", maxBody + 1, "over the limit of 65536"},
		{"over Envoy's buffer limit", 3 << 20, "request_payload_too_large"},
	}
	for _, mode := range []string{envoy.BodyBuffered, envoy.BodyFullDuplexStreamed} {
		for _, connector := range []string{"nixl", "sglang"} {
			t.Run(mode+"/"+connector, func(t *testing.T) {
				st := startStack(t, stack.Options{Connector: connector, Prefill: 1, Decode: 1, MaxBodyBytes: maxBody, RequestBodyMode: mode})
				_, h1 := newClient(t, st)
				clients := map[string]*http.Client{"http1": h1, "h2c": h2cClient(t)}
				for _, size := range sizes {
					if mode == envoy.BodyFullDuplexStreamed && size.bytes > maxBody+1 {
						size.by = "over the limit of 65536" // Envoy buffers nothing: pdx counts
					}
					body := `{"model":"demo-model","prompt":"` + strings.Repeat("x", size.bytes) + `"}`
					for _, proto := range []string{"http1", "http1-chunked", "h2c"} {
						t.Run(size.name+"/"+proto, func(t *testing.T) {
							var r io.Reader = strings.NewReader(body)
							hc := clients[proto]
							if proto == "http1-chunked" {
								r, hc = io.MultiReader(r), h1 // unknown length: sent chunked
							}
							req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, st.URL()+"/v1/completions", r)
							require.NoError(t, err)
							req.Header.Set("Content-Type", "application/json")
							requireAPIError(t, do(t, hc, req), 413, "body_too_large", size.by)
						})
					}
				}
				for _, e := range st.Engines() {
					for _, r := range e.Records() {
						require.NotContains(t, string(r.Body), "xxxx", "no oversized body reached an engine")
					}
				}
			})
		}
	}
}

// Over HTTP/2 a body over the limit gets the 413 JSON of HTTP/1.1 as a
// complete response, then RST_STREAM NO_ERROR: the answer comes while the
// body is still arriving, and Envoy stops reading it (RFC 9113 section 8.1:
// the client keeps the response). Go's client reads the 413 and keeps the
// connection; docs/errors.md lists the clients that drop it on the reset.
func TestOversizedBodyOverHTTP2(t *testing.T) {
	const maxBody = 64 << 10
	body := `{"model":"demo-model","prompt":"` + strings.Repeat("x", 3<<20) + `"}`
	for _, tc := range []struct {
		mode string
		by   string // who answers: Envoy's details or pdx's message
	}{
		{envoy.BodyBuffered, "request_payload_too_large"},         // Envoy's buffer limit
		{envoy.BodyFullDuplexStreamed, "over the limit of 65536"}, // pdx counts the chunks
	} {
		t.Run(tc.mode, func(t *testing.T) {
			st := startStack(t, stack.Options{Prefill: 1, Decode: 1, MaxBodyBytes: maxBody, RequestBodyMode: tc.mode})

			tr := h2Frames(t, st.Envoy.ListenAddr(), "/v1/completions", body)
			requireAPIError(t, tr.answer, 413, "body_too_large", tc.by)
			require.Less(t, tr.sent, len(body), "answered before the body had all arrived")
			require.Equal(t, []string{"HEADERS", "DATA END_STREAM", "RST_STREAM NO_ERROR"}, tr.frames,
				"a complete 413, then the stream reset without error")
			require.False(t, tr.goAway, "the connection stays open")

			hc, dials := h2Client(t)
			requireAPIError(t, post(t, hc, st.URL()+"/v1/completions", body), 413, "body_too_large", tc.by)
			a := post(t, hc, st.URL()+"/v1/completions", `{"model":"demo-model","prompt":"after a 413","max_tokens":2}`)
			require.Equal(t, 200, a.status, a.body)
			require.EqualValues(t, 1, dials.Load(), "the request after the 413 took the same connection")
			for _, e := range st.Engines() {
				for _, r := range e.Records() {
					require.NotContains(t, string(r.Body), "xxxx", "no oversized body reached an engine")
				}
			}
		})
	}
}

// h2Client is golang.org/x/net/http2's Transport speaking HTTP/2 without
// TLS (prior knowledge); dials counts the connections it opens.
func h2Client(t *testing.T) (*http.Client, *atomic.Int64) {
	t.Helper()
	dials := &atomic.Int64{}
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			dials.Add(1)
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		},
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: time.Minute}, dials
}

// h2Trace is what a client saw of one HTTP/2 request, frame by frame.
type h2Trace struct {
	answer
	frames []string // the request stream's frames from Envoy, in order
	sent   int      // body bytes sent before the stream was closed
	goAway bool
}

// h2Frames POSTs body over one cleartext HTTP/2 connection to addr, sending
// as much as Envoy's flow-control windows allow, and records Envoy's frames
// on the stream until it is closed.
func h2Frames(t *testing.T, addr, path, body string) h2Trace {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(30*time.Second)))
	fr := http2.NewFramer(conn, conn)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	_, err = io.WriteString(conn, http2.ClientPreface)
	require.NoError(t, err)
	require.NoError(t, fr.WriteSettings())
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", addr}, {":path", path},
		{"content-type", "application/json"}, {"content-length", strconv.Itoa(len(body))}} {
		require.NoError(t, enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]}))
	}
	const stream = 1
	require.NoError(t, fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: hb.Bytes(), EndHeaders: true}))

	// The read loop hands the frames over as they come (the framer reuses
	// their buffers, so what matters is copied); the writer is this loop.
	type frame struct {
		settings       bool
		initialWindow  int64 // SETTINGS_INITIAL_WINDOW_SIZE, -1 if absent
		windowStream   uint32
		windowIncrease int64
		desc           string // a frame of the request stream, or GOAWAY
		status         string
		header         http.Header
		data           []byte
		closed         bool // the stream or connection is done
	}
	frames, done := make(chan frame, 64), make(chan struct{})
	defer close(done)
	go func() {
		defer close(frames)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			var out frame
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if f.IsAck() {
					continue
				}
				out.settings, out.initialWindow = true, -1
				if v, ok := f.Value(http2.SettingInitialWindowSize); ok {
					out.initialWindow = int64(v)
				}
			case *http2.WindowUpdateFrame:
				out.windowStream, out.windowIncrease = f.StreamID, int64(f.Increment)
			case *http2.MetaHeadersFrame:
				out.desc, out.status, out.header = "HEADERS", f.PseudoValue("status"), http.Header{}
				for _, h := range f.RegularFields() {
					out.header.Add(h.Name, h.Value)
				}
			case *http2.DataFrame:
				out.desc, out.data = "DATA", bytes.Clone(f.Data())
				if f.StreamEnded() {
					out.desc = "DATA END_STREAM"
				}
			case *http2.RSTStreamFrame:
				out.desc, out.closed = "RST_STREAM "+f.ErrCode.String(), true
			case *http2.GoAwayFrame:
				out.desc, out.closed = "GOAWAY "+f.ErrCode.String(), true
			default:
				continue
			}
			select {
			case frames <- out:
			case <-done:
				return
			}
			if out.closed {
				return
			}
		}
	}()

	var tr h2Trace
	// RFC 9113's initial windows, until Envoy's SETTINGS say otherwise.
	connWindow, streamWindow := int64(65535), int64(65535)
	for {
		if n := min(connWindow, streamWindow, 16384, int64(len(body)-tr.sent)); n > 0 {
			end := tr.sent + int(n)
			require.NoError(t, fr.WriteData(stream, end == len(body), []byte(body[tr.sent:end])))
			tr.sent, connWindow, streamWindow = end, connWindow-n, streamWindow-n
			continue
		}
		f, ok := <-frames
		if !ok {
			break // Envoy closed the connection
		}
		switch {
		case f.settings:
			if f.initialWindow >= 0 {
				streamWindow += f.initialWindow - 65535
			}
			require.NoError(t, fr.WriteSettingsAck())
		case f.windowStream == 0 && f.windowIncrease > 0:
			connWindow += f.windowIncrease
		case f.windowStream == stream:
			streamWindow += f.windowIncrease
		}
		if f.desc == "" {
			continue
		}
		tr.frames = append(tr.frames, f.desc)
		tr.goAway = tr.goAway || strings.HasPrefix(f.desc, "GOAWAY")
		if f.header != nil {
			tr.header = f.header
			tr.status, err = strconv.Atoi(f.status)
			require.NoError(t, err)
		}
		tr.body += string(f.data)
		if f.closed || (f.desc == "DATA END_STREAM" && tr.sent == len(body)) {
			break // reset, or both sides have ended the stream
		}
	}
	return tr
}

// A client whose headers leave no room for pdx's gets 431 in OpenAI JSON,
// never an empty 503: from pdx when the headers fit Envoy's limit but not
// with pdx's own, from Envoy when they do not fit at all.
func TestHeaderRoom(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1})
	_, hc := newClient(t, st)
	statuses := map[int]int{}
	for n := 80; n <= 100; n++ {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, st.URL()+"/v1/chat/completions",
			strings.NewReader(fmt.Sprintf(`{"model":"demo-model","messages":[{"role":"user","content":"headers %d"}],"max_tokens":2}`, n)))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		for i := range n {
			req.Header.Set(fmt.Sprintf("X-Extra-%d", i), "v")
		}
		a := do(t, hc, req)
		statuses[a.status]++
		if a.status == 200 {
			continue
		}
		requireAPIError(t, a, 431, "headers_too_large", "")
	}
	require.Positive(t, statuses[200], "requests with room for pdx's headers are served: %v", statuses)
	require.Positive(t, statuses[431], "and the others refused: %v", statuses)
	t.Logf("answers by status for 80 to 100 extra headers: %v", statuses)
}

// rawHTTP sends raw bytes to Envoy's listener and returns the status line,
// the headers and the body of its answer.
func rawHTTP(t *testing.T, st *stack.Stack, raw string) answer {
	t.Helper()
	conn, err := net.DialTimeout("tcp", st.Envoy.ListenAddr(), 5*time.Second)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(30*time.Second)))
	_, err = io.WriteString(conn, raw)
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// A body that trickles in slower than request_body_timeout gets 408 in
// OpenAI JSON, in both body modes: Envoy keeps a stream open for as long as
// bytes keep coming.
func TestSlowUpload(t *testing.T) {
	for _, mode := range []string{envoy.BodyBuffered, envoy.BodyFullDuplexStreamed} {
		t.Run(mode, func(t *testing.T) {
			st := startStack(t, stack.Options{Prefill: 1, Decode: 1, RequestBodyMode: mode, ConfigYAML: "request_body_timeout: 1s"})
			_, hc := newClient(t, st)
			pr, pw := io.Pipe()
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			go func() {
				_, _ = io.WriteString(pw, `{"model":"demo-model","prompt":"`)
				for ctx.Err() == nil {
					_, _ = io.WriteString(pw, "slow ")
					time.Sleep(100 * time.Millisecond)
				}
				_ = pw.Close()
			}()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.URL()+"/v1/completions", pr)
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/json")
			start := time.Now()
			a := do(t, hc, req)
			took := time.Since(start)
			requireAPIError(t, a, 408, "request_timeout", "did not arrive within 1s")
			require.Less(t, took, 10*time.Second, "answered at the timeout, not when the client stopped")
			requireNoEngineTraffic(t, st)
		})
	}
}
