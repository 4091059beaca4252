package endpoint

import (
	"net/netip"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseAddress(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    string // Address.String()
		name    bool
		wantErr string
	}{
		{in: "10.0.0.5:8000", want: "10.0.0.5:8000"},
		{in: "[fd00::1]:8000", want: "[fd00::1]:8000"},
		{in: "[::ffff:10.0.0.5]:8000", want: "10.0.0.5:8000"},
		{in: "localhost:18100", want: "localhost:18100", name: true},
		{in: "vllm-decode-0.vllm:8000", want: "vllm-decode-0.vllm:8000", name: true},
		{in: "Decode_1.Example.:8000", want: "decode_1.example:8000", name: true},
		{in: "http://localhost:8000", want: "localhost:8000", name: true},
		{in: "http://10.0.0.5:8000/", want: "10.0.0.5:8000"},
		{in: "HTTP://[fd00::1]:8000", want: "[fd00::1]:8000"},

		{in: "https://vllm:8000", wantErr: `"https://vllm:8000": https is not supported: pdx and Envoy's decode cluster speak plain HTTP to engines; write http://vllm:8000`},
		{in: "grpc://vllm:8000", wantErr: `scheme "grpc" is not supported: write host:port or http://host:port`},
		{in: "http://vllm:8000/v1", wantErr: `"http://vllm:8000/v1" has a path "/v1": write the engine's base address, http://vllm:8000; pdx adds the API paths itself`},
		{in: "http://vllm:8000/?x=1", wantErr: `has a query or fragment: write http://vllm:8000`},
		{in: "http://user:pw@vllm:8000", wantErr: `has user information, which pdx does not send: write http://vllm:8000`},
		{in: "http://vllm", wantErr: `"http://vllm" has no port: write the engine's port, e.g. http://vllm:8000`},
		{in: "http://vllm:x", wantErr: `"http://vllm:x" is not a URL: invalid port ":x"`},
		{in: "vllm", wantErr: `"vllm" is not host:port (e.g. 10.0.0.5:8000 or vllm-decode-0:8000)`},
		{in: "::1:80", wantErr: `is not host:port`},
		{in: "fd00::1:80", wantErr: `is not host:port`},
		{in: "10.0.0.5:0", wantErr: `"10.0.0.5:0" has port "0", want 1-65535`},
		{in: "vllm:65536", wantErr: `has port "65536", want 1-65535`},
		{in: "0.0.0.0:80", wantErr: `"0.0.0.0:80" has an unspecified IP, which cannot be connected to`},
		{in: "[::]:80", wantErr: `has an unspecified IP`},
		{in: "bad host!:80", wantErr: `"bad host!" is neither an IP address nor a host name`},
		{in: "10.0.0.256:80", wantErr: `"10.0.0.256" is neither an IP address nor a host name`},
		{in: "-vllm:80", wantErr: `is neither an IP address nor a host name`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			a, err := ParseAddress(tc.in)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, a.String())
			require.Equal(t, tc.name, a.IsName())
		})
	}
}

func TestParseHostPortTakesNoURL(t *testing.T) {
	_, err := ParseHostPort("http://vllm:8000")
	require.ErrorContains(t, err, "is not host:port")
	a, err := ParseHostPort("vllm-prefill-0:14579")
	require.NoError(t, err)
	require.Equal(t, "10.1.2.3:14579", a.At(netip.MustParseAddr("10.1.2.3")))
	require.Equal(t, "[fd00::2]:14579", a.At(netip.MustParseAddr("fd00::2")))
}
