// Package envoy renders pdx's Envoy bootstrap: the one config that `pdx
// envoy-config` prints, docker-compose ships, and the demo and the tests
// run (through internal/testbed/envoyproc).
package envoy

import (
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"text/template"
	"time"
)

//go:embed envoy.yaml.tmpl
var bootstrapTemplate string

var bootstrap = template.Must(template.New("envoy.yaml").Option("missingkey=error").Parse(bootstrapTemplate))

// Config holds the values the bootstrap template needs.
type Config struct {
	// ListenAddress and ListenPort are where clients connect; port 0 picks a
	// free port (see Process.ListenAddr).
	ListenAddress string
	ListenPort    int
	// AdminPort is Envoy's admin port on 127.0.0.1; 0 picks a free one.
	AdminPort int
	// PdxAddress is pdx's gRPC address, "host:port" (a DNS name works).
	PdxAddress string
	// PdxAddresses are more pdx replicas, after PdxAddress (which may then
	// be empty): Envoy spreads the ext_proc streams, one per request, over
	// all of them round robin, each health-checked on its own.
	PdxAddresses []string
	// MessageTimeout bounds each ext_proc exchange, the prefill included:
	// 0 means DefaultMessageTimeout. Envoy starts no message timer for a
	// direction whose body is FULL_DUPLEX_STREAMED: with
	// BodyFullDuplexStreamed it bounds only the response headers' exchange,
	// and in ProfileAIGateway (both bodies streamed) nothing, so Render
	// refuses one there.
	MessageTimeout time.Duration
	// BufferLimitBytes is the largest request body Envoy buffers, over
	// HTTP/1 and HTTP/2 alike, and the most Envoy reads at once. Between
	// pdx's max_body_bytes (bodies up to it are pdx's to answer) and that
	// plus BufferHeadroom: pdx's gRPC messages may exceed max_body_bytes by
	// 1 MiB, and a FULL_DUPLEX_STREAMED chunk can be a buffer's worth.
	BufferLimitBytes int
	// StreamIdleTimeout ends a stream idle that long (no bytes either way):
	// 408 while the request is still coming, else 504. 0 means 300s.
	StreamIdleTimeout time.Duration
	// MaxRequestHeaders and MaxRequestHeadersKB are the listener's limits
	// on a request's headers; pdx's max_request_headers and
	// max_request_headers_kb must be the same. 0 means Envoy's defaults,
	// 100 and 60.
	MaxRequestHeaders, MaxRequestHeadersKB int
	// PdxTLS, when set, makes Envoy reach pdx over TLS.
	PdxTLS *TLS
	// RequestBodyMode is how the ext_proc filter sends the request body to
	// pdx: BodyBuffered (the default when empty) or BodyFullDuplexStreamed,
	// the mode of the Gateway API Inference Extension's InferencePool
	// integrations. pdx learns the mode from Envoy on each stream.
	RequestBodyMode string
	// Profile is the shape of the Envoy around pdx: ProfilePdx (the default
	// when empty), pdx's own, or ProfileAIGateway, what Envoy AI Gateway's
	// InferencePool translation generates for an endpoint picker.
	Profile string
	// SubsetHintHeader, when set, names a request header that a Lua filter
	// turns into the gateway's subset hint (filter metadata
	// envoy.lb.subset_hint, a list of ip:port) before pdx sees the
	// request, standing in for a gateway that restricts the endpoints.
	// Tests only: a client must never choose where its request goes.
	SubsetHintHeader string
	// DecodeCluster is the kind of the decode cluster: DecodeOriginalDst
	// (the default when empty), which connects to the one host pdx names,
	// or DecodeEDS, the decode-fallback profile: an EDS cluster that pdx
	// serves (its xds config) with the override_host load balancing
	// policy, retrying the decode on the next host pdx named.
	DecodeCluster string
	// DecodeFallbacks is how many times Envoy retries a decode in the
	// DecodeEDS profile: the most decode_fallbacks of pdx's pools (0
	// means 1). Only with DecodeEDS.
	DecodeFallbacks int
	// XDSCluster is the ClusterLoadAssignment the DecodeEDS cluster asks
	// pdx for: pdx's xds.cluster_name ("" means pdx_decode). Only with
	// DecodeEDS.
	XDSCluster string
	// Observer adds the observability pass: a second ext_proc filter, in
	// observability_mode, that shows pdx the decode's response (the TTFT
	// split, token usage; see docs/observability.md). It never holds up or
	// fails a request, but costs pdx and Envoy CPU per request (a second
	// gRPC stream; see docs/performance.md), so it is off by default.
	Observer bool
	// ObserverAddress, "host:port", sends the observability pass to another
	// ext_proc server than pdx; empty: pdx's cluster. It needs Observer.
	ObserverAddress string
	// WithoutExtProc leaves pdx out: the client's own
	// x-gateway-destination-endpoint picks the engine. Only the load
	// harness's floor, Envoy alone, uses it; it is never a deployment.
	WithoutExtProc bool
}

