package envoy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"strings"
	"testing"
	"time"

	celv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/filters/cel/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"
)

func TestRender(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, Render(&buf, Config{PdxAddress: "127.0.0.1:9002", MessageTimeout: 1500 * time.Millisecond}))
	out := buf.String()
	require.Contains(t, out, "message_timeout: 1.5s")
	require.Contains(t, out, "failure_mode_allow: false")
	require.Contains(t, out, "http_header_name: x-gateway-destination-endpoint")
	require.Contains(t, out, "per_connection_buffer_limit_bytes: 16777216")
	require.Contains(t, out, "initial_stream_window_size: 16777216", "HTTP/2 bodies are bounded alike")
	require.Contains(t, out, "max_headers_count: 100")
	require.Contains(t, out, "max_request_headers_kb: 60")
	require.Contains(t, out, "untyped: [envoy.lb, pdx]")

	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "nope"}), "pdx address")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", RequestBodyMode: "STREAMED"}), `request body mode "STREAMED"`)
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: ProfileAIGateway, DecodeCluster: DecodeEDS}), "ORIGINAL_DST cluster")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: ProfileAIGateway, Observer: true}), "observability pass")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: "gke"}), `profile "gke"`)

	// What a profile would not write is refused, not dropped (every flag of
	// `pdx envoy-config` by profile: cmd/pdx/mainlib's tests).
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: ProfileAIGateway, MessageTimeout: 45 * time.Second}), "message timeout 45s")
	require.NoError(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: ProfileAIGateway, MessageTimeout: 5 * time.Second}), "the profile's own")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", Profile: ProfileAIGateway, RequestBodyMode: BodyBuffered}), "request body mode BUFFERED")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", DecodeFallbacks: 2}), "decode fallbacks 2")
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", XDSCluster: "x"}), `xDS cluster "x"`)
	require.ErrorContains(t, Render(&buf, Config{PdxAddress: "127.0.0.1:1", ListenPort: -1}), "listen port")
}

// TestRenderBodyModes decodes the ext_proc filter each body mode renders.
func TestRenderBodyModes(t *testing.T) {
	tests := []struct {
		mode string
		want *extprocv3.ProcessingMode
		// allow_content_length_header: Envoy drops the content-length pdx
		// sets in FULL_DUPLEX_STREAMED mode unless allowed.
		wantContentLength bool
	}{
		{mode: "", want: &extprocv3.ProcessingMode{
			RequestHeaderMode: extprocv3.ProcessingMode_SEND, RequestBodyMode: extprocv3.ProcessingMode_BUFFERED,
			RequestTrailerMode: extprocv3.ProcessingMode_SKIP, ResponseHeaderMode: extprocv3.ProcessingMode_SKIP,
			ResponseBodyMode: extprocv3.ProcessingMode_NONE, ResponseTrailerMode: extprocv3.ProcessingMode_SKIP,
		}},
		{mode: BodyFullDuplexStreamed, wantContentLength: true, want: &extprocv3.ProcessingMode{
			// Trailers can end the body; response headers let pdx hold a
			// concurrent prefill's decode (mode overrides are ignored).
			RequestHeaderMode: extprocv3.ProcessingMode_SEND, RequestBodyMode: extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			RequestTrailerMode: extprocv3.ProcessingMode_SEND, ResponseHeaderMode: extprocv3.ProcessingMode_SEND,
			ResponseBodyMode: extprocv3.ProcessingMode_NONE, ResponseTrailerMode: extprocv3.ProcessingMode_SKIP,
		}},
	}
	for _, tc := range tests {
		t.Run("mode "+tc.mode, func(t *testing.T) {
			var buf bytes.Buffer
			require.NoError(t, Render(&buf, Config{PdxAddress: "127.0.0.1:9002", RequestBodyMode: tc.mode}))
			var bs map[string]any
			require.NoError(t, yaml.Unmarshal(buf.Bytes(), &bs))
			var ep extprocv3.ExternalProcessor
			typedConfig(t, dig(t, bs, "static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config", "http_filters", 0, "typed_config"),
				"envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor", &ep)
			require.True(t, proto.Equal(tc.want, ep.GetProcessingMode()), "got %v", ep.GetProcessingMode())
			require.Equal(t, tc.wantContentLength, ep.GetAllowContentLengthHeader())
		})
	}
}

