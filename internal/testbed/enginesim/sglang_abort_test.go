package enginesim

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// postAbort posts SGLang's /abort_request to s and checks its empty 200.
func postAbort(t *testing.T, s *Server, b any) {
	t.Helper()
	r := post(t, s, "/abort_request", "", b)
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	require.Empty(t, r.body, "SGLang answers Response(status_code=200)")
}

// waitForN waits until n takes wait on h.
func waitForN(t *testing.T, h *handoffs, n int) {
	t.Helper()
	require.Eventually(t, func() bool { return h.waiting() >= n }, 5*time.Second, time.Millisecond)
}

// inFlight reports whether rid is in flight on an SGLang engine.
func inFlight(s *Server, rid string) bool {
	p := s.proto.(*sglangProtocol)
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.inflight[rid]
	return ok
}

// transferAborted is the error an aborted waiting decode gets.
func transferAborted(rid, room string) string {
	return fmt.Sprintf("Decode transfer failed for request rank=0 decode_req.req.rid='%s' decode_req.req.bootstrap_room=%s with exception Aborted by AbortReq.", rid, room)
}

// A decode waiting on its room holds a slot; aborting it by rid frees the
// slot and fails the decode at once with SGLang's transfer error.
func TestSGLangAbortWaitingDecode(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run("decode"+streamName(stream), func(t *testing.T) {
			p, d := sglangPair(t, Config{}, time.Hour)
			b := withRoom(chatBody("abort me").streaming(stream).with("rid", "job-1"), p, 7)
			dc := goPost(t, d, "/v1/chat/completions", "req-1", b)
			waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
			require.Equal(t, 1, d.HeldSlots())

			postAbort(t, d, body{"rid": "job-1"})
			r := await(t, dc)
			if stream {
				requireStreamError(t, d, r, http.StatusInternalServerError, transferAborted("job-1", "7"))
			} else {
				requireRejected(t, d, r, http.StatusInternalServerError, transferAborted("job-1", "7"))
			}
			require.Zero(t, d.HeldSlots())
			require.Equal(t, 1, d.State().Aborted)
			rec := lastKind(t, d, KindAbort)
			require.Equal(t, "job-1", rec.RID)
			require.Equal(t, http.StatusOK, rec.Status)
			require.Equal(t, "job-1", lastKind(t, d, KindRejected).RID)
		})
	}
}

// The tokenizer manager forwards an abort only for a rid it has in flight;
// the scheduler then aborts every request whose rid starts with it.
func TestSGLangAbortMatching(t *testing.T) {
	tests := []struct {
		name    string
		rids    []string // decodes waiting, one room each
		abort   body
		aborted []string
	}{
		{"exact", []string{"job-1", "job-2"}, body{"rid": "job-1"}, []string{"job-1"}},
		{"the scheduler matches by prefix", []string{"job-1", "job-12", "job-2"}, body{"rid": "job-1"}, []string{"job-1", "job-12"}},
		{"a prefix that is no rid in flight", []string{"job-1"}, body{"rid": "job-"}, nil},
		{"unknown rid", []string{"job-1"}, body{"rid": "nope"}, nil},
		{"null rid", []string{"job-1"}, body{"rid": nil}, nil},
		{"abort_all", []string{"a", "b"}, body{"abort_all": true}, []string{"a", "b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, d := sglangPair(t, Config{}, time.Hour)
			replies := make(map[string]<-chan asyncReply)
			for i, rid := range tt.rids {
				replies[rid] = goPost(t, d, "/v1/chat/completions", "req-"+rid, withRoom(chatBody(rid).with("rid", rid), p, i+1))
			}
			waitForN(t, p.proto.(*sglangProtocol).rooms, len(tt.rids))

			postAbort(t, d, tt.abort)
			for _, rid := range tt.aborted {
				require.Contains(t, await(t, replies[rid]).errorMessage(t, http.StatusInternalServerError), "Aborted by AbortReq.")
				delete(replies, rid)
			}
			require.Equal(t, len(tt.aborted), d.State().Aborted)
			require.Equal(t, len(replies), d.HeldSlots(), "the others still wait")
			for rid := range replies {
				require.True(t, inFlight(d, rid), rid)
			}
			postAbort(t, d, body{"abort_all": true})
			for _, ch := range replies {
				await(t, ch)
			}
		})
	}
}

// A prefill's KV held for its decode keeps its rid in flight (SGLang's
// prefill request lasts until its KV is sent): a duplicate is refused, and
// an abort frees the KV, so that its decode then times out.
func TestSGLangAbortHeldPrefill(t *testing.T) {
	p, d := sglangPair(t, Config{}, 200*time.Millisecond)
	b := withRoom(chatBody("held").with("rid", "job-1"), p, 9)
	post(t, p, "/v1/chat/completions", "req-1", b).decode(t)
	require.Equal(t, 1, p.HeldKV())
	requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-2", withRoom(chatBody("other").with("rid", "job-1"), p, 10)),
		http.StatusBadRequest, "Duplicate request ID detected: job-1")

	postAbort(t, p, body{"rid": "job-1"})
	require.Zero(t, p.HeldKV())
	st := p.State()
	require.Equal(t, 1, st.KVReleased)
	require.Equal(t, 1, st.Aborted)
	require.Equal(t, 1, p.Released())
	requireRejected(t, d, post(t, d, "/v1/chat/completions", "req-1", b), http.StatusInternalServerError,
		"timed out after 0.2s in KVPoll.WaitingForInput")
	// The rid is free again.
	post(t, p, "/v1/chat/completions", "req-3", withRoom(chatBody("again").with("rid", "job-1"), p, 11)).decode(t)
}

