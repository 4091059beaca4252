package connectors

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func TestSGLangBody(t *testing.T) {
	tests := []struct {
		name   string
		client string
		host   string
		port   int
		room   uint64
		want   string
	}{
		{
			name:   "fields appended, client body unchanged",
			client: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":64,"stream_options":{"include_usage":true}}`,
			host:   "10.0.0.1", port: 8998, room: 42,
			want: `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":64,"stream_options":{"include_usage":true},"bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":42,"rid":"pdx-RID"}`,
		},
		{
			name:   "room 0",
			client: `{"model":"m","prompt":"p"}`,
			host:   "10.0.0.1", port: 8998, room: 0,
			want: `{"model":"m","prompt":"p","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":0,"rid":"pdx-RID"}`,
		},
		{
			name:   "room above 2^53 written exactly",
			client: `{"model":"m","prompt":"p"}`,
			host:   "10.0.0.1", port: 8998, room: 1<<53 + 1,
			want: `{"model":"m","prompt":"p","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":9007199254740993,"rid":"pdx-RID"}`,
		},
		{
			name:   "largest room",
			client: `{"model":"m","prompt":"p"}`,
			host:   "10.0.0.1", port: 8998, room: math.MaxInt64,
			want: `{"model":"m","prompt":"p","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":9223372036854775807,"rid":"pdx-RID"}`,
		},
		{
			name:   "IPv6 host, own port",
			client: `{"model":"m","prompt":"p"}`,
			host:   "fd00::1", port: 9100, room: 7,
			want: `{"model":"m","prompt":"p","bootstrap_host":"fd00::1","bootstrap_port":9100,"bootstrap_room":7,"rid":"pdx-RID"}`,
		},
		{
			name:   "client fields replaced in place, others stripped, rest kept",
			client: `{"bootstrap_room":9223372036854775807,"model":"m","bootstrap_host":"10.6.6.6","seed":18446744073709551615,"bootstrap_port":1,"kv_transfer_params":{},"disaggregated_params":{"request_type":"generation_only"},"prompt":"caf\u00e9","temperature":0.70}`,
			host:   "10.0.0.1", port: 8998, room: 5,
			want: `{"bootstrap_room":5,"model":"m","bootstrap_host":"10.0.0.1","seed":18446744073709551615,"bootstrap_port":8998,"prompt":"caf\u00e9","temperature":0.70,"rid":"pdx-RID"}`,
		},
		{
			name:   "client rid replaced in place, null stream left out",
			client: `{"model":"m","rid":"victim","prompt":"p","stream":null}`,
			host:   "10.0.0.1", port: 8998, room: 5,
			want: `{"model":"m","rid":"pdx-RID","prompt":"p","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":5}`,
		},
		{
			name:   "escaped client keys replaced too",
			client: `{"model":"m","bootstrap_roo\u006d":1,"prompt":"p","kv_transfer_param\u0073":{"remote_host":"10.6.6.6"}}`,
			host:   "10.0.0.1", port: 8998, room: 5,
			want: `{"model":"m","bootstrap_roo\u006d":5,"prompt":"p","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"rid":"pdx-RID"}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			obj, err := jsonedit.Parse([]byte(tc.client))
			require.NoError(t, err)
			got := sglangBody(obj, sglangBootstrap{host: tc.host, port: tc.port, room: tc.room, rid: "pdx-RID"}, endpoint.Rank{}, endpoint.Rank{})
			require.Equal(t, tc.want, string(got))
		})
	}
}

// roomOf returns the bootstrap_room text of an SGLang body.
func roomOf(t *testing.T, body []byte) string {
	t.Helper()
	obj, err := jsonedit.Parse(body)
	require.NoError(t, err)
	raw, ok := obj.Raw("bootstrap_room")
	require.True(t, ok)
	return string(raw)
}

// ridOf returns the rid of an SGLang body.
func ridOf(t *testing.T, body []byte) string {
	t.Helper()
	obj, err := jsonedit.Parse(body)
	require.NoError(t, err)
	raw, ok := obj.Raw("rid")
	require.True(t, ok)
	rid, ok := jsonString(raw)
	require.True(t, ok)
	return string(rid)
}

func TestSGLangPrepare(t *testing.T) {
	tests := []struct {
		name     string
		prefill  endpoint.Endpoint
		client   string
		wantBody string // with ROOM for the room, RID for the rid
	}{
		{
			name:     "default bootstrap port",
			prefill:  testPrefill,
			client:   `{"model":"m","messages":[],"stream":true}`,
			wantBody: `{"model":"m","messages":[],"stream":true,"bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":ROOM,"rid":"RID"}`,
		},
		{
			name:     "own bootstrap port, IPv6",
			prefill:  endpoint.Endpoint{Address: "[fd00::1]:8100", BootstrapPort: 9100},
			client:   `{"model":"m","prompt":"p","bootstrap_host":"10.6.6.6"}`,
			wantBody: `{"model":"m","prompt":"p","bootstrap_host":"fd00::1","bootstrap_port":9100,"bootstrap_room":ROOM,"rid":"RID"}`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, tc.client)
			req.Prefill = tc.prefill
			eng := fakeengine.New().On(http.MethodPost, tc.prefill.Address, req.Path, fakeengine.Reply{Body: "data: {}\n\ndata: [DONE]\n\n"})
			got, err := SGLang{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.NoError(t, prefillOutcome(t, got.Prefill))
			require.Empty(t, got.Decode.RequestID)
			room, rid := roomOf(t, got.Decode.Body), ridOf(t, got.Decode.Body)
			require.Regexp(t, `^[0-9]+$`, room)
			require.Regexp(t, `^pdx-[0-9a-f]{32}$`, rid)
			want := strings.NewReplacer("ROOM", room, "RID", rid).Replace(tc.wantBody)
			require.Equal(t, want, string(got.Decode.Body))
			require.Equal(t, []fakeengine.Call{{Method: http.MethodPost, Endpoint: tc.prefill, Path: req.Path, RequestID: "req-1", Body: string(got.Decode.Body)}},
				eng.Calls(), "both legs get the same body, the room included")
		})
	}
}

// TestSGLangRoom checks rooms are fresh per Prepare call, within
// [0, 2^63-1] and written as exact integer text.
func TestSGLangRoom(t *testing.T) {
	const calls = 2000
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`})
	seen := make(map[string]bool, calls)
	var high int // rooms >= 2^62: the top bit of the range is used
	for range calls {
		got, err := SGLang{}.Prepare(t.Context(), Env{Engine: eng}, req)
		require.NoError(t, err)
		require.NoError(t, <-got.Prefill.Done())
		text := roomOf(t, got.Decode.Body)
		require.Regexp(t, `^(0|[1-9][0-9]*)$`, text, "integer text, no sign, exponent or fraction")
		room, err := strconv.ParseUint(text, 10, 64)
		require.NoError(t, err)
		require.LessOrEqual(t, room, uint64(math.MaxInt64))
		require.Equal(t, text, strconv.FormatUint(room, 10), "round-trips exactly")
		require.False(t, seen[text], "room %s reused", text)
		seen[text] = true
		if room >= 1<<62 {
			high++
		}
	}
	require.Greater(t, high, calls/4, "rooms span the whole 63-bit range")
	for _, c := range eng.Calls() {
		require.True(t, seen[roomOf(t, []byte(c.Body))], "each prefill carries its own request's room")
	}
}

