package processor

import (
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The gateway's subset hint (the endpoint-picker protocol): filter
// metadata in the request's metadata_context listing the "ip:port"
// endpoints the gateway can send this request to. A filter forwards it
// with metadata_options.forwarding_namespaces.
const (
	SubsetHintNamespace = "envoy.lb.subset_hint"
	SubsetHintKey       = "x-gateway-destination-endpoint-subset"
)

// subsetHint reads the subset hint of a request: nil when the gateway gave
// none (any endpoint), else the endpoints, which may be none. A hint that
// is not a list of strings is an error: picking outside what the gateway
// meant would send the request where it cannot go.
func subsetHint(md *corev3.Metadata) ([]string, error) {
	ns, ok := md.GetFilterMetadata()[SubsetHintNamespace]
	if !ok {
		return nil, nil
	}
	v, ok := ns.GetFields()[SubsetHintKey]
	if !ok {
		return nil, nil
	}
	list, ok := v.GetKind().(*structpb.Value_ListValue)
	if !ok {
		return nil, fmt.Errorf("%w: the gateway's subset hint %s is not a list", errNoEndpoint, SubsetHintKey)
	}
	out := make([]string, 0, len(list.ListValue.GetValues()))
	for _, e := range list.ListValue.GetValues() {
		s, ok := e.GetKind().(*structpb.Value_StringValue)
		if !ok {
			return nil, fmt.Errorf("%w: the gateway's subset hint %s holds a value that is not an ip:port string", errNoEndpoint, SubsetHintKey)
		}
		out = append(out, s.StringValue)
	}
	return out, nil
}