// TestRenderObserver decodes the observability pass's filter: second,
// before the router, in observability_mode, failing open, shown the
// response alone, with the routing answer's metadata forwarded.
func TestRenderObserver(t *testing.T) {
	for _, tc := range []struct {
		name        string
		cfg         Config
		wantFilters []string
		wantCluster string
	}{
		{"on", Config{PdxAddress: "127.0.0.1:9002", Observer: true}, []string{"envoy.filters.http.ext_proc", "pdx.observability", "envoy.filters.http.router"}, "pdx_observability"},
		{"own server", Config{PdxAddress: "127.0.0.1:9002", Observer: true, ObserverAddress: "127.0.0.1:9100"}, []string{"envoy.filters.http.ext_proc", "pdx.observability", "envoy.filters.http.router"}, "pdx_observer"},
		{"off by default", Config{PdxAddress: "127.0.0.1:9002"}, []string{"envoy.filters.http.ext_proc", "envoy.filters.http.router"}, ""},
		{"without ext_proc", Config{PdxAddress: "127.0.0.1:9002", Observer: true, WithoutExtProc: true}, []string{"envoy.filters.http.router"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			require.NoError(t, Render(&buf, tc.cfg))
			var bs map[string]any
			require.NoError(t, yaml.Unmarshal(buf.Bytes(), &bs))
			filters := dig(t, bs, "static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config", "http_filters").([]any)
			var names []string
			for _, f := range filters {
				names = append(names, f.(map[string]any)["name"].(string))
			}
			require.Equal(t, tc.wantFilters, names)
			if tc.wantCluster == "" {
				return
			}
			var ep extprocv3.ExternalProcessor
			typedConfig(t, dig(t, bs, "static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config", "http_filters", 1, "typed_config"),
				"envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor", &ep)
			require.True(t, ep.GetObservabilityMode())
			require.True(t, ep.GetFailureModeAllow(), "the pass never fails a request")
			require.Equal(t, 5*time.Second, ep.GetDeferredCloseTimeout().AsDuration())
			require.Equal(t, tc.wantCluster, ep.GetGrpcService().GetEnvoyGrpc().GetClusterName())
			require.True(t, proto.Equal(&extprocv3.ProcessingMode{
				RequestHeaderMode: extprocv3.ProcessingMode_SKIP, RequestBodyMode: extprocv3.ProcessingMode_NONE,
				RequestTrailerMode: extprocv3.ProcessingMode_SKIP, ResponseHeaderMode: extprocv3.ProcessingMode_SEND,
				ResponseBodyMode: extprocv3.ProcessingMode_STREAMED, ResponseTrailerMode: extprocv3.ProcessingMode_SEND,
			}, ep.GetProcessingMode()), "got %v", ep.GetProcessingMode())
			require.Equal(t, []string{"pdx"}, ep.GetMetadataOptions().GetForwardingNamespaces().GetUntyped())
		})
	}
	require.ErrorContains(t, Render(io.Discard, Config{PdxAddress: "127.0.0.1:1", Observer: true, ObserverAddress: "nope"}), "observer address")
	require.ErrorContains(t, Render(io.Discard, Config{PdxAddress: "127.0.0.1:1", ObserverAddress: "127.0.0.1:2"}), "the observability pass is off")
}

// TestRenderErrorReplies checks how the bootstrap makes Envoy answer by
// itself: the ext_proc filter answers 503 when pdx fails, and every local
// reply that is not pdx's own (response code details "pdx_<code>") gets an
// OpenAI-style JSON body with its code, from LocalReplies in order. The
// typed configs are decoded as Envoy's own protos. The end-to-end tests
// check the same with a real Envoy.
func TestRenderErrorReplies(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, Render(&buf, Config{PdxAddress: "127.0.0.1:9002"}))
	var bs map[string]any
	require.NoError(t, yaml.Unmarshal(buf.Bytes(), &bs))
	hcm := dig(t, bs, "static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config").(map[string]any)

	var ep extprocv3.ExternalProcessor
	require.Equal(t, "envoy.filters.http.ext_proc", dig(t, hcm, "http_filters", 0, "name"))
	typedConfig(t, dig(t, hcm, "http_filters", 0, "typed_config"), "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor", &ep)
	require.False(t, ep.GetFailureModeAllow())
	require.EqualValues(t, 503, ep.GetStatusOnError().GetCode())

	var got []LocalReply
	mappers := dig(t, hcm, "local_reply_config", "mappers").([]any)
	require.Len(t, mappers, 2*len(LocalReplies), "each reply in Anthropic's shape, then in OpenAI's")
	for i := 0; i < len(mappers); i += 2 {
		cel := func(m map[string]any) string {
			require.Equal(t, "envoy.access_loggers.extension_filters.cel", dig(t, m, "filter", "extension_filter", "name"))
			var f celv3.ExpressionFilter
			typedConfig(t, dig(t, m, "filter", "extension_filter", "typed_config"), "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter", &f)
			require.Equal(t, "application/json", dig(t, m, "body_format_override", "content_type"))
			return f.GetExpression()
		}
		a, m := mappers[i].(map[string]any), mappers[i+1].(map[string]any)
		expr := cel(m)
		require.Equal(t, messagesOnly+" && ("+expr+")", cel(a), "the Messages API's reply first")
		require.Equal(t, "error", dig(t, a, "body_format_override", "json_format", "type"), "Anthropic's error body")
		require.Equal(t, a["status_code"], m["status_code"])
		msg := dig(t, m, "body_format_override", "json_format", "error", "message").(string)
		require.Equal(t, msg, dig(t, a, "body_format_override", "json_format", "error", "message"))
		base, ok := strings.CutSuffix(msg, " (%RESPONSE_CODE_DETAILS%)")
		require.True(t, ok, "the message names Envoy's reason: %q", msg)
		r := LocalReply{
			Expression: expr,
			Type:       dig(t, m, "body_format_override", "json_format", "error", "type").(string),
			Code:       dig(t, m, "body_format_override", "json_format", "error", "code").(string),
			Message:    base,
			Anthropic:  dig(t, a, "body_format_override", "json_format", "error", "type").(string),
		}
		if st, ok := m["status_code"]; ok {
			r.Status = int(st.(float64))
		}
		got = append(got, r)
	}
	require.Equal(t, LocalReplies, got)
	for _, r := range LocalReplies[3:] {
		require.True(t, strings.HasPrefix(r.Expression, "!response.code_details.startsWith('pdx_') && "), "pdx's answers keep their bodies: %s", r.Expression)
	}
}