// A prefill aborted while it computes finishes with finish_reason "abort"
// and leaves no KV.
func TestSGLangAbortComputingPrefill(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang, PrefillLatency: time.Hour})
	pc := goPost(t, p, "/v1/completions", "req-1", withRoom(completionBody("slow").with("rid", "job-1", "max_tokens", 1), p, 3))
	require.Eventually(t, func() bool { return inFlight(p, "job-1") }, 5*time.Second, time.Millisecond)
	postAbort(t, p, body{"rid": "job-1"})
	resp := await(t, pc).decode(t)
	require.Equal(t, "abort", resp.Choices[0].FinishReason)
	require.Empty(t, resp.text())
	require.Zero(t, p.HeldKV())
	require.Equal(t, KindPrefill, lastKind(t, p, KindPrefill).Kind)
}

// A request aborted while it generates ends its stream with finish_reason
// "abort" after the tokens it generated.
func TestSGLangAbortGenerating(t *testing.T) {
	s := startSim(t, Config{Connector: ConnectorSGLang, DecodePerToken: time.Hour})
	b := completionBody("generate").with("rid", "job-1", "max_tokens", 5, "stream", true)
	sc, _ := openStream(t, s, "req-1", b) // returns once the first token is out
	postAbort(t, s, body{"rid": "job-1"})
	rest := scanAll(t, sc)
	require.Contains(t, rest, `"finish_reason":"abort"`)
	require.Contains(t, rest, "data: [DONE]")
	require.NotContains(t, rest, " t1", "no token after the abort")
	require.Equal(t, http.StatusOK, lastKind(t, s, KindPlain).Status)
}

func TestSGLangRID(t *testing.T) {
	p, d := sglangPair(t, Config{}, time.Minute)
	b := withRoom(chatBody("x").with("max_tokens", 3, "rid", "dup"), p, 1)
	dc := goPost(t, d, "/v1/chat/completions", "req-1", b)
	waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
	// SGLang's tokenizer manager: "Duplicate request ID detected".
	requireRejected(t, d, post(t, d, "/v1/chat/completions", "req-2", withRoom(chatBody("y").with("rid", "dup"), p, 2)),
		http.StatusBadRequest, "Duplicate request ID detected: dup")
	post(t, p, "/v1/chat/completions", "req-1", b).decode(t)
	requireDecodePulled(t, d, p, await(t, dc), b, false, wantText(t, b))
	require.Equal(t, "dup", lastKind(t, d, KindDecode).RID)

	// Done, the rid may be used again; a rid list of one is a rid.
	again := withRoom(chatBody("z").with("max_tokens", 3, "rid", []string{"dup"}), p, 3)
	dc = goPost(t, d, "/v1/chat/completions", "req-3", again)
	waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
	post(t, p, "/v1/chat/completions", "req-3", again).decode(t)
	requireDecodePulled(t, d, p, await(t, dc), again, false, wantText(t, again))

	for _, tt := range []struct {
		rid     any
		wantMsg string
	}{
		{5, "rid must be a string or a list of strings, got 5"},
		{[]string{"a", "b"}, "rid lists 2 request ids; the simulator serves one request a body"},
	} {
		requireRejected(t, p, post(t, p, "/v1/chat/completions", "req-4", withRoom(chatBody("x").with("rid", tt.rid), p, 4)),
			http.StatusBadRequest, tt.wantMsg)
	}
	r := post(t, d, "/abort_request", "", []byte(`{"rid":5}`))
	require.Contains(t, r.errorMessage(t, http.StatusBadRequest), "invalid side channel request")
}

// SGLang notices a gone client only at its disconnect check: until then the
// decode keeps its slot, and an abort frees it at once.
func TestSGLangSlotHeldUntilDisconnectCheck(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, Connector: ConnectorSGLang})
	d := startSim(t, Config{Role: RoleDecode, Connector: ConnectorSGLang, KVWaitTimeout: time.Hour, DisconnectCheckInterval: time.Hour})
	ctx, cancel := context.WithCancel(t.Context())
	dc := goPostCtx(t, ctx, d, "/v1/chat/completions", "req-1", withRoom(chatBody("x").with("rid", "r1"), p, 1))
	waitForWaiters(t, p.proto.(*sglangProtocol).rooms)
	cancel()
	require.ErrorIs(t, (<-dc).err, context.Canceled)
	dp := d.proto.(*sglangProtocol)
	require.Eventually(t, func() bool {
		dp.mu.Lock()
		defer dp.mu.Unlock()
		return dp.gone == 1
	}, 5*time.Second, time.Millisecond, "the engine saw the client leave")
	require.Equal(t, 1, d.HeldSlots(), "not noticed yet: the slot stays held")
	require.Empty(t, d.Records(), "the decode still waits")

	postAbort(t, d, body{"rid": "r1"})
	require.Eventually(t, func() bool { return d.HeldSlots() == 0 }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return len(d.Records()) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, http.StatusInternalServerError, lastKind(t, d, KindRejected).Status)
}

func TestSGLangDisconnectCheckDefault(t *testing.T) {
	require.Equal(t, 4*time.Second, startSim(t, Config{Connector: ConnectorSGLang}).cfg.DisconnectCheckInterval)
	require.Zero(t, startSim(t, Config{}).cfg.DisconnectCheckInterval, "vLLM notices a gone client at once")
}

// scanAll drains an SSE scanner (for a stream that must end).
func scanAll(t *testing.T, sc *bufio.Scanner) string {
	t.Helper()
	var b strings.Builder
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	require.NoError(t, sc.Err())
	return b.String()
}
