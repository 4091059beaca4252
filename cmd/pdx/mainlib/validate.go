package mainlib

import (
	"flag"
	"fmt"
	"io"
	"strings"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/server"
)

// validate checks a config file as serve loads it (the same messages,
// every problem at once), and builds what serve builds from it, short of
// listening and of asking Kubernetes for endpoints. It prints what it
// understood of a valid file.
func validate(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("validate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("config", "", "config file (YAML) to check")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *path == "" {
		return fmt.Errorf("%w: validate needs --config", ErrUsage)
	}
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	if _, err := routing.New(cfg); err != nil {
		return fmt.Errorf("%s: %w", *path, err)
	}
	if err := server.CheckTLS(cfg.GetTls()); err != nil {
		return fmt.Errorf("%s: %w", *path, err)
	}
	fmt.Fprintf(stdout, "%s: valid; ext_proc on %s, admin on %s\n", *path, cfg.GetGrpcAddress(), cfg.GetAdminAddress())
	for _, p := range cfg.GetPools() {
		fmt.Fprintf(stdout, "  pool %s: %s\n", p.GetName(), describePool(p))
	}
	return nil
}

// describePool says what a pool serves and with what, in a line.
func describePool(p *configv1.Pool) string {
	var parts []string
	models := strings.Join(p.GetModels(), ", ")
	switch {
	case p.GetDefault() && models == "":
		parts = append(parts, "every model")
	case p.GetDefault():
		parts = append(parts, "models "+models+" and every unlisted one")
	default:
		parts = append(parts, "models "+models)
	}
	parts = append(parts, "connector "+p.GetConnector())
	if k := p.GetKubernetes(); k != nil {
		parts = append(parts, fmt.Sprintf("endpoints from Kubernetes namespace %s (not contacted)", k.GetNamespace()))
	} else {
		parts = append(parts, fmt.Sprintf("%d prefill and %d decode endpoints", len(p.GetPrefill()), len(p.GetDecode())))
	}
	return strings.Join(parts, ", ")
}
