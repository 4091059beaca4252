package processor

import (
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// withSubset gives a request-headers message the gateway's subset hint.
func withSubset(msg *extprocv3.ProcessingRequest, hint *structpb.Value) *extprocv3.ProcessingRequest {
	msg.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		SubsetHintNamespace: {Fields: map[string]*structpb.Value{SubsetHintKey: hint}},
	}}
	return msg
}

func stringList(s ...string) *structpb.Value {
	vs := make([]*structpb.Value, len(s))
	for i, e := range s {
		vs[i] = structpb.NewStringValue(e)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vs})
}

// The subset hint restricts the decode endpoints (where the gateway sends
// the request), not the prefill, which pdx calls itself; a hint that
// leaves no decode endpoint, or that is malformed, gets 503.
func TestSubsetHint(t *testing.T) {
	table, err := routing.New(&configv1.Config{Pools: []*configv1.Pool{{
		Name: "p", Default: true, Connector: "nixl",
		Prefill:        []*configv1.Endpoint{{Address: "127.0.0.1:8100"}},
		Decode:         []*configv1.Endpoint{{Address: "127.0.0.1:8200"}, {Address: "127.0.0.1:8201"}, {Address: "127.0.0.1:8202"}},
		PrefillTimeout: durationpb.New(time.Second),
	}}})
	require.NoError(t, err)
	const client = `{"model":"m","prompt":"hi","max_tokens":3}`

	tests := []struct {
		name       string
		hint       *structpb.Value // nil: no hint
		wantDecode []string        // any of these
		wantStatus int             // an error instead
	}{
		{name: "no hint: any decode", wantDecode: []string{"127.0.0.1:8200", "127.0.0.1:8201", "127.0.0.1:8202"}},
		{name: "one endpoint", hint: stringList("127.0.0.1:8201"), wantDecode: []string{"127.0.0.1:8201"}},
		{name: "two, one of them unknown", hint: stringList("10.9.9.9:80", "127.0.0.1:8202"), wantDecode: []string{"127.0.0.1:8202"}},
		{name: "only the prefill endpoint", hint: stringList("127.0.0.1:8100"), wantStatus: 503},
		{name: "empty list", hint: stringList(), wantStatus: 503},
		{name: "not a list", hint: structpb.NewStringValue("127.0.0.1:8201"), wantStatus: 503},
		{name: "not strings", hint: structpb.NewListValue(&structpb.ListValue{Values: []*structpb.Value{structpb.NewNumberValue(8201)}}), wantStatus: 503},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Several requests, so that a pick outside the subset would show.
			for range 6 {
				eng := answering(fakeengine.Reply{Body: kvAnswer})
				h := headers("POST", "/v1/completions", false)
				if tc.hint != nil {
					h = withSubset(h, tc.hint)
				}
				out := run(t, table, eng, h, body(client, true))
				if tc.wantStatus != 0 {
					ir := out[len(out)-1].GetImmediateResponse()
					require.EqualValues(t, tc.wantStatus, ir.GetStatus().GetCode())
					require.Contains(t, string(ir.GetBody()), `"code":"no_endpoint"`)
					require.Contains(t, string(ir.GetBody()), "subset hint")
					require.Empty(t, eng.Calls(), "no prefill for a request that cannot be sent on")
					return
				}
				require.Len(t, out, 2)
				require.Len(t, eng.Calls(), 1)
				require.Equal(t, "127.0.0.1:8100", eng.Calls()[0].Endpoint.Address, "the prefill is not restricted")
				require.Contains(t, tc.wantDecode, setHeaders(out[1].GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
			}
		})
	}
}