func TestSGLangPrefillOutcome(t *testing.T) {
	tests := []struct {
		name    string
		reply   fakeengine.Reply
		wantErr string
	}{
		{name: "success", reply: fakeengine.Reply{Body: `{"text":"a"}`}},
		{name: "engine error", reply: fakeengine.Reply{Err: &engines.Error{Endpoint: testPrefill, Status: 400, Message: "bad room"}}, wantErr: "answered 400: bad room"},
		{name: "plain error named by the endpoint", reply: fakeengine.Reply{Err: errors.New("reset")}, wantErr: "prefill engine 10.0.0.1:8100: reset"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req := newRequest(t, `{"model":"m","prompt":"p"}`)
			eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, tc.reply)
			got, err := SGLang{}.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err, "prefill failures arrive on the channel")
			require.NotEmpty(t, got.Decode.Body)
			err = prefillOutcome(t, got.Prefill)
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			requireEngineError(t, err, testPrefill)
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}

func TestSGLangCancelledWhilePrefillHangs(t *testing.T) {
	defer goleak.VerifyNone(t)
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Block: true})
	ctx, cancel := context.WithCancel(t.Context())
	got, err := SGLang{}.Prepare(ctx, Env{Engine: eng}, req)
	require.NoError(t, err, "Prepare returns while the prefill runs")
	<-eng.Blocked()
	cancel()
	err = prefillOutcome(t, got.Prefill)
	requireEngineError(t, err, testPrefill)
	require.ErrorIs(t, err, context.Canceled)
}

func TestSGLangNotIPPort(t *testing.T) {
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	req.Prefill = endpoint.Endpoint{Address: "no-port"}
	eng := fakeengine.New()
	_, err := SGLang{}.Prepare(t.Context(), Env{Engine: eng}, req)
	requireEngineError(t, err, req.Prefill)
	require.Empty(t, eng.Calls())
}

// TestSGLangRelease checks that Release aborts the request on both engines
// by its rid, and sends the abort again: an abort that reaches SGLang
// before the request is registered is dropped.
func TestSGLangRelease(t *testing.T) {
	req := newRequest(t, `{"model":"m","prompt":"p"}`)
	eng := fakeengine.New().
		On(http.MethodPost, testPrefill.Address, req.Path, fakeengine.Reply{Body: `{}`}).
		On(http.MethodPost, testPrefill.Address, "/abort_request", fakeengine.Reply{Body: ``}).
		On(http.MethodPost, testDecode.Address, "/abort_request", fakeengine.Reply{Err: &engines.Error{Status: 500, Message: "down"}})
	got, err := SGLang{}.Prepare(t.Context(), Env{Engine: eng}, req)
	require.NoError(t, err)
	require.NoError(t, <-got.Prefill.Done())
	require.NotNil(t, got.Held)
	err = got.Held.Release(t.Context(), Env{Engine: eng})
	requireEngineError(t, err, testDecode)
	abort := `{"rid":"` + ridOf(t, got.Decode.Body) + `"}`
	var aborts []fakeengine.Call
	for _, c := range eng.Calls() {
		if c.Path == "/abort_request" {
			aborts = append(aborts, c)
		}
	}
	want := fakeengine.Call{Method: http.MethodPost, Path: "/abort_request", RequestID: "req-1", Body: abort}
	wantDecode, wantPrefill := want, want
	wantDecode.Endpoint, wantPrefill.Endpoint = testDecode, testPrefill
	require.Equal(t, []fakeengine.Call{wantDecode, wantPrefill, wantDecode, wantPrefill}, aborts)
}
