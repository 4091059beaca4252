package ociimage

import (
	"bytes"
	"encoding/pem"

	"golang.org/x/crypto/x509roots/fallback/bundle"
)

// The nonroot user and group of distroless images, which pdx's manifests
// run as (runAsUser: 65532).
const (
	NonrootUID = 65532
	NonrootGID = 65532
)

// CACertificates is where Go (and OpenSSL) find the system's trusted
// roots on Linux.
const CACertificates = "/etc/ssl/certs/ca-certificates.crt"

// baseFiles are the files of the scratch base: what a static Go binary
// running as a non-root user needs from a filesystem, the subset of
// distroless/static that pdx uses. /etc/passwd and /etc/group name root,
// nobody and nonroot (65532), whose home /home/nonroot is its own; the CA
// certificates are Mozilla's NSS roots as golang.org/x/crypto's
// x509roots/fallback bundle carries them (pinned by go.mod), for pdx's TLS
// clients (OTLP exporters, engines behind https); nsswitch.conf makes the
// resolver read /etc/hosts before DNS; /tmp is writable by all. No time
// zone data: pdx loads no zone, and without /etc/localtime it logs in UTC.
func baseFiles() []entry {
	return []entry{
		{name: "/etc/passwd", mode: 0o644, data: []byte(
			"root:x:0:0:root:/root:/sbin/nologin\n" +
				"nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n" +
				"nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")},
		{name: "/etc/group", mode: 0o644, data: []byte("root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n")},
		{name: "/etc/nsswitch.conf", mode: 0o644, data: []byte("hosts: files dns\n")},
		{name: CACertificates, mode: 0o644, data: caCertificates()},
		{name: "/home/nonroot/", mode: 0o700, uid: NonrootUID, gid: NonrootGID},
		{name: "/tmp/", mode: 0o1777},
	}
}

// caCertificates is the PEM bundle of the roots without constraints. A
// root NSS distrusts after a date has a constraint a PEM file cannot
// carry: left out, as a system bundle that honours the distrust would.
func caCertificates() []byte {
	var b bytes.Buffer
	for r := range bundle.Roots() {
		if r.Constraint != nil {
			continue
		}
		_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: r.Certificate})
	}
	return b.Bytes()
}
