package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/logbuf"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// These tests follow requests through the events of a deployment's life
// rather than through its happy path: a client that gives up, pdx killed
// outright, pdx asked to stop. Each checks what the client got and, from
// the engines' own records, what every engine was asked to do.

// statusClientGone is what an engine simulator records for a request whose
// client (pdx for a prefill, Envoy for a decode) went away mid-way.
const statusClientGone = 499

// TestClientDisconnectMidPrefill: a client that gives up while its prefill
// runs must not leave the prefill engine working for nobody, and no decode
// engine may be left with (or still be sent) a request nobody waits for.
// For a sequential connector the decode is never sent; for a concurrent one
// Envoy has sent it already, and must reset it.
func TestClientDisconnectMidPrefill(t *testing.T) {
	const (
		prefillLatency = 10 * time.Second
		giveUpAfter    = 300 * time.Millisecond
		// Far below prefillLatency: the engine must hear of it at once, not
		// when its work would have ended.
		abandonBound = 5 * time.Second
	)
	for _, tc := range []struct {
		connector string
		stream    bool
	}{
		{"nixl", false},
		{"sglang", false},
		// SGLang's decode answers 200 at once; pdx holds that answer.
		{"sglang", true},
	} {
		connector := tc.connector
		name := connector
		if tc.stream {
			name += "-stream"
		}
		t.Run(name, func(t *testing.T) {
			st := startStack(t, stack.Options{Connector: connector, Prefill: 1, Decode: 1, LogLevel: slog.LevelDebug,
				Engine: enginesim.Config{PrefillLatency: prefillLatency}})
			_, hc := newClient(t, st)
			// Warm up: the client's connection and Envoy's stream to pdx
			// are open, so the request below spends its 300ms in the prefill.
			requireAPIError(t, post(t, hc, st.URL()+"/v1/completions", `{"model":`), 400, "invalid_json", "")
			text := "a client that walks away, " + name
			fp := enginesim.Fingerprint(text)

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, st.URL()+"/v1/completions",
				strings.NewReader(fmt.Sprintf(`{"model":"demo-model","prompt":%q,"max_tokens":4,"stream":%v}`, text, tc.stream)))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Request-Id", newRequestID(t))
			start := time.Now()
			timer := time.AfterFunc(giveUpAfter, cancel)
			defer timer.Stop()
			resp, err := hc.Do(req)
			if err == nil {
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				t.Fatalf("the client got an answer before it gave up: %d %s", resp.StatusCode, body)
			}
			require.ErrorIs(t, err, context.Canceled, "the client's own cancellation ended the request")
			gaveUp := time.Since(start)

			// The prefill engine saw its client, pdx, go away: abandoned.
			prefillOf := func() []enginesim.Record {
				return kindOf(st.Prefill[0].Records(), enginesim.KindPrefill, fp)
			}
			if !assert.Eventually(t, func() bool { return len(prefillOf()) > 0 }, abandonBound, 5*time.Millisecond,
				"the prefill engine is still working for a client that left") {
				stats, _ := envoyStatsText(st.Envoy.AdminAddr(), `^cluster\.pdx(_decode)?\.upstream_(cx|rq)_`)
				t.Fatalf("no prefill record; prefill engine records %+v; decode engine records %+v; Envoy stats:\n%s",
					st.Prefill[0].Records(), st.Decode[0].Records(), stats)
			}
			abandoned := time.Since(start)
			prefill := prefillOf()
			require.Len(t, prefill, 1)
			requireGivenUp(t, prefill[0], "the prefill was abandoned or aborted, not completed")

			// The decode engine: nothing (sequential), or a decode that Envoy
			// reset when the client left (concurrent), never a finished one.
			sent := envoyCounter(t, st.Envoy.AdminAddr(), "cluster.pdx_decode.upstream_rq_total")
			switch connector {
			case "nixl":
				require.Zero(t, sent, "Envoy sent no decode")
			case "sglang":
				require.LessOrEqual(t, sent, 1)
				decodes := func() []enginesim.Record {
					var out []enginesim.Record
					for _, r := range st.Decode[0].Records() {
						if r.Kind != enginesim.KindAbort {
							out = append(out, r)
						}
					}
					return out
				}
				require.Eventually(t, func() bool { return len(decodes()) == sent }, abandonBound, 5*time.Millisecond,
					"Envoy sent %d decodes; decode records: %+v", sent, st.Decode[0].Records())
				for _, r := range decodes() {
					require.Contains(t, []string{enginesim.KindDecode, enginesim.KindRejected}, r.Kind, "%+v", r)
					require.Equal(t, fp, r.Fingerprint)
					requireGivenUp(t, r, "the decode was abandoned or aborted, not completed")
				}
			}
			// Nothing was sent late: pdx's stream and Envoy's request are over.
			time.Sleep(200 * time.Millisecond)
			if connector == "nixl" {
				require.Empty(t, st.Decode[0].Records(), "the decode engine received nothing")
			}
			for _, e := range st.Engines() {
				for _, r := range e.Records() {
					if r.Kind == enginesim.KindAbort {
						require.Equal(t, "sglang", connector, "only SGLang has an abort to call")
						continue // pdx telling SGLang to let go of the request
					}
					requireGivenUp(t, r, fmt.Sprintf("engine %s finished or refused work for a client that left", e.Addr()))
				}
			}
			t.Logf("%s: client gave up after %v; prefill engine recorded 499 %v after the request was sent (its latency: %v); decodes Envoy sent: %d, all abandoned",
				name, gaveUp.Round(time.Millisecond), abandoned.Round(time.Millisecond), prefillLatency, sent)
		})
	}
}

