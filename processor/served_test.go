package processor

import (
	"log/slog"
	"strconv"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

func fallbackTable(t *testing.T, fallbacks int) *routing.Table {
	t.Helper()
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  decode_fallbacks: ` + strconv.Itoa(fallbacks) + `
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:11}, {address: 127.0.0.1:12}, {address: 127.0.0.1:13}]
  decode_picker: {policy: round_robin}
`))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	return table
}

// responseFrom is the response headers Envoy sends in the decode-fallback
// profile: the status and the upstream.address attribute, or, with
// "metadata:" before addr, the endpoint-picker protocol's served metadata.
func responseFrom(status, addr string) *extprocv3.ProcessingRequest {
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(status)}}},
	}}}
	if a, ok := strings.CutPrefix(addr, "metadata:"); ok {
		msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			MetadataNamespace: {Fields: map[string]*structpb.Value{ServedKey: structpb.NewStringValue(a)}},
		}}
		// The metadata wins over the attribute.
		addr = "10.9.9.9:1"
	}
	if addr != "" {
		msg.Attributes = map[string]*structpb.Struct{"envoy.filters.http.ext_proc": {Fields: map[string]*structpb.Value{
			UpstreamAddressAttribute: structpb.NewStringValue(addr),
		}}}
	}
	return msg
}

// A pool with decode fallbacks names them after pdx's pick, in header and
// metadata alike, asks Envoy for the response headers, and, told which
// decode served, reports the ones Envoy retried past to passive health,
// counts the request on the one that served and answers with the client's
// request id.
func TestDecodeFallbacks(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fallbacks int
		served    string // upstream.address of the response; "" none
		status    string
		wantDest  string
		failed    []string // endpoints reported failed
		inFlight  string   // where the request is counted at the response
	}{
		{name: "no fallbacks", fallbacks: 0, served: "127.0.0.1:11", status: "200", wantDest: "127.0.0.1:11", inFlight: "127.0.0.1:11"},
		{name: "first served", fallbacks: 2, served: "127.0.0.1:11", status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12,127.0.0.1:13", inFlight: "127.0.0.1:11"},
		{name: "second served", fallbacks: 2, served: "127.0.0.1:12", status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12,127.0.0.1:13",
			failed: []string{"127.0.0.1:11"}, inFlight: "127.0.0.1:12"},
		{name: "third served", fallbacks: 2, served: "127.0.0.1:13", status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12,127.0.0.1:13",
			failed: []string{"127.0.0.1:11", "127.0.0.1:12"}, inFlight: "127.0.0.1:13"},
		{name: "all failed", fallbacks: 1, served: "127.0.0.1:12", status: "503", wantDest: "127.0.0.1:11,127.0.0.1:12",
			failed: []string{"127.0.0.1:11"}, inFlight: "127.0.0.1:12"},
		{name: "a host pdx did not name", fallbacks: 1, served: "10.9.9.9:1", status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12", inFlight: "127.0.0.1:11"},
		{name: "the gateway's served metadata", fallbacks: 2, served: "metadata:127.0.0.1:12", status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12,127.0.0.1:13",
			failed: []string{"127.0.0.1:11"}, inFlight: "127.0.0.1:12"},
		{name: "no attribute", fallbacks: 1, status: "200", wantDest: "127.0.0.1:11,127.0.0.1:12", inFlight: "127.0.0.1:11"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			table := fallbackTable(t, tc.fallbacks)
			pool := table.Pools()[0]
			stream := newFakeStream(t.Context())
			stream.in <- headers("POST", "/v1/completions", false, "x-request-id", "client-1")
			stream.in <- body(`{"model":"m","prompt":"hi"}`, true)
			srv := New(table, answering(fakeengine.Reply{Body: kvAnswer}), slog.New(slog.DiscardHandler))
			done := make(chan error, 1)
			go func() { done <- srv.Process(stream) }()

			first := <-stream.out
			if tc.fallbacks > 0 {
				require.Equal(t, filterextprocv3.ProcessingMode_SEND, first.GetModeOverride().GetResponseHeaderMode(), "pdx asks for the response headers")
			}
			routed := <-stream.out
			set := setHeaders(routed.GetRequestBody().GetResponse().GetHeaderMutation())
			require.Equal(t, tc.wantDest, set[DestinationHeader])
			require.Equal(t, tc.wantDest, routed.GetDynamicMetadata().GetFields()[MetadataNamespace].GetStructValue().GetFields()[DestinationHeader].GetStringValue())

			stream.in <- responseFrom(tc.status, tc.served)
			resp := <-stream.out
			require.Equal(t, "client-1", setHeaders(resp.GetResponseHeaders().GetResponse().GetHeaderMutation())["x-request-id"])
			for _, a := range []string{"127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"} {
				want := 0
				if a == tc.inFlight {
					want = 1
				}
				require.Equal(t, want, pool.Decode.Set.InFlight(endpoint.Endpoint{Address: a}), "in flight on %s", a)
			}
			close(stream.in)
			require.NoError(t, <-done)
			for _, a := range []string{"127.0.0.1:11", "127.0.0.1:12", "127.0.0.1:13"} {
				require.Zero(t, pool.Decode.Set.InFlight(endpoint.Endpoint{Address: a}), "the count ends with the stream")
			}
			// One failure ejects nobody (threshold 3): three more do for
			// the endpoints reported.
			for _, a := range tc.failed {
				ep := endpoint.Endpoint{Address: a}
				pool.Decode.Report(ep, false)
				pool.Decode.Report(ep, false)
				require.False(t, pool.Decode.Set.Healthy(ep), "%s was reported failed once before", a)
			}
		})
	}
}
