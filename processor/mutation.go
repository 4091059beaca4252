package processor

import (
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/routing"
)

// DestinationHeader names the decode endpoint for Envoy's ORIGINAL_DST
// cluster (the Gateway API Inference Extension endpoint-picker convention).
const DestinationHeader = "x-gateway-destination-endpoint"

// RankHeader names the DP rank of the decode endpoint that is to serve the
// request, for vLLM engines (engines.RankHeader, as Envoy spells headers).
const RankHeader = "x-data-parallel-rank"

// MetadataNamespace carries the same endpoint as dynamic metadata.
const MetadataNamespace = "envoy.lb"

// RequestMetadataNamespace is the dynamic metadata namespace where pdx
// leaves the client's request id (key "request_id") for Envoy to put in the
// response: the request itself carries the engines' id by then.
const RequestMetadataNamespace = "pdx"

func setHeader(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: key, RawValue: []byte(value)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

// clientRoutingHeaders are removed from every request: a client never gets
// to name the destination, whatever happens next. (x-envoy-original-dst-host,
// which an ORIGINAL_DST cluster reads when it names no header, is not among
// them: Envoy refuses ext_proc mutations of x-envoy-* headers by default,
// and pdx's clusters name DestinationHeader.) Nor does a client get to pin
// an engine's DP rank: RankHeader is pdx's to set. The flow-control
// headers (flow.go) are pdx's to read, not the engines'.
var clientRoutingHeaders = []string{DestinationHeader, RankHeader,
	ObjectiveHeader, objectiveHeaderOld, FairnessHeader, fairnessHeaderOld, SLOTTFTHeader}

// routeHeaders answers the headers of a request.
func routeHeaders() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{RemoveHeaders: clientRoutingHeaders},
		}},
	}}
}

// holdResponseMode is the filter's mode plus response headers: a concurrent
// prefill's failure must be able to replace the decode's answer.
var holdResponseMode = &filterextprocv3.ProcessingMode{
	RequestHeaderMode:   filterextprocv3.ProcessingMode_SEND,
	ResponseHeaderMode:  filterextprocv3.ProcessingMode_SEND,
	RequestBodyMode:     filterextprocv3.ProcessingMode_BUFFERED,
	ResponseBodyMode:    filterextprocv3.ProcessingMode_NONE,
	RequestTrailerMode:  filterextprocv3.ProcessingMode_SKIP,
	ResponseTrailerMode: filterextprocv3.ProcessingMode_SKIP,
}

func routeHeadersHoldingResponse() *extprocv3.ProcessingResponse {
	resp := routeHeaders()
	resp.ModeOverride = holdResponseMode
	return resp
}

// passThroughMode asks Envoy to send nothing more of a request that pdx has
// routed at its headers (honoured when the filter sets allow_mode_override).
var passThroughMode = &filterextprocv3.ProcessingMode{
	RequestHeaderMode:   filterextprocv3.ProcessingMode_SEND,
	ResponseHeaderMode:  filterextprocv3.ProcessingMode_SKIP,
	RequestBodyMode:     filterextprocv3.ProcessingMode_NONE,
	ResponseBodyMode:    filterextprocv3.ProcessingMode_NONE,
	RequestTrailerMode:  filterextprocv3.ProcessingMode_SKIP,
	ResponseTrailerMode: filterextprocv3.ProcessingMode_SKIP,
}

// decision is what the phase handlers decided for a request pdx sends on:
// answer turns it into Envoy's answer.
type decision struct {
	decode endpoint.Endpoint
	// rank is the decode endpoint's DP rank that RankHeader names; none
	// sends no header.
	rank endpoint.Rank
	// body is the decode request's body; unchanged marks the client's own,
	// which is not sent back: Envoy keeps the one it holds, and neither
	// side copies a prompt for nothing.
	body      []byte
	unchanged bool
	// atHeaders: a request without a body, routed at its headers.
	atHeaders bool
	// pool is the pool of a routed generation request, which the
	// observability pass is told of (observer.go); nil on pass-through paths.
	pool *routing.Pool
}

