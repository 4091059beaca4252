package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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