// dig follows map keys and list indexes into a decoded YAML document.
func dig(t *testing.T, v any, path ...any) any {
	t.Helper()
	for _, p := range path {
		switch k := p.(type) {
		case string:
			m, ok := v.(map[string]any)
			require.True(t, ok, "%v: not a map at %q", path, k)
			require.Contains(t, m, k, "%v", path)
			v = m[k]
		case int:
			l, ok := v.([]any)
			require.True(t, ok, "%v: not a list at %d", path, k)
			require.Less(t, k, len(l), "%v", path)
			v = l[k]
		}
	}
	return v
}

// typedConfig decodes a typed_config of type typeName into msg and
// validates it with Envoy's proto constraints.
func typedConfig(t *testing.T, v any, typeName string, msg interface {
	proto.Message
	ValidateAll() error
}) {
	t.Helper()
	m := maps.Clone(v.(map[string]any))
	require.Equal(t, "type.googleapis.com/"+typeName, m["@type"])
	delete(m, "@type")
	js, err := json.Marshal(m)
	require.NoError(t, err)
	require.NoError(t, protojson.Unmarshal(js, msg))
	require.NoError(t, msg.ValidateAll())
}

// TestRenderPdxReplicas lists every pdx replica as an endpoint of the pdx
// cluster, PdxAddress first.
func TestRenderPdxReplicas(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want []string
		err  string
	}{
		{name: "one", cfg: Config{PdxAddress: "127.0.0.1:9002"}, want: []string{"127.0.0.1:9002"}},
		{name: "address and replicas", cfg: Config{PdxAddress: "127.0.0.1:9002", PdxAddresses: []string{"127.0.0.1:9003", "pdx-2:9002"}},
			want: []string{"127.0.0.1:9002", "127.0.0.1:9003", "pdx-2:9002"}},
		{name: "replicas only", cfg: Config{PdxAddresses: []string{"127.0.0.1:9003", "127.0.0.1:9004"}},
			want: []string{"127.0.0.1:9003", "127.0.0.1:9004"}},
		{name: "none", cfg: Config{}, err: "pdx address"},
		{name: "bad replica", cfg: Config{PdxAddress: "127.0.0.1:9002", PdxAddresses: []string{"nope"}}, err: "pdx address"},
		{name: "twice", cfg: Config{PdxAddress: "127.0.0.1:9002", PdxAddresses: []string{"127.0.0.1:9002"}}, err: "listed twice"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			err := Render(&buf, tc.cfg)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			var bs map[string]any
			require.NoError(t, yaml.Unmarshal(buf.Bytes(), &bs))
			cluster := dig(t, bs, "static_resources", "clusters", 0).(map[string]any)
			require.Equal(t, "pdx", cluster["name"])
			var got []string
			for i := range dig(t, cluster, "load_assignment", "endpoints", 0, "lb_endpoints").([]any) {
				sa := dig(t, cluster, "load_assignment", "endpoints", 0, "lb_endpoints", i, "endpoint", "address", "socket_address").(map[string]any)
				got = append(got, fmt.Sprintf("%s:%v", sa["address"], sa["port_value"]))
			}
			require.Equal(t, tc.want, got)
		})
	}
}
