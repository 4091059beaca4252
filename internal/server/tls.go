package server

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"os"
	"time"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
)

// CheckTLS loads the listener's TLS settings and files as Start does,
// without listening: what `pdx validate` checks beyond the config itself.
func CheckTLS(c *configv1.TLS) error {
	_, err := tlsConfig(c, &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	return err
}

// tlsConfig loads the listener's TLS settings; nil means plaintext. addr
// is the listener's address, which a self-signed certificate names.
func tlsConfig(c *configv1.TLS, addr net.Addr) (*tls.Config, error) {
	if c == nil {
		return nil, nil
	}
	var cert tls.Certificate
	var err error
	if c.GetSelfSigned() {
		cert, err = selfSigned(addr, time.Now())
	} else {
		cert, err = tls.LoadX509KeyPair(c.GetCertFile(), c.GetKeyFile())
		if err != nil {
			err = fmt.Errorf("tls: loading cert_file %s and key_file %s: %w", c.GetCertFile(), c.GetKeyFile(), err)
		}
	}
	if err != nil {
		return nil, err
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

// selfSigned makes the certificate of tls.self_signed: the gateway
// encrypts but does not verify, so it only has to be well formed. It names
// what a client might dial: localhost, the host name and the listener's IP.
func selfSigned(addr net.Addr, now time.Time) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("tls: self-signed key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("tls: self-signed serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "pdx", Organization: []string{"pdx (self-signed)"}},
		NotBefore:    now.Add(-time.Hour), // clock skew
		NotAfter:     now.AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	if host, err := os.Hostname(); err == nil && host != "" {
		tmpl.DNSNames = append(tmpl.DNSNames, host)
	}
	if ta, ok := addr.(*net.TCPAddr); ok && !ta.IP.IsUnspecified() && !ta.IP.IsLoopback() {
		tmpl.IPAddresses = append(tmpl.IPAddresses, ta.IP)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("tls: self-signed certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}
