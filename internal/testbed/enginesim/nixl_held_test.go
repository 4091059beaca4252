package enginesim

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A NIXL prefill holds its KV until a decode pulls it.
func TestNixlHeldKVPulled(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill})
	d := startSim(t, Config{Role: RoleDecode})
	b := chatBody("hold me").with("max_tokens", 3)
	kv := prefill(t, p, "req-1", b)
	require.Equal(t, 1, p.HeldKV())

	var st State
	require.NoError(t, json.Unmarshal(get(t, p, "/sim/state").body, &st))
	require.Equal(t, State{HeldKV: 1}, st)

	requireDecodePulled(t, d, p, post(t, d, "/v1/chat/completions", "req-1", b.with("kv_transfer_params", kv)), b, false, wantText(t, b))
	require.Equal(t, State{KVPulled: 1}, p.State())
	require.Zero(t, p.Released())
	require.Equal(t, State{}, d.State())
}

// A decode whose client goes away while it waits in vLLM's queue is
// aborted before it pulls; it notifies the prefill, which frees the KV
// (vLLM PR #19223).
func TestNixlAbortedBeforeScheduled(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill})
	d := startSim(t, Config{Role: RoleDecode, DecodeQueueLatency: time.Hour})
	b := completionBody("queued").with("max_tokens", 3)
	kv := prefill(t, p, "req-1", b)

	ctx, cancel := context.WithCancel(t.Context())
	dc := goPostCtx(t, ctx, d, "/v1/completions", "req-1", b.with("kv_transfer_params", kv))
	require.Eventually(t, func() bool { return d.State().Waiting == 1 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 1, p.HeldKV(), "queued: nothing pulled yet")
	cancel()
	require.ErrorIs(t, (<-dc).err, context.Canceled)

	requireAbandoned(t, d, KindDecode)
	rec := d.Records()[0]
	require.Contains(t, rec.Error, "client went away before the request was scheduled")
	require.Contains(t, rec.Error, "notified the prefill engine at "+p.Addr()+" to release the KV of remote_request_id "+kv["remote_request_id"].(string))
	require.Empty(t, rec.KV, "nothing was pulled")
	require.Zero(t, d.State().Waiting)

	require.Zero(t, p.HeldKV())
	require.Equal(t, 1, p.Released())
	require.Equal(t, State{KVReleased: 1}, p.State())
	release := lastKind(t, p, KindKVRelease)
	require.Equal(t, http.StatusOK, release.Status)
	require.Equal(t, "req-1", release.RequestID)
	require.Equal(t, Fingerprint("queued"), release.Fingerprint)

	// The KV is gone: a late decode cannot pull it.
	d2 := startSim(t, Config{Role: RoleDecode})
	r := post(t, d2, "/v1/completions", "req-1", b.with("kv_transfer_params", kv))
	require.Contains(t, r.errorMessage(t, http.StatusBadRequest), `was released: the decode of request "req-1" was aborted before it pulled`)
}

// A scheduled decode pulls its KV after its wait in the queue.
func TestNixlQueuedDecodePulls(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill})
	d := startSim(t, Config{Role: RoleDecode, DecodeQueueLatency: 20 * time.Millisecond})
	b := chatBody("scheduled").with("max_tokens", 3)
	kv := prefill(t, p, "req-1", b)
	start := time.Now()
	requireDecodePulled(t, d, p, post(t, d, "/v1/chat/completions", "req-1", b.with("kv_transfer_params", kv)), b, false, wantText(t, b))
	require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond)
	require.Equal(t, State{KVPulled: 1}, p.State())
}

// KV that no decode pulls or releases is freed when KVTTL passes.
func TestNixlHeldKVExpires(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, KVTTL: 20 * time.Millisecond})
	prefill(t, p, "req-1", chatBody("forgotten"))
	require.Eventually(t, func() bool { return p.HeldKV() == 0 }, 5*time.Second, 5*time.Millisecond)
	require.Equal(t, State{KVExpired: 1}, p.State())
}

func TestNixlReleaseRefusals(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, EngineID: "p"})
	d := startSim(t, Config{Role: RoleDecode})
	b := chatBody("x")
	pulled := prefill(t, p, "req-1", b)
	post(t, d, "/v1/chat/completions", "req-1", b.with("kv_transfer_params", pulled)).decode(t)
	held := prefill(t, p, "req-2", b)
	tests := []struct {
		name    string
		req     releaseRequest
		status  int
		wantMsg string
	}{
		{"unknown", releaseRequest{RemoteEngineID: "p", RemoteRequestID: "nope"}, http.StatusNotFound, `no KV for remote_request_id "nope"`},
		{"pulled already", releaseRequest{RemoteEngineID: "p", RemoteRequestID: pulled["remote_request_id"].(string)}, http.StatusConflict, "was already pulled"},
		{"another engine", releaseRequest{RemoteEngineID: "q", RemoteRequestID: held["remote_request_id"].(string)}, http.StatusBadRequest, "remote_engine_id mismatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := post(t, p, "/sim/kv/release", "req-9", tt.req)
			require.Contains(t, r.errorMessage(t, tt.status), tt.wantMsg)
			rec := lastKind(t, p, KindKVRelease)
			require.Equal(t, tt.status, rec.Status)
		})
	}
	require.Equal(t, 1, p.HeldKV())
}

// TamperKVParams makes a prefill hand out kv_transfer_params naming another
// source; a decode still dials loopback only.
func TestTamperKVParams(t *testing.T) {
	p := startSim(t, Config{Role: RolePrefill, EngineID: "p",
		TamperKVParams: json.RawMessage(`{"remote_host":"203.0.113.66","remote_port":9901,"extra":1}`)})
	d := startSim(t, Config{Role: RoleDecode})
	b := chatBody("tampered")
	kv := prefill(t, p, "req-1", b)
	require.Equal(t, "203.0.113.66", kv["remote_host"])
	require.EqualValues(t, 9901, kv["remote_port"])
	require.EqualValues(t, 1, kv["extra"])
	require.Equal(t, "p", kv["remote_engine_id"], "other members are kept")
	require.Equal(t, true, kv["do_remote_prefill"])
	require.NotEmpty(t, kv["remote_block_ids"])

	r := post(t, d, "/v1/chat/completions", "req-1", b.with("kv_transfer_params", kv))
	require.Contains(t, r.errorMessage(t, http.StatusBadRequest), "refusing to pull KV from non-loopback address 203.0.113.66:9901")
	require.Equal(t, 1, p.HeldKV())

	for _, raw := range []string{`[1]`, `null`, `{"a":`} {
		_, err := Start(t.Context(), "127.0.0.1:0", Config{TamperKVParams: json.RawMessage(raw)})
		require.ErrorContains(t, err, "TamperKVParams must be a JSON object", raw)
	}
}
