package processor

import (
	"maps"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// TestDiscoveredPool routes through a pool whose endpoints are set the way
// Kubernetes discovery sets them: possibly none, and paired by group.
func TestDiscoveredPool(t *testing.T) {
	ep := func(addr, group string) endpoint.Endpoint {
		return endpoint.Endpoint{Address: addr, Group: group}
	}
	tests := []struct {
		name              string
		prefill, decode   []endpoint.Endpoint
		answers           map[string]fakeengine.Reply
		wantCalls         []string
		wantDecode        string // the routed decode endpoint; "" wants an error
		wantStatus        int
		wantCode, wantMsg string
	}{
		{
			name: "no decode endpoint", prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "")},
			wantStatus: 503, wantCode: "no_endpoint", wantMsg: "no endpoint available: pool p has no ready decode endpoint",
		},
		{
			name: "unpaired", prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "")},
			wantCalls: []string{"127.0.0.1:1"}, wantDecode: "127.0.0.1:9",
		},
		{
			name:    "prefill from the decode's group",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "g2"), ep("127.0.0.1:2", "g1")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "g1")},
			wantCalls: []string{"127.0.0.1:2"}, wantDecode: "127.0.0.1:9",
		},
		{
			name:    "retries stay in the group",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "g1"), ep("127.0.0.1:3", "g2"), ep("127.0.0.1:2", "g1")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "g1")},
			answers:   map[string]fakeengine.Reply{"127.0.0.1:1": answer(503)},
			wantCalls: []string{"127.0.0.1:1", "127.0.0.1:2"}, wantDecode: "127.0.0.1:9",
		},
		{
			name:    "no other group's prefill once the group's are tried",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "g1"), ep("127.0.0.1:3", "g2")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "g1")},
			answers:   map[string]fakeengine.Reply{"127.0.0.1:1": answer(503)},
			wantCalls: []string{"127.0.0.1:1"}, wantStatus: 502, wantCode: "prefill_failed",
		},
		{
			name:    "decode's group has no prefill",
			prefill: []endpoint.Endpoint{ep("127.0.0.1:1", "g2")}, decode: []endpoint.Endpoint{ep("127.0.0.1:9", "g1")},
			wantStatus: 503, wantCode: "no_endpoint",
			wantMsg: `no endpoint available: pool p has no ready prefill endpoint in group "g1" of decode endpoint 127.0.0.1:9`,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  kubernetes: {namespace: llm, service: engines, port: 8000}
  prefill_picker: {policy: round_robin} # the tests know which endpoint comes next
`))
			require.NoError(t, err)
			table, err := routing.New(cfg)
			require.NoError(t, err)
			pool, ok := table.Pool("p")
			require.True(t, ok)
			require.Empty(t, pool.Decode.Set.Endpoints(), "a discovered pool starts empty")
			pool.SetEndpoints(tc.prefill, tc.decode)

			answers := map[string]fakeengine.Reply{}
			for _, p := range tc.prefill {
				answers[p.Address] = answerOK
			}
			maps.Copy(answers, tc.answers)
			eng := scripted(answers)
			out := runChat(t, table, eng)
			require.Equal(t, tc.wantCalls, called(eng))
			if tc.wantDecode != "" {
				require.Equal(t, tc.wantDecode, setHeaders(out.GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
				return
			}
			status, b := immediateOf(t, out)
			require.Equal(t, tc.wantStatus, status)
			require.Equal(t, tc.wantCode, b.Error.Code)
			if tc.wantMsg != "" {
				require.Equal(t, tc.wantMsg, b.Error.Message)
			}
		})
	}
}