// requireGivenUp checks that an engine gave up on a request: its client
// went away (499), or pdx aborted it (SGLang's /abort_request: a request
// computing ends as "abort", one waiting for KV fails with SGLang's 500).
func requireGivenUp(t *testing.T, r enginesim.Record, msg string) {
	t.Helper()
	if r.Status == statusClientGone {
		return
	}
	require.True(t, strings.Contains(r.Error, "aborted by /abort_request") || strings.Contains(r.Error, "Aborted by AbortReq"), "%s: %+v", msg, r)
}

// TestPdxKilledUnderLoad: pdx dies (SIGKILL, no drain) under a closed-loop
// load and is started again on the same ports. No request may hang or get
// a wrong answer; requests cut by the kill and those sent while pdx is
// down fail closed with a 503 that says the router is unavailable; once pdx
// is back, Envoy reconnects and requests succeed again.
//
// A routed request whose stream pdx still held (its decode engine's
// metrics not read yet) is cut by the kill too: the test counts decodes
// that finished for a client that got a 503 and checks that they are only
// requests that were in flight at the kill.
func TestPdxKilledUnderLoad(t *testing.T) {
	const (
		clients = 32
		// Each phase of load lasts at least this long and until this many
		// requests succeeded.
		phase, phaseSuccesses = 1500 * time.Millisecond, 2 * clients
		down                  = 1500 * time.Millisecond
		requestBound          = 20 * time.Second // every request is answered within it
		recoveryBound         = 30 * time.Second // generous: Envoy reconnects on the next request
		phaseBound            = 60 * time.Second // for a loaded machine
		failBackoff           = 100 * time.Millisecond
	)
	ps := startProcStack(t, procOptions{
		prefill: 2, decode: 2,
		engine: enginesim.Config{PrefillLatency: 200 * time.Millisecond, DecodeLatency: 20 * time.Millisecond, DecodePerToken: time.Millisecond},
	})
	hc := newHTTPClient(t)
	target := ps.envoy.URL() + "/v1/completions"

	var (
		mu        sync.Mutex
		outcomes  []outcome
		restartAt atomic.Int64 // UnixNano; 0 until pdx is started again
		successes atomic.Int64
		recovered = make(chan struct{})
		once      sync.Once
		stop      = make(chan struct{})
		wg        sync.WaitGroup
	)
	for c := range clients {
		wg.Go(func() {
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				o := send(t.Context(), hc, target, fmt.Sprintf("kill %d-%d", c, n), requestBound)
				mu.Lock()
				outcomes = append(outcomes, o)
				mu.Unlock()
				if o.status == http.StatusOK {
					successes.Add(1)
				}
				if r := restartAt.Load(); r != 0 && o.start.UnixNano() > r && o.status == http.StatusOK {
					once.Do(func() { close(recovered) })
				}
				if o.status != http.StatusOK {
					select { // a client backs off after an error
					case <-stop:
						return
					case <-time.After(failBackoff):
					}
				}
			}
		})
	}
	// However the test ends, the load stops before the stack does.
	stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(stopLoad)

	// loadPhase lets the load run for a phase: at least phase, and until
	// phaseSuccesses more requests succeeded.
	loadPhase := func(what string) {
		t.Helper()
		from, deadline := successes.Load(), time.Now().Add(phaseBound)
		time.Sleep(phase)
		for successes.Load()-from < phaseSuccesses {
			require.True(t, time.Now().Before(deadline), "%s: only %d requests succeeded in %v", what, successes.Load()-from, phaseBound)
			time.Sleep(10 * time.Millisecond)
		}
	}
	loadPhase("before the kill")
	killAt := time.Now()
	ps.pdx.kill()
	time.Sleep(down)
	restart := time.Now()
	restartAt.Store(restart.UnixNano())
	ps.startPdx(t)
	ready := time.Since(restart)
	var firstSuccess time.Duration
	select {
	case <-recovered:
		firstSuccess = time.Since(restart)
	case <-time.After(recoveryBound):
		t.Fatalf("no request succeeded within %v of restarting pdx", recoveryBound)
	}
	loadPhase("after the restart")
	stopLoad()

	mu.Lock()
	defer mu.Unlock()
	var recoveredAt time.Time // the end of the first success after the restart
	for _, o := range outcomes {
		if o.start.After(restart) && o.status == http.StatusOK && (recoveredAt.IsZero() || o.end.Before(recoveredAt)) {
			recoveredAt = o.end
		}
	}
	type tally struct{ ok, failed int }
	var before, cut, whileDown, restarting, after tally
	for _, o := range outcomes {
		// Whatever happened, the client got a clear answer in time.
		require.NoError(t, o.err, "request %q (sent %v after the kill) got no answer", o.prompt, o.start.Sub(killAt))
		if o.status == http.StatusOK {
			require.True(t, strings.HasPrefix(o.text, wantPrefix(o.prompt)), "request %q got a 200 with the answer to another prompt: %q", o.prompt, o.text)
		} else {
			requireRouterUnavailable(t, o)
		}
		var tl *tally
		switch {
		case o.end.Before(killAt):
			tl = &before
		case o.start.Before(killAt):
			tl = &cut
		case o.end.Before(restart):
			tl = &whileDown
		case recoveredAt.IsZero() || !o.start.After(recoveredAt):
			tl = &restarting
		default:
			tl = &after
		}
		if o.status == http.StatusOK {
			tl.ok++
		} else {
			tl.failed++
		}
	}
	t.Logf("%d requests from %d clients: before the kill %d ok/%d failed; in flight at the kill %d ok/%d failed; sent while pdx was down %d ok/%d failed; after the restart until the first success %d ok/%d failed; after it %d ok/%d failed",
		len(outcomes), clients, before.ok, before.failed, cut.ok, cut.failed, whileDown.ok, whileDown.failed, restarting.ok, restarting.failed, after.ok, after.failed)
	t.Logf("pdx started again: ready (admin /readyz) after %v, first success through Envoy after %v",
		ready.Round(time.Millisecond), firstSuccess.Round(time.Millisecond))
	require.Positive(t, before.ok)
	require.Zero(t, before.failed, "with pdx up, every request succeeds")
	require.Positive(t, cut.failed, "the kill cut requests in flight")
	require.Positive(t, whileDown.failed)
	require.Zero(t, whileDown.ok, "with pdx down nothing gets through (fail closed)")
	require.Positive(t, after.ok, "requests succeed again after the restart")
	require.Zero(t, after.failed, "once one request succeeded after the restart, all do")

	// The engines' side: every 200 is a complete hand-off of its own prompt;
	// only a request cut by the kill may have reached a decode engine without
	// reaching its client, or have had its decode cut short by Envoy (whose
	// body the engine then refuses as truncated); nothing bypassed pdx (a
	// plain request) or was refused otherwise.
	engines := ps.engines()
	recs := map[string]map[string][]recordAt{}
	abandonedPrefills, truncated := 0, 0
	for _, e := range engines.Engines() {
		for _, r := range e.Records() {
			require.NotEqual(t, enginesim.KindPlain, r.Kind, "a request reached engine %s without pdx: %+v", e.Addr(), r)
			if r.Kind == enginesim.KindRejected && strings.Contains(r.Error, "reading request body: unexpected EOF") {
				truncated++
				continue
			}
			require.NotEqual(t, enginesim.KindRejected, r.Kind, "engine %s refused %+v", e.Addr(), r)
			if r.Kind == enginesim.KindPrefill {
				require.Contains(t, []int{http.StatusOK, statusClientGone}, r.Status, "%+v", r)
				if r.Status == statusClientGone {
					abandonedPrefills++
				}
			}
			if recs[r.Fingerprint] == nil {
				recs[r.Fingerprint] = map[string][]recordAt{}
			}
			recs[r.Fingerprint][r.Kind] = append(recs[r.Fingerprint][r.Kind], recordAt{Record: r, Engine: e.Addr()})
		}
	}
	wastedDecodes := 0
	for _, o := range outcomes {
		fp := enginesim.Fingerprint(o.prompt)
		if o.status == http.StatusOK {
			requireOneHandoff(t, engines, fp, recs[fp])
			continue
		}
		for _, d := range recs[fp][enginesim.KindDecode] {
			if d.Status == http.StatusOK {
				require.True(t, o.start.Before(killAt) && o.end.After(killAt),
					"a decode engine completed %q for a client that got %d, and it was not in flight at the kill: %s", o.prompt, o.status, o.body)
				wastedDecodes++
			}
		}
	}
	t.Logf("prefills abandoned by the engines when pdx died: %d; decodes completed for clients that got a 503 (routed before the kill): %d; decode bodies cut by Envoy: %d",
		abandonedPrefills, wastedDecodes, truncated)
	require.LessOrEqual(t, truncated, cut.failed, "only requests in flight at the kill had their decode cut")
	require.Positive(t, abandonedPrefills, "the prefills pdx had in flight were abandoned when it died")
}

