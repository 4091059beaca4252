package server

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// tlsConfig loads the listener's TLS settings; nil means plaintext.
func tlsConfig(c *configv1.TLS) (*tls.Config, error) {
	if c == nil {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(c.GetCertFile(), c.GetKeyFile())
	if err != nil {
		return nil, fmt.Errorf("tls: loading cert_file %s and key_file %s: %w", c.GetCertFile(), c.GetKeyFile(), err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if ca := c.GetClientCaFile(); ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("tls: client_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("tls: client_ca_file %s holds no PEM certificate", ca)
		}
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}
