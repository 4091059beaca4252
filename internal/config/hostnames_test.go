package config

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEndpointHostNames: endpoints may name their engines by host name or
// URL; what pdx cannot honour is refused with the field and the fix.
func TestEndpointHostNames(t *testing.T) {
	for _, tc := range []struct {
		name string
		yaml string
		want string // "": valid
	}{
		{"host names", pools(pool(`prefill: [{address: "localhost:18100"}]`, `decode: [{address: "vllm-decode-0.vllm:8000"}, {address: "decode_1:8000"}]`)), ""},
		{"URLs", pools(pool(`prefill: [{address: "http://localhost:18100"}]`, `decode: [{address: "http://10.0.0.2:8000/"}, {address: "HTTP://[fd00::2]:8000"}]`)), ""},
		{"a render server by name and URL", pools(pool(`render: {address: "http://render:8000"}`), pool("name: q", "models: [other]", `render: {address: "render:8000"}`)), ""},
		{"dns_refresh_rate", minimal + "dns_refresh_rate: 1ms\n", ""},
		{"kv_address on the address's host name", pools(pool("connector: p2p-nccl",
			`prefill: [{address: "http://vllm-prefill:8000", kv_address: "vllm-prefill:21001"}]`,
			`decode: [{address: "vllm-decode:8000", kv_address: "10.0.0.2:22001"}]`)), ""},

		{"empty address", pools(pool(`decode: [{address: ""}]`)),
			`config: pools[0].decode[0].address: required: the engine's host:port, e.g. 10.0.0.5:8000 or vllm-decode-0:8000`},
		{"https", pools(pool(`decode: [{address: "https://vllm-decode:8000"}]`)),
			`config: pools[0].decode[0].address: "https://vllm-decode:8000": https is not supported: pdx and Envoy's decode cluster speak plain HTTP to engines; write http://vllm-decode:8000`},
		{"a path", pools(pool(`decode: [{address: "http://vllm-decode:8000/v1"}]`)),
			`config: pools[0].decode[0].address: "http://vllm-decode:8000/v1" has a path "/v1": write the engine's base address, http://vllm-decode:8000; pdx adds the API paths itself`},
		{"a URL without a port", pools(pool(`prefill: [{address: "http://vllm-prefill"}]`)),
			`config: pools[0].prefill[0].address: "http://vllm-prefill" has no port: write the engine's port, e.g. http://vllm-prefill:8000`},
		{"another scheme", pools(pool(`prefill: [{address: "grpc://vllm-prefill:8000"}]`)),
			`config: pools[0].prefill[0].address: "grpc://vllm-prefill:8000": scheme "grpc" is not supported: write host:port or http://host:port`},
		{"not a host name", pools(pool(`prefill: [{address: "vllm prefill:80"}]`)),
			`config: pools[0].prefill[0].address: "vllm prefill:80": "vllm prefill" is neither an IP address nor a host name`},
		{"a mistyped IP", pools(pool(`prefill: [{address: "10.0.0.300:80"}]`)),
			`config: pools[0].prefill[0].address: "10.0.0.300:80": "10.0.0.300" is neither an IP address nor a host name`},
		{"the same name twice", pools(pool(`decode: [{address: "vllm-decode:8000"}, {address: "http://VLLM-decode:8000/"}]`)),
			`config: pools[0].decode[1].address: duplicate endpoint "http://VLLM-decode:8000/" (also pools[0].decode[0].address)`},
		{"kv_address on another name", pools(pool("connector: p2p-nccl",
			`prefill: [{address: "vllm-prefill:8000", kv_address: "vllm-kv:21001"}]`,
			`decode: [{address: "vllm-decode:8000", kv_address: "vllm-decode:22001"}]`)),
			`config: pools[0].prefill[0].kv_address: "vllm-kv:21001" names host "vllm-kv", not the host name of address "vllm-prefill:8000": write an IP, or address's host name (the KV is then on each of its addresses)`},
		{"kv_address as a URL", pools(pool("connector: p2p-nccl",
			`prefill: [{address: "vllm-prefill:8000", kv_address: "http://vllm-prefill:21001"}]`,
			`decode: [{address: "vllm-decode:8000", kv_address: "vllm-decode:22001"}]`)),
			`config: pools[0].prefill[0].kv_address: "http://vllm-prefill:21001" is not host:port`},
		{"render address with a path", pools(pool(`render: {address: "http://render:8000/v1"}`)),
			`config: pools[0].render.address: "http://render:8000/v1" has a path "/v1"`},
		{"dns_refresh_rate zero", minimal + "dns_refresh_rate: 0s\n", `config: dns_refresh_rate: 0s is below the minimum of 1ms`},
		{"dns_refresh_rate too long", minimal + "dns_refresh_rate: 2h\n", `config: dns_refresh_rate: 2h0m0s exceeds the maximum of 1h0m0s`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.yaml))
			if tc.want == "" {
				require.NoError(t, err, "input:\n%s", tc.yaml)
				return
			}
			require.Error(t, err)
			require.Contains(t, withoutLines(err), tc.want, "input:\n%s", tc.yaml)
		})
	}
}
