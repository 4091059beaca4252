// Package tracing sets up OpenTelemetry tracing for pdx serve from the
// standard OTEL_* environment variables.
package tracing

import (
	"context"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Enabled reports whether the environment asks for traces: an OTLP endpoint
// is set (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
// and neither OTEL_SDK_DISABLED=true nor OTEL_TRACES_EXPORTER=none says no.
func Enabled(getenv func(string) string) bool {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") || strings.EqualFold(getenv("OTEL_TRACES_EXPORTER"), "none") {
		return false
	}
	return getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// FromEnv returns a tracer provider exporting over OTLP/gRPC, configured by
// the OTEL_* variables (endpoint, headers, TLS, timeout, sampler, service
// name and resource attributes), or nil when tracing is off (see Enabled).
// The caller shuts the provider down, which flushes the last spans.
func FromEnv(ctx context.Context) (*sdktrace.TracerProvider, error) {
	if !Enabled(os.Getenv) {
		return nil, nil
	}
	exp, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter: %w", err)
	}
	// service.name defaults to pdx; OTEL_SERVICE_NAME and
	// OTEL_RESOURCE_ATTRIBUTES, read later, override it.
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", "pdx")),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv())
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	// The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based,
	// always on), batch sizes from OTEL_BSP_*.
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
}