// TestPdxSIGTERMDrains: SIGTERM makes pdx drain. The requests it holds
// finish with their own answers, pdx exits 0, and a request that comes once
// the drain has begun is refused with a 503 (fail closed) without reaching
// any engine.
func TestPdxSIGTERMDrains(t *testing.T) {
	const (
		inFlight     = 16
		refused      = 8
		requestBound = 20 * time.Second
		exitBound    = 30 * time.Second
	)
	ps := startProcStack(t, procOptions{
		prefill: 2, decode: 2,
		engine:  enginesim.Config{PrefillLatency: time.Second, DecodeLatency: 20 * time.Millisecond},
		pdxArgs: []string{"--drain-timeout", "20s"},
	})
	hc := newHTTPClient(t)
	target := ps.envoy.URL() + "/v1/completions"

	held := make([]outcome, inFlight)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	for i := range held {
		wg.Go(func() { held[i] = send(t.Context(), hc, target, fmt.Sprintf("drain me %d", i), requestBound) })
	}
	// Every request holds an ext_proc stream in pdx, in its prefill.
	require.Eventually(t, func() bool {
		n, err := envoyStat(ps.envoy.AdminAddr(), "cluster.pdx.upstream_rq_active")
		return err == nil && n >= inFlight
	}, 10*time.Second, 5*time.Millisecond, "the requests never all reached pdx")
	time.Sleep(100 * time.Millisecond) // pdx has sent their prefills

	sigterm := time.Now()
	require.NoError(t, ps.pdx.cmd.Process.Signal(syscall.SIGTERM))
	// The drain has begun once pdx takes no new connections.
	require.Eventually(t, func() bool {
		c, err := net.DialTimeout("tcp", ps.grpcAddr, time.Second)
		if err != nil {
			return true
		}
		c.Close()
		return false
	}, 10*time.Second, 5*time.Millisecond, "pdx still accepts connections after SIGTERM")
	// ... and Envoy has heard pdx's GOAWAY on every connection to it, so no
	// new stream can slip onto an old connection.
	require.Eventually(t, func() bool {
		total, err1 := envoyStat(ps.envoy.AdminAddr(), "cluster.pdx.upstream_cx_total")
		notified, err2 := envoyStat(ps.envoy.AdminAddr(), "cluster.pdx.upstream_cx_close_notify")
		return err1 == nil && err2 == nil && notified >= total
	}, 10*time.Second, 5*time.Millisecond, "Envoy did not hear pdx's GOAWAY")
	drainSeen := time.Since(sigterm)

	late := make([]outcome, refused)
	var lateWG sync.WaitGroup
	for i := range late {
		lateWG.Go(func() { late[i] = send(t.Context(), hc, target, fmt.Sprintf("too late %d", i), requestBound) })
	}
	lateWG.Wait()
	var lateAnswered time.Duration
	for _, o := range late {
		require.NoError(t, o.err, "request %q got no answer", o.prompt)
		requireRouterUnavailable(t, o)
		lateAnswered = max(lateAnswered, o.end.Sub(sigterm))
	}

	wg.Wait()
	var drained time.Duration
	defer func() {
		require.Less(t, lateAnswered, drained, "the late requests were refused while pdx drained, not made to wait for the drain")
	}()
	for _, o := range held {
		require.NoError(t, o.err, "request %q got no answer", o.prompt)
		require.Equal(t, http.StatusOK, o.status, "request %q was in flight at SIGTERM: %s", o.prompt, o.body)
		require.True(t, strings.HasPrefix(o.text, wantPrefix(o.prompt)), "request %q: answer %q", o.prompt, o.text)
		require.True(t, o.end.After(sigterm), "request %q was still in flight at SIGTERM", o.prompt)
		drained = max(drained, o.end.Sub(sigterm))
	}
	select {
	case <-ps.pdx.exited:
		require.NoError(t, ps.pdx.err, "pdx exits 0 after draining")
	case <-time.After(exitBound):
		t.Fatalf("pdx did not exit within %v of SIGTERM", exitBound)
	}
	exited := time.Since(sigterm)

	engines := ps.engines()
	for _, o := range held {
		requireHandoff(t, engines, o.prompt)
	}
	for _, o := range late {
		fp := enginesim.Fingerprint(o.prompt)
		for _, e := range engines.Engines() {
			for _, r := range e.Records() {
				require.NotEqual(t, fp, r.Fingerprint, "refused request %q reached engine %s: %+v", o.prompt, e.Addr(), r)
			}
		}
	}
	t.Logf("after SIGTERM: pdx stopped taking connections at %v, %d new requests refused by %v, %d held requests answered 200 by %v, pdx exited 0 at %v",
		drainSeen.Round(time.Millisecond), refused, lateAnswered.Round(time.Millisecond), inFlight, drained.Round(time.Millisecond), exited.Round(time.Millisecond))
}