// TLS is how Envoy verifies pdx's certificate and authenticates itself.
type TLS struct {
	// CAFile verifies pdx's certificate, which must be valid for SNI (a DNS
	// name in its subject alternative names).
	CAFile, SNI string
	// CertFile and KeyFile are Envoy's client certificate, for a pdx that
	// requires mutual TLS; empty for TLS without client certificates.
	CertFile, KeyFile string
}

// Request body modes of Config.RequestBodyMode, named as in Envoy's
// ProcessingMode.
const (
	BodyBuffered           = "BUFFERED"
	BodyFullDuplexStreamed = "FULL_DUPLEX_STREAMED"
)

// Profiles of Config.Profile.
const (
	ProfilePdx = "pdx"
	// ProfileAIGateway is the ext_proc filter and clusters that Envoy AI
	// Gateway's extension server (internal/extensionserver,
	// inferencepool.go and post_cluster_modify.go) writes for an
	// InferencePool: every request and response phase sent to the picker,
	// both bodies FULL_DUPLEX_STREAMED, trailers sent, a 5s
	// message_timeout, fail closed, no metadata namespaces received; the
	// picker's cluster STRICT_DNS with least request, HTTP/2 over TLS
	// without certificate validation, no health check and Envoy's default
	// circuit breakers; the decode cluster ORIGINAL_DST on
	// x-gateway-destination-endpoint with a 10s connect timeout. The
	// listener stays pdx's (its JSON local replies are a listener setting,
	// not the translation's). Config.PdxTLS, MessageTimeout (but 5s) and
	// a RequestBodyMode but FULL_DUPLEX_STREAMED are refused; pdx must
	// serve TLS (tls.self_signed).
	ProfileAIGateway = "aigateway"
)

// Decode cluster kinds of Config.DecodeCluster.
const (
	DecodeOriginalDst = "original_dst"
	DecodeEDS         = "eds"
)

// BufferHeadroom is how far Envoy's buffer limit may exceed pdx's
// max_body_bytes.
const BufferHeadroom = 512 << 10

// Defaults for Config's zero fields.
const (
	DefaultMessageTimeout      = 35 * time.Second // above pdx's default prefill_timeout of 30s
	DefaultBufferLimitBytes    = 16 << 20         // pdx's default max_body_bytes
	DefaultMaxRequestHeaders   = 100              // Envoy's, and pdx's
	DefaultMaxRequestHeadersKB = 60               // Envoy's, and pdx's
	DefaultStreamIdleTimeout   = 300 * time.Second
)

type hostPort struct {
	Host string
	Port int
}

// LocalReply is how the listener answers one kind of Envoy's own local
// replies: as OpenAI-style JSON with a code, instead of Envoy's plain text
// or empty body; on Anthropic's Messages API (MessagesPath), as
// Anthropic's error body.
type LocalReply struct {
	// Expression is the CEL filter choosing the replies.
	Expression string
	// Status, when set, replaces the reply's status.
	Status int
	// Type and Code are the error's "type" and "code"; Message is its
	// "message", to which Envoy's response code details are added.
	Type, Code, Message string
	// Anthropic is the error's type in Anthropic's body
	// ({"type": "error", "error": {"type", "message"}}), which has no code.
	Anthropic string
}

// MessagesPath is where Anthropic's Messages API is served: its requests'
// local replies are Anthropic's error body (LocalReply.Anthropic).
const MessagesPath = "/v1/messages"

// messagesOnly is the CEL condition of a request on the Messages API.
const messagesOnly = "request.path.startsWith('" + MessagesPath + "')"

