package stack

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI is a throwaway certificate authority with a server certificate for
// pdx and a client certificate for Envoy, written as PEM files.
type PKI struct {
	CAFile                    string
	ServerCertFile, ServerKey string
	ClientCertFile, ClientKey string
	// ServerName is the DNS name the server certificate is valid for.
	ServerName string
}

// NewPKI writes a fresh PKI into dir.
func NewPKI(dir string) (*PKI, error) {
	p := &PKI{ServerName: "pdx.local"}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "pdx test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}
	if p.CAFile, err = writePEM(dir, "ca.pem", "CERTIFICATE", caDER); err != nil {
		return nil, err
	}
	leaf := func(name string, serial int64, usage x509.ExtKeyUsage, dns []string, ips []net.IP) (certFile, keyFile string, err error) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return "", "", err
		}
		der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      pkix.Name{CommonName: name},
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			DNSNames:     dns,
			IPAddresses:  ips,
		}, ca, &key.PublicKey, caKey)
		if err != nil {
			return "", "", err
		}
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return "", "", err
		}
		if certFile, err = writePEM(dir, name+".pem", "CERTIFICATE", der); err != nil {
			return "", "", err
		}
		keyFile, err = writePEM(dir, name+"-key.pem", "EC PRIVATE KEY", keyDER)
		return certFile, keyFile, err
	}
	if p.ServerCertFile, p.ServerKey, err = leaf("pdx", 2, x509.ExtKeyUsageServerAuth, []string{p.ServerName}, []net.IP{net.IPv4(127, 0, 0, 1)}); err != nil {
		return nil, err
	}
	if p.ClientCertFile, p.ClientKey, err = leaf("envoy", 3, x509.ExtKeyUsageClientAuth, []string{"envoy.local"}, nil); err != nil {
		return nil, err
	}
	return p, nil
}

func writePEM(dir, name, typ string, der []byte) (string, error) {
	path := filepath.Join(dir, name)
	return path, os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}