// TestPdxSilentPastMessageTimeout: when pdx does not answer within Envoy's
// ext_proc message_timeout (a deployment whose message_timeout is below a
// pool's prefill_timeout), the client gets a 504 that says so in the
// OpenAI error shape, and Envoy's end of the stream stops the prefill.
func TestPdxSilentPastMessageTimeout(t *testing.T) {
	const prefillLatency = 5 * time.Second
	ps := startProcStack(t, procOptions{
		prefill: 1, decode: 1,
		engine:         enginesim.Config{PrefillLatency: prefillLatency},
		messageTimeout: 500 * time.Millisecond,
	})
	hc := newHTTPClient(t)
	o := send(t.Context(), hc, ps.envoy.URL()+"/v1/completions", "slower than envoy waits", 20*time.Second)
	require.NoError(t, o.err)
	requireAPIError(t, answer{status: o.status, header: o.header, body: o.body}, http.StatusGatewayTimeout,
		"router_timeout", "did not answer within the ext_proc message_timeout")

	fp := enginesim.Fingerprint(o.prompt)
	require.Eventually(t, func() bool { return len(kindOf(ps.prefill[0].Records(), enginesim.KindPrefill, fp)) > 0 },
		prefillLatency-time.Second, 5*time.Millisecond, "the prefill engine still works for a request Envoy gave up on")
	abandoned := time.Since(o.start)
	rec := kindOf(ps.prefill[0].Records(), enginesim.KindPrefill, fp)
	require.Len(t, rec, 1)
	require.Equal(t, statusClientGone, rec[0].Status, "%+v", rec[0])
	require.Empty(t, ps.decode[0].Records(), "nothing reached the decode engine")
	t.Logf("answered %d after %v: %s; the prefill engine recorded 499 %v after the request was sent (its latency: %v)",
		o.status, o.end.Sub(o.start).Round(time.Millisecond), o.body, abandoned.Round(time.Millisecond), prefillLatency)
}