// notPdx matches the local replies that are not pdx's own answers, whose
// response code details start with "pdx_" and which carry their JSON body.
const notPdx = "!response.code_details.startsWith('pdx_')"

// LocalReplies are the mappers of every listener pdx ships, in order (the
// first that matches a reply shapes it), each in Anthropic's shape for the
// Messages API first, then in OpenAI's. docs/errors.md's error table
// lists them.
var LocalReplies = []LocalReply{
	// The ext_proc filter's own failures: pdx unreachable, killed,
	// draining, or silent past message_timeout.
	{Expression: "response.code_details.startsWith('ext_proc_error_per-message_timeout')", Type: "server_error", Code: "router_timeout", Anthropic: "timeout_error",
		Message: "the request router (pdx) did not answer within the ext_proc message_timeout"},
	{Expression: "response.code_details.startsWith('ext_proc_error')", Type: "server_error", Code: "router_unavailable", Anthropic: "api_error",
		Message: "the request router (pdx) is unavailable, retry later"},
	// A header mutation of pdx's that Envoy refused; pdx answers 431 to
	// requests whose headers leave no room for its own before it comes to
	// this.
	{Expression: "response.code_details.startsWith('Header_mutation')", Status: 431, Type: "invalid_request_error", Code: "headers_too_large", Anthropic: "invalid_request_error",
		Message: "the request headers leave no room for the router's own"},
	{Expression: notPdx + " && response.code == 400", Type: "invalid_request_error", Code: "bad_request", Anthropic: "invalid_request_error",
		Message: "the request is malformed"},
	{Expression: notPdx + " && response.code == 408", Type: "invalid_request_error", Code: "request_timeout", Anthropic: "invalid_request_error",
		Message: "the request did not arrive in time"},
	{Expression: notPdx + " && response.code == 413", Type: "invalid_request_error", Code: "body_too_large", Anthropic: "request_too_large",
		Message: "the request body is over the limit"},
	{Expression: notPdx + " && response.code == 426", Type: "invalid_request_error", Code: "upgrade_required", Anthropic: "invalid_request_error",
		Message: "HTTP/1.0 is not supported: use HTTP/1.1 or HTTP/2"},
	{Expression: notPdx + " && response.code == 431", Type: "invalid_request_error", Code: "headers_too_large", Anthropic: "invalid_request_error",
		Message: "the request headers are over the limit"},
	{Expression: notPdx + " && response.code == 502", Type: "server_error", Code: "engine_error", Anthropic: "api_error",
		Message: "the inference engine's answer broke off or could not be read"},
	{Expression: notPdx + " && response.code == 503", Type: "server_error", Code: "engine_unavailable", Anthropic: "api_error",
		Message: "the inference engine could not be reached"},
	{Expression: notPdx + " && response.code == 504", Type: "server_error", Code: "engine_timeout", Anthropic: "timeout_error",
		Message: "the inference engine did not answer in time"},
	{Expression: notPdx + " && response.code >= 500", Type: "server_error", Code: "gateway_error", Anthropic: "api_error",
		Message: "the gateway could not serve the request"},
	{Expression: notPdx + " && response.code >= 400", Type: "invalid_request_error", Code: "invalid_request", Anthropic: "invalid_request_error",
		Message: "the gateway refused the request"},
}

