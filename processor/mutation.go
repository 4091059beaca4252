package processor

import (
	"strconv"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// DestinationHeader names the decode endpoint for Envoy's ORIGINAL_DST
// cluster (the Gateway API Inference Extension endpoint-picker convention).
const DestinationHeader = "x-gateway-destination-endpoint"

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
// and pdx's clusters name DestinationHeader.)
var clientRoutingHeaders = []string{DestinationHeader}

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

// passThroughHeaders routes a request without a body at its headers.
func passThroughHeaders(decode endpoint.Endpoint, requestID, clientID string) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{
				RemoveHeaders: clientRoutingHeaders,
				SetHeaders: []*corev3.HeaderValueOption{
					setHeader(DestinationHeader, decode.Address),
					setHeader("x-request-id", requestID),
				},
			}},
		}},
		DynamicMetadata: endpointMetadata(decode, clientID),
		ModeOverride:    passThroughMode,
	}
}

// decodeMutation turns the request into the decode request: new body and
// content-length (Envoy does not recompute it in BUFFERED mode), the decode
// endpoint as header and as metadata, and the request id both legs share.
// A body unchanged from the client's is not sent back: Envoy keeps the one
// it holds, and neither side copies a prompt for nothing.
func decodeMutation(body []byte, unchanged bool, decode endpoint.Endpoint, requestID, clientID string) *extprocv3.ProcessingResponse {
	resp := &extprocv3.CommonResponse{
		HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: decodeHeaders(body, decode, requestID)},
	}
	if !unchanged {
		resp.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
	}
	return &extprocv3.ProcessingResponse{
		Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: resp}},
		DynamicMetadata: endpointMetadata(decode, clientID),
	}
}

// decodeHeaders are the headers pdx sets on the decode request.
func decodeHeaders(body []byte, decode endpoint.Endpoint, requestID string) []*corev3.HeaderValueOption {
	return []*corev3.HeaderValueOption{
		setHeader(DestinationHeader, decode.Address),
		setHeader("content-length", strconv.Itoa(len(body))),
		setHeader("x-request-id", requestID),
	}
}

// endpointMetadata names the decode endpoint in Envoy's dynamic metadata,
// and the client's request id.
func endpointMetadata(decode endpoint.Endpoint, clientID string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		MetadataNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(decode.Address),
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

func continueResponseHeaders() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
}

func continueResponseBody() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
}

func continueResponseTrailers() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}
}