// answer is the one builder of pdx's routing answers. The request goes to
// the decision's endpoint (as header and as metadata) with the engines'
// request id, the request's trace context and, with a body, its
// content-length (Envoy does not recompute it in BUFFERED mode). The answer
// is to the body in BUFFERED mode; to the headers, which Envoy is still
// waiting for, in FULL_DUPLEX_STREAMED mode and for a request without a
// body.
func (r *request) answer(d decision) *extprocv3.ProcessingResponse {
	set := make([]*corev3.HeaderValueOption, 0, 4+len(r.trace.headers))
	destination := r.destination(d.decode)
	set = append(set, setHeader(DestinationHeader, destination))
	if rank, ok := d.rank.Get(); ok {
		set = append(set, setHeader(RankHeader, strconv.Itoa(rank)))
	}
	if !d.atHeaders {
		set = append(set, setHeader("content-length", strconv.Itoa(len(d.body))))
	}
	set = append(set, setHeader("x-request-id", r.id))
	for _, h := range r.trace.headers {
		set = append(set, setHeader(h.name, h.value))
	}
	r.obs.routed(d.decode)
	metadata := endpointMetadata(destination, r.clientID)
	if d.pool != nil && r.observed {
		r.handOff(metadata, d.pool)
	}
	if !d.atHeaders && !r.duplex() {
		resp := &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
		if !d.unchanged {
			resp.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: d.body}}
		}
		return &extprocv3.ProcessingResponse{
			Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: resp}},
			DynamicMetadata: metadata,
		}
	}
	headers := &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				// Envoy applies the removals first: the destination set
				// here is pdx's, whatever the client sent.
				RemoveHeaders: clientRoutingHeaders,
				SetHeaders:    set,
			}},
		}},
		DynamicMetadata: metadata,
	}
	if d.atHeaders {
		headers.ModeOverride = passThroughMode
		return headers
	}
	// FULL_DUPLEX_STREAMED: the decode body follows in chunks and, if the
	// client sent trailers, the answer to them: Envoy requires headers,
	// body, trailers in that order.
	r.body.queued = streamedRequestBody(d.body, !r.body.trailers)
	if r.body.trailers {
		r.body.queued = append(r.body.queued, continueRequestTrailers())
	}
	return headers
}

// destination is the value of DestinationHeader for a request whose decode
// endpoint is decode: its address, then those of the request's fallbacks,
// comma-separated (the override_host load balancing policy's list: each
// attempt of Envoy's takes the next).
func (r *request) destination(decode endpoint.Endpoint) string {
	if len(r.placed.Decodes) < 2 || r.placed.Decodes[0] != decode {
		return decode.Address
	}
	n := len(r.placed.Decodes) - 1
	for _, ep := range r.placed.Decodes {
		n += len(ep.Address)
	}
	var b strings.Builder
	b.Grow(n)
	for i, ep := range r.placed.Decodes {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(ep.Address)
	}
	return b.String()
}

// endpointMetadata names the decode endpoints (destination) in Envoy's
// dynamic metadata, and the client's request id.
func endpointMetadata(destination, clientID string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		MetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(destination),
		}}),
		RequestMetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			"request_id": structpb.NewStringValue(clientID),
		}}),
	}}
}

func continueRequestBody() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
}

func continueRequestTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
}

// responseHeaders passes the response's headers on with the client's
// request id: the request carried the engines' by then, and engines echo
// it. (pdx's own Envoy config also sets it from pdx's metadata; an
// InferencePool gateway receives no metadata from its picker.)
func (r *request) responseHeaders() *extprocv3.ProcessingResponse {
	resp := &extprocv3.HeadersResponse{}
	if r.clientID != "" {
		resp.Response = &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
			SetHeaders: []*corev3.HeaderValueOption{setHeader("x-request-id", r.clientID)},
		}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: resp}}
}

func continueResponseBody() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
}

func continueResponseTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
}
