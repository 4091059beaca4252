package e2e

import (
	"bufio"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// A generation under way goes on when pdx stops: a drain ends the streams
// pdx holds to count decodes cleanly; by default pdx ends a routed
// request's stream once the decode engine's metrics count it, and with
// end_streams_at_routing: true at routing, so even its death cuts nothing.
func TestGenerationOutlivesPdx(t *testing.T) {
	for _, tc := range []struct {
		name, config string
		stop         func(*procStack)
	}{
		{name: "drained", stop: func(ps *procStack) { _ = ps.pdx.cmd.Process.Signal(syscall.SIGTERM) }},
		{name: "killed", stop: func(ps *procStack) { ps.pdx.kill() }},
		{name: "killed, streams ended at routing", config: "end_streams_at_routing: true", stop: func(ps *procStack) { ps.pdx.kill() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := startProcStack(t, procOptions{prefill: 1, decode: 1, config: tc.config,
				engine: enginesim.Config{DecodeLatency: 20 * time.Millisecond, DecodePerToken: 50 * time.Millisecond}})
			resp, err := newHTTPClient(t).Post(ps.envoy.URL()+"/v1/completions", "application/json",
				strings.NewReader(`{"model":"demo-model","prompt":"hello","max_tokens":20,"stream":true}`))
			require.NoError(t, err)
			defer resp.Body.Close()
			require.Equal(t, 200, resp.StatusCode)
			sc := bufio.NewScanner(resp.Body)
			chunks, done := 0, false
			for sc.Scan() {
				switch line := sc.Text(); {
				case line == "data: [DONE]":
					done = true
				case strings.HasPrefix(line, "data:"):
					if chunks++; chunks == 3 {
						tc.stop(ps)
					}
				}
			}
			require.NoError(t, sc.Err(), "the response is not cut")
			require.True(t, done, "the generation ran to its end after %d chunks", chunks)
			<-ps.pdx.exited
		})
	}
}
