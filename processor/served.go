package processor

import (
	"context"
	"log/slog"
	"slices"
	"strconv"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// UpstreamAddressAttribute is the Envoy attribute that names the host a
// response came from: the last attempt's, after Envoy's retries. The Envoy
// configs of the decode-fallback profile list it in the ext_proc filter's
// response_attributes.
const UpstreamAddressAttribute = "upstream.address"

// ServedKey is the key, in the MetadataNamespace filter metadata Envoy
// forwards with the response, under which a gateway reports the endpoint
// that served the request (the endpoint-picker protocol's
// x-gateway-destination-endpoint-served; override_host's
// selected_host_key writes it).
const ServedKey = "x-gateway-destination-endpoint-served"

// served notes the decode endpoint that answered a request pdx named
// fallbacks for, as Envoy tells it with the response headers: it counts
// in pdx_decode_served_total and the log; the endpoints before it in the
// request's list failed (Envoy retried past them), which the decode leg's
// passive health hears; and the request's in-flight count moves to it.
func (r *request) served(ctx context.Context, msg *extprocv3.ProcessingRequest) {
	decodes := r.placed.Decodes
	if r.pool == nil || len(decodes) == 0 {
		return
	}
	addr := servedAddress(msg)
	if addr == "" {
		return // Envoy was not asked for it, or no upstream answered
	}
	status, _ := strconv.Atoi(header(msg.GetResponseHeaders(), ":status"))
	at := slices.IndexFunc(decodes, func(ep endpoint.Endpoint) bool { return ep.Address == addr })
	if at < 0 {
		// The list is Envoy's only source of hosts (override_host): a host
		// outside it means a cluster that does not honour it.
		r.log.LogAttrs(ctx, slog.LevelWarn, "a decode endpoint pdx did not name answered",
			slog.String("served", addr), slog.String("named", r.destination(decodes[0])), slog.Int("status", status))
		return
	}
	pool := r.pool
	for _, ep := range decodes[:at] {
		pool.Decode.Report(ep, false)
	}
	if at > 0 {
		r.placed.Decode.Move(decodes[at])
	}
	if status >= 500 {
		// Every attempt failed; Envoy passes on the last one's error.
		return
	}
	r.obs.served(pool, addr, at > 0)
	level := slog.LevelDebug
	if at > 0 {
		level = slog.LevelInfo
	}
	r.log.LogAttrs(ctx, level, "decode served", slog.String("pool", pool.Name), slog.String("decode", addr),
		slog.Bool("fallback", at > 0), slog.String("first", decodes[0].Address), slog.Int("status", status))
}

// servedAddress returns the endpoint that served, as Envoy tells it with
// msg: the gateway's ServedKey metadata, else the
// UpstreamAddressAttribute; "" when it tells neither. Envoy keys the
// attributes by the filter's name.
func servedAddress(msg *extprocv3.ProcessingRequest) string {
	if v, ok := msg.GetMetadataContext().GetFilterMetadata()[MetadataNamespace].GetFields()[ServedKey]; ok {
		return v.GetStringValue()
	}
	for _, attrs := range msg.GetAttributes() {
		if v, ok := attrs.GetFields()[UpstreamAddressAttribute]; ok {
			return v.GetStringValue()
		}
	}
	return ""
}