// requireRouterUnavailable checks Envoy's answer for a request pdx could
// not serve: a 503 in the OpenAI error shape (see envoy.yaml.tmpl).
func requireRouterUnavailable(t *testing.T, o outcome) {
	t.Helper()
	requireAPIError(t, answer{status: o.status, header: o.header, body: o.body}, http.StatusServiceUnavailable, "router_unavailable", "the request router (pdx) is unavailable")
}

// outcome is what a client got for one request.
type outcome struct {
	prompt     string
	start, end time.Time
	err        error // no HTTP answer
	status     int
	header     http.Header
	body       string
	text       string // choices[0].text of a 200
}

// send posts a completion request for prompt and reads the whole answer,
// giving up after bound.
func send(ctx context.Context, hc *http.Client, url, prompt string, bound time.Duration) (o outcome) {
	o = outcome{prompt: prompt, start: time.Now()}
	defer func() { o.end = time.Now() }()
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url,
		strings.NewReader(`{"model":"demo-model","prompt":"`+prompt+`","max_tokens":4}`))
	if err != nil {
		o.err = err
		return o
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		o.err = err
		return o
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	o.status, o.header, o.body, o.err = resp.StatusCode, resp.Header, string(b), err
	if err == nil && o.status == http.StatusOK {
		var c struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(b, &c); err != nil || len(c.Choices) == 0 {
			o.err = fmt.Errorf("a 200 that is not a completion: %s", b)
		} else {
			o.text = c.Choices[0].Text
		}
	}
	return o
}