// Render writes the bootstrap for c.
func Render(w io.Writer, c Config) error {
	pdx, err := pdxEndpoints(c)
	if err != nil {
		return err
	}
	if t := c.PdxTLS; t != nil {
		if t.CAFile == "" || t.SNI == "" {
			return errors.New("pdx TLS: a CA file and an SNI name are required to verify pdx (--pdx-ca and --pdx-sni)")
		}
		if (t.CertFile == "") != (t.KeyFile == "") {
			return errors.New("pdx TLS: a client certificate needs both its cert and key file (--pdx-client-cert and --pdx-client-key)")
		}
	}
	if err := c.check(); err != nil {
		return err
	}
	if c.Profile == "" {
		c.Profile = ProfilePdx
	}
	if c.Profile == ProfileAIGateway {
		c.RequestBodyMode = BodyFullDuplexStreamed
	}
	if c.RequestBodyMode == "" {
		c.RequestBodyMode = BodyBuffered
	}
	if c.DecodeCluster == "" {
		c.DecodeCluster = DecodeOriginalDst
	}
	if c.DecodeFallbacks == 0 {
		c.DecodeFallbacks = 1
	}
	if c.XDSCluster == "" {
		c.XDSCluster = "pdx_decode"
	}
	if c.ListenAddress == "" {
		c.ListenAddress = "127.0.0.1"
	}
	if c.MessageTimeout == 0 {
		c.MessageTimeout = DefaultMessageTimeout
	}
	if c.BufferLimitBytes == 0 {
		c.BufferLimitBytes = DefaultBufferLimitBytes
	}
	if c.MaxRequestHeaders == 0 {
		c.MaxRequestHeaders = DefaultMaxRequestHeaders
	}
	if c.StreamIdleTimeout == 0 {
		c.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	if c.MaxRequestHeadersKB == 0 {
		c.MaxRequestHeadersKB = DefaultMaxRequestHeadersKB
	}
	var observer *hostPort
	if c.ObserverAddress != "" {
		hp, err := splitHostPort(c.ObserverAddress)
		if err != nil {
			return fmt.Errorf("observer address: %w", err)
		}
		observer = &hp
	}
	// The pass's streams get a cluster of their own, whose round robin is
	// not the routing streams'.
	pdxClusters, observerCluster := []string{"pdx"}, "pdx_observability"
	switch {
	case observer != nil:
		observerCluster = "pdx_observer"
	case c.Observer && !c.WithoutExtProc:
		pdxClusters = append(pdxClusters, observerCluster)
	}
	return bootstrap.Execute(w, map[string]any{
		"Observer":            c.Observer && !c.WithoutExtProc,
		"ObserverAddress":     observer,
		"ObserverCluster":     observerCluster,
		"PdxClusters":         pdxClusters,
		"ListenAddress":       c.ListenAddress,
		"ListenPort":          c.ListenPort,
		"AdminPort":           c.AdminPort,
		"Pdx":                 pdx,
		"LocalReplies":        LocalReplies,
		"MessagesOnly":        messagesOnly,
		"MessageTimeout":      seconds(c.MessageTimeout),
		"StreamIdleTimeout":   seconds(c.StreamIdleTimeout),
		"BufferLimitBytes":    c.BufferLimitBytes,
		"MaxRequestHeaders":   c.MaxRequestHeaders,
		"MaxRequestHeadersKB": c.MaxRequestHeadersKB,
		"PdxTLS":              c.PdxTLS,
		"WithoutExtProc":      c.WithoutExtProc,
		"FullDuplex":          c.RequestBodyMode == BodyFullDuplexStreamed,
		"AIGateway":           c.Profile == ProfileAIGateway,
		"SubsetHintHeader":    c.SubsetHintHeader,
		"EDS":                 c.DecodeCluster == DecodeEDS,
		"DecodeRetries":       c.DecodeFallbacks,
		"XDSCluster":          c.XDSCluster,
	})
}

// aiGatewayMessageTimeout is the message_timeout AI Gateway's translation
// writes.
const aiGatewayMessageTimeout = 5 * time.Second

// check refuses what c sets that the bootstrap would not honour: every
// field is either written as set, or refused with the reason. The flags of
// `pdx envoy-config` that set each field are named with it.
func (c Config) check() error {
	var errs []error
	fail := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	for _, p := range []struct {
		name string
		port int
	}{{"listen port (--listen-port)", c.ListenPort}, {"admin port (--admin-port)", c.AdminPort}} {
		if p.port < 0 || p.port > 65535 {
			fail("%s %d: want 0-65535 (0: any free port)", p.name, p.port)
		}
	}
	for _, n := range []struct {
		name  string
		value int
	}{
		{"buffer limit (--buffer-limit)", c.BufferLimitBytes}, {"max request headers (--max-request-headers)", c.MaxRequestHeaders},
		{"max request headers KiB (--max-request-headers-kb)", c.MaxRequestHeadersKB}, {"decode fallbacks (--decode-fallbacks)", c.DecodeFallbacks},
	} {
		if n.value < 0 {
			fail("%s %d: must not be negative", n.name, n.value)
		}
	}
	if c.MessageTimeout < 0 {
		fail("message timeout %v (--message-timeout): must not be negative", c.MessageTimeout)
	}
	if c.StreamIdleTimeout < 0 {
		fail("stream idle timeout %v: must not be negative", c.StreamIdleTimeout)
	}
	switch c.RequestBodyMode {
	case "", BodyBuffered, BodyFullDuplexStreamed:
	default:
		fail("request body mode %q (--request-body-mode): want %s or %s", c.RequestBodyMode, BodyBuffered, BodyFullDuplexStreamed)
	}
	switch c.DecodeCluster {
	case "", DecodeOriginalDst, DecodeEDS:
	default:
		fail("decode cluster %q (--decode-cluster): want %s or %s", c.DecodeCluster, DecodeOriginalDst, DecodeEDS)
	}
	if c.DecodeCluster != DecodeEDS {
		// The ORIGINAL_DST cluster connects to the one host pdx names.
		if c.DecodeFallbacks != 0 {
			fail("decode fallbacks %d (--decode-fallbacks): they are Envoy's retries over the EDS decode cluster, which needs decode cluster %s (--decode-cluster %s)",
				c.DecodeFallbacks, DecodeEDS, DecodeEDS)
		}
		if c.XDSCluster != "" {
			fail("xDS cluster %q (--xds-cluster): it names the EDS decode cluster's endpoints, which needs decode cluster %s (--decode-cluster %s)",
				c.XDSCluster, DecodeEDS, DecodeEDS)
		}
	}
	switch c.Profile {
	case "", ProfilePdx:
	case ProfileAIGateway:
		// What the translation writes, which the profile is for testing pdx behind.
		const as = "profile " + ProfileAIGateway
		if c.PdxTLS != nil {
			fail("pdx TLS (--pdx-ca, --pdx-sni, --pdx-client-cert, --pdx-client-key): %s reaches pdx over TLS without verifying it, as AI Gateway's translation does", as)
		}
		if c.DecodeCluster != "" && c.DecodeCluster != DecodeOriginalDst {
			fail("decode cluster %s (--decode-cluster): %s has AI Gateway's translation's ORIGINAL_DST cluster", c.DecodeCluster, as)
		}
		if c.Observer {
			fail("observability pass (--observer): %s has AI Gateway's translation's one ext_proc filter", as)
		}
		if c.RequestBodyMode == BodyBuffered {
			fail("request body mode %s (--request-body-mode): %s sends both bodies %s, as AI Gateway's translation does", BodyBuffered, as, BodyFullDuplexStreamed)
		}
		if c.MessageTimeout != 0 && c.MessageTimeout != aiGatewayMessageTimeout {
			// Envoy starts no message timer for a direction whose body is
			// FULL_DUPLEX_STREAMED, and here both are.
			fail("message timeout %v (--message-timeout): %s writes AI Gateway's translation's %v, which Envoy does not apply: both bodies are %s",
				c.MessageTimeout, as, aiGatewayMessageTimeout, BodyFullDuplexStreamed)
		}
	default:
		fail("profile %q (--profile): want %s or %s", c.Profile, ProfilePdx, ProfileAIGateway)
	}
	if c.ObserverAddress != "" && !c.Observer {
		fail("observer address %s (--observer-address): the observability pass is off (--observer)", c.ObserverAddress)
	}
	return errors.Join(errs...)
}

// seconds writes d as a protobuf JSON duration.
func seconds(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}

// pdxEndpoints are the pdx cluster's endpoints: PdxAddress, then
// PdxAddresses; at least one, each once.
func pdxEndpoints(c Config) ([]hostPort, error) {
	addrs := c.PdxAddresses
	if c.PdxAddress != "" || len(addrs) == 0 {
		addrs = append([]string{c.PdxAddress}, addrs...)
	}
	seen := map[string]bool{}
	out := make([]hostPort, 0, len(addrs))
	for _, a := range addrs {
		hp, err := splitHostPort(a)
		if err != nil {
			return nil, fmt.Errorf("pdx address: %w", err)
		}
		if seen[a] {
			return nil, fmt.Errorf("pdx address %s is listed twice", a)
		}
		seen[a] = true
		out = append(out, hp)
	}
	return out, nil
}

func splitHostPort(addr string) (hostPort, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return hostPort{}, err
	}
	p, err := strconv.Atoi(port)
	if err != nil || p <= 0 || p > 65535 {
		return hostPort{}, fmt.Errorf("bad port in %q", addr)
	}
	return hostPort{Host: host, Port: p}, nil
}
