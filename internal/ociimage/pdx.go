package ociimage

import (
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Repository is pdx's image reference without its tag: the project's own,
// which deploy/kubernetes and the Helm chart name (with the chart's
// appVersion as the tag) and `make image` builds.
const Repository = "ghcr.io/pdx-router/pdx"

// Source is the project's repository, for the image's labels.
const Source = "https://github.com/pdx-router/pdx"

// The image's run configuration, as the repository's Dockerfile has it:
// pdx serving the config at ConfigPath, as the nonroot user.
const ConfigPath = "/etc/pdx/pdx.yaml"

var (
	// Entrypoint and Cmd run pdx serve with the config at ConfigPath.
	Entrypoint = []string{"/pdx"}
	Cmd        = []string{"serve", "--config", ConfigPath}
	// Ports are pdx's: 9002 ext_proc gRPC, 9003 admin (/metrics,
	// /healthz, /readyz).
	Ports = []string{"9002/tcp", "9003/tcp"}
)

// Pdx is the Spec of pdx's image, as the Dockerfile builds it: pdx and the
// engine simulator (docker-compose runs the image as either), the example
// config at ConfigPath, the nonroot user; labelled with the OCI
// annotations of its version and of the commit (revision; "" leaves the
// label out) it was built from. dir is the module's root.
func Pdx(dir, version, revision string, created time.Time, platforms []v1.Platform) Spec {
	labels := map[string]string{
		"org.opencontainers.image.title":         "pdx",
		"org.opencontainers.image.description":   "A prefill/decode disaggregated router for LLM inference: an Envoy external-processing (ext_proc) service",
		"org.opencontainers.image.version":       version,
		"org.opencontainers.image.created":       created.UTC().Format(time.RFC3339),
		"org.opencontainers.image.source":        Source,
		"org.opencontainers.image.url":           Source,
		"org.opencontainers.image.documentation": Source + "/blob/main/docs/kubernetes.md",
	}
	if revision != "" {
		labels["org.opencontainers.image.revision"] = revision
	}
	ports := map[string]struct{}{}
	for _, p := range Ports {
		ports[p] = struct{}{}
	}
	return Spec{
		Dir: dir,
		Binaries: []Binary{
			{Path: "/pdx", Package: "./cmd/pdx", Tags: "vtprotobuf"},
			{Path: "/pdx-engine-sim", Package: "./cmd/pdx-engine-sim"},
		},
		Files:     []File{{Path: ConfigPath, Source: "deploy/pdx.yaml"}},
		Platforms: platforms,
		Created:   created,
		Config: v1.Config{
			User:         "65532:65532",
			WorkingDir:   "/home/nonroot",
			Entrypoint:   Entrypoint,
			Cmd:          Cmd,
			ExposedPorts: ports,
			Env: []string{
				"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
				"SSL_CERT_FILE=" + CACertificates,
			},
			Labels: labels,
		},
	}
}