// newHTTPClient is a client with its own connection pool, closed when the
// test ends.
func newHTTPClient(t *testing.T) *http.Client {
	hc := &http.Client{Transport: engines.NewTransport()}
	t.Cleanup(hc.CloseIdleConnections)
	return hc
}

func kindOf(recs []enginesim.Record, kind, fp string) []enginesim.Record {
	var out []enginesim.Record
	for _, r := range recs {
		if r.Kind == kind && r.Fingerprint == fp {
			out = append(out, r)
		}
	}
	return out
}

// envoyCounter is envoyStat for the test goroutine.
func envoyCounter(t *testing.T, admin, name string) int {
	t.Helper()
	n, err := envoyStat(admin, name)
	require.NoError(t, err)
	return n
}

// envoyStatsText is Envoy's statistics whose names match the regular
// expression filter, as text.
func envoyStatsText(admin, filter string) (string, error) {
	hc := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get("http://" + admin + "/stats?filter=" + url.QueryEscape(filter))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("envoy stats: %d %s", resp.StatusCode, b)
	}
	return string(b), err
}

// envoyStat reads one statistic (counter or gauge) from Envoy's admin.
func envoyStat(admin, name string) (int, error) {
	text, err := envoyStatsText(admin, "^"+strings.ReplaceAll(name, ".", `\.`)+"$")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(text) {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), ": "); ok && k == name {
			return strconv.Atoi(v)
		}
	}
	return 0, fmt.Errorf("envoy has no statistic %s: %s", name, text)
}

// procStack is a deployment with pdx run the way users run it: the built
// binary as a separate process with a YAML config file on fixed ports, so
// that it can be killed and started again where Envoy expects it.
type procStack struct {
	bin             string
	args            []string
	prefill, decode []*enginesim.Server
	envoy           *envoyproc.Process
	// replicas are the pdx processes behind the one Envoy, all on the same
	// config but each on its own ports. pdx and grpcAddr are the first
	// replica's, the one startPdx starts again.
	replicas []*pdxReplica
	pdx      *pdxProcess
	grpcAddr string
}

// pdxReplica is one pdx of a procStack: its config file, its ports, its log
// and the process now running on them.
type pdxReplica struct {
	config, grpcAddr, adminAddr string
	log                         *logbuf.Buffer
	proc                        *pdxProcess
}

type procOptions struct {
	prefill, decode int
	// replicas is how many pdx processes Envoy spreads requests over
	// (default 1).
	replicas int
	engine   enginesim.Config
	pdxArgs  []string
	// messageTimeout is Envoy's ext_proc message_timeout (default 15s,
	// above the pools' prefill_timeout of 10s).
	messageTimeout time.Duration
	// config is added to the top level of pdx's config.
	config string
}

func startProcStack(t *testing.T, opts procOptions) *procStack {
	t.Helper()
	dir := t.TempDir()
	ps := &procStack{bin: filepath.Join(dir, "pdx"), args: opts.pdxArgs}
	out, err := exec.Command("go", "build", "-o", ps.bin, "../cmd/pdx").CombinedOutput()
	require.NoError(t, err, "%s", out)

	start := func(role enginesim.Role) *enginesim.Server {
		cfg := opts.engine
		cfg.Role = role
		e, err := enginesim.Start(context.Background(), "127.0.0.1:0", cfg)
		require.NoError(t, err)
		t.Cleanup(func() { assert.NoError(t, e.Close()) })
		return e
	}
	var b strings.Builder
	fmt.Fprintf(&b, "pools:\n- name: lifecycle\n  models: [demo-model]\n  connector: nixl\n  prefill_timeout: 10s\n  prefill:\n")
	for range opts.prefill {
		ps.prefill = append(ps.prefill, start(enginesim.RolePrefill))
		fmt.Fprintf(&b, "  - address: %s\n", ps.prefill[len(ps.prefill)-1].Addr())
	}
	fmt.Fprintf(&b, "  decode:\n")
	for range opts.decode {
		ps.decode = append(ps.decode, start(enginesim.RoleDecode))
		fmt.Fprintf(&b, "  - address: %s\n", ps.decode[len(ps.decode)-1].Addr())
	}
	var addrs []string
	for i := range max(opts.replicas, 1) {
		r := &pdxReplica{config: filepath.Join(dir, fmt.Sprintf("pdx-%d.yaml", i)),
			grpcAddr: loopback.FreeAddr(t), adminAddr: loopback.FreeAddr(t), log: &logbuf.Buffer{}}
		config := fmt.Sprintf("%s\ngrpc_address: %s\nadmin_address: %s\n%s", opts.config, r.grpcAddr, r.adminAddr, b.String())
		require.NoError(t, os.WriteFile(r.config, []byte(config), 0o600))
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("pdx replica %d (%s) log:\n%s", i, r.grpcAddr, r.log.String())
			}
		})
		ps.replicas = append(ps.replicas, r)
		ps.startReplica(t, r)
		addrs = append(addrs, r.grpcAddr)
	}
	ps.pdx, ps.grpcAddr = ps.replicas[0].proc, ps.replicas[0].grpcAddr

	envoyBin, err := envoyproc.Binary()
	require.NoError(t, err)
	if opts.messageTimeout == 0 {
		opts.messageTimeout = 15 * time.Second
	}
	ps.envoy, err = envoyproc.Start(t.Context(), envoyBin, envoy.Config{PdxAddresses: addrs, MessageTimeout: opts.messageTimeout}, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("envoy log:\n%s", ps.envoy.Log())
		}
		assert.NoError(t, ps.envoy.Stop())
	})
	return ps
}

// engines is the stack's engines in a stack.Stack, for the record helpers.
func (ps *procStack) engines() *stack.Stack {
	return &stack.Stack{Prefill: ps.prefill, Decode: ps.decode}
}

// pdxProcess is a running pdx binary.
type pdxProcess struct {
	cmd    *exec.Cmd
	exited chan struct{}
	err    error // cmd.Wait's, once exited is closed
}

// startPdx starts the first pdx replica again, on its config and ports,
// and returns once it is ready.
func (ps *procStack) startPdx(t *testing.T) {
	t.Helper()
	ps.startReplica(t, ps.replicas[0])
	ps.pdx = ps.replicas[0].proc
}

// startReplica starts pdx on the replica's config and returns once it is
// ready.
func (ps *procStack) startReplica(t *testing.T, r *pdxReplica) {
	t.Helper()
	p := &pdxProcess{cmd: exec.Command(ps.bin, append([]string{"serve", "--config", r.config}, ps.args...)...), exited: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = r.log, r.log
	fmt.Fprintf(r.log, "----- pdx started -----\n")
	require.NoError(t, p.cmd.Start())
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(p.kill)
	r.proc = p

	hc := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer hc.CloseIdleConnections()
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case <-p.exited:
			t.Fatalf("pdx exited at start: %v\n%s", p.err, r.log.String())
		default:
		}
		if resp, err := hc.Get("http://" + r.adminAddr + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		require.True(t, time.Now().Before(deadline), "pdx not ready")
		time.Sleep(10 * time.Millisecond)
	}
}

// kill ends pdx with SIGKILL, without a drain, and waits for it.
func (p *pdxProcess) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}
