package ociimage_test

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/ociimage"
)

// root is the module's root.
const root = "../.."

var (
	created = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	host    = v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
)

// file is an entry of an image's filesystem.
type file struct {
	hdr  tar.Header
	data []byte
}

// filesystem flattens img's layers.
func filesystem(t *testing.T, img v1.Image) map[string]file {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	out := map[string]file{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		require.NoError(t, err)
		data, err := io.ReadAll(tr)
		require.NoError(t, err)
		out["/"+strings.TrimSuffix(h.Name, "/")] = file{hdr: *h, data: data}
	}
}

// archive writes res as `pdx-image build` does and returns the file.
func archive(t *testing.T, res ociimage.Result, ref name.Tag) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "image.tar")
	f, err := os.Create(path)
	require.NoError(t, err)
	require.NoError(t, ociimage.WriteArchive(f, res, ref, created))
	require.NoError(t, f.Close())
	return path
}

func sum(t *testing.T, path string) [32]byte {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	return sha256.Sum256(data)
}

// registryServer is a registry on loopback (go-containerregistry's, in
// this process).
func registryServer(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// TestPdxImage builds pdx's image as `make image` does, for this
// machine's platform, and checks it as a container runtime and a registry
// would read it: the archive's OCI layout and Docker manifest both name a
// valid image, its config runs /pdx serve as the nonroot user with pdx's
// ports and OCI labels, its files are there (the binaries executable; the
// pdx binary answers --help), every timestamp is the creation time, a
// second build gives the same bytes and a registry the same digest.
func TestPdxImage(t *testing.T) {
	ref, err := name.NewTag(ociimage.Repository + ":0.1.0-test")
	require.NoError(t, err)
	spec := ociimage.Pdx(root, "0.1.0-test", "0123456789abcdef", created, []v1.Platform{host})
	res, err := ociimage.Build(t.Context(), spec)
	require.NoError(t, err)
	require.Len(t, res.Images, 1)
	require.Nil(t, res.Index, "one platform: an image, not an index")
	digest, err := res.Digest()
	require.NoError(t, err)
	path := archive(t, res, ref)

	// The OCI layout: index.json names the image by ref.
	idx, err := ociimage.Unpack(path, t.TempDir())
	require.NoError(t, err)
	require.NoError(t, validate.Index(idx))
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, 1)
	require.Equal(t, digest, im.Manifests[0].Digest)
	require.Equal(t, types.OCIManifestSchema1, im.Manifests[0].MediaType)
	require.Equal(t, ref.String(), im.Manifests[0].Annotations["io.containerd.image.name"])
	require.Equal(t, "0.1.0-test", im.Manifests[0].Annotations["org.opencontainers.image.ref.name"])
	img, err := idx.Image(digest)
	require.NoError(t, err)
	require.NoError(t, validate.Image(img))

	// Docker's manifest.json names the same config and layers, by tag.
	dockerImg, err := tarball.ImageFromPath(path, &ref)
	require.NoError(t, err)
	cfgDigest, err := img.ConfigName()
	require.NoError(t, err)
	dockerCfg, err := dockerImg.ConfigName()
	require.NoError(t, err)
	require.Equal(t, cfgDigest, dockerCfg)
	layers, err := img.Layers()
	require.NoError(t, err)
	dockerLayers, err := dockerImg.Layers()
	require.NoError(t, err)
	require.Len(t, dockerLayers, len(layers))
	for i := range layers {
		want, err := layers[i].Digest()
		require.NoError(t, err)
		got, err := dockerLayers[i].Digest()
		require.NoError(t, err)
		require.Equal(t, want, got)
	}

	// The config.
	cf, err := img.ConfigFile()
	require.NoError(t, err)
	require.Equal(t, host.OS, cf.OS)
	require.Equal(t, host.Architecture, cf.Architecture)
	require.Equal(t, created, cf.Created.Time)
	c := cf.Config
	require.Equal(t, "65532:65532", c.User, "distroless's nonroot, as the manifests' runAsUser")
	require.Equal(t, []string{"/pdx"}, c.Entrypoint)
	require.Equal(t, []string{"serve", "--config", "/etc/pdx/pdx.yaml"}, c.Cmd)
	require.Equal(t, map[string]struct{}{"9002/tcp": {}, "9003/tcp": {}}, c.ExposedPorts)
	require.Contains(t, c.Env, "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt")
	for k, v := range map[string]string{
		"org.opencontainers.image.title":    "pdx",
		"org.opencontainers.image.version":  "0.1.0-test",
		"org.opencontainers.image.revision": "0123456789abcdef",
		"org.opencontainers.image.created":  "2026-12-01T12:00:00Z",
		"org.opencontainers.image.source":   "https://github.com/pdx-router/pdx",
	} {
		require.Equal(t, v, c.Labels[k], "label %s", k)
	}
	for _, h := range cf.History {
		require.Equal(t, created, h.Created.Time)
	}

	// The files.
	fs := filesystem(t, img)
	for name, f := range fs {
		require.Equal(t, created, f.hdr.ModTime.UTC(), "%s's mtime", name)
	}
	for _, bin := range []string{"/pdx", "/pdx-engine-sim"} {
		f, ok := fs[bin]
		require.True(t, ok, "%s is in the image", bin)
		require.Equal(t, byte(tar.TypeReg), f.hdr.Typeflag)
		require.EqualValues(t, 0o755, f.hdr.Mode, "%s is executable by the nonroot user", bin)
		require.Equal(t, "\x7fELF", string(f.data[:4]), "%s is an executable", bin)
	}
	pdxYAML, err := os.ReadFile(filepath.Join(root, "deploy", "pdx.yaml"))
	require.NoError(t, err)
	require.Equal(t, pdxYAML, fs["/etc/pdx/pdx.yaml"].data)
	require.Contains(t, string(fs["/etc/passwd"].data), "nonroot:x:65532:65532:nonroot:/home/nonroot:")
	require.Contains(t, string(fs["/etc/group"].data), "nonroot:x:65532:")
	home := fs["/home/nonroot"]
	require.Equal(t, byte(tar.TypeDir), home.hdr.Typeflag)
	require.Equal(t, 65532, home.hdr.Uid)
	require.EqualValues(t, 0o1777, fs["/tmp"].hdr.Mode)
	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(fs["/etc/ssl/certs/ca-certificates.crt"].data))
	require.Greater(t, len(fs["/etc/ssl/certs/ca-certificates.crt"].data), 100_000, "Mozilla's roots")

	// The entrypoint runs (this machine's platform): extracted, as a
	// runtime would exec it.
	bin := filepath.Join(t.TempDir(), "pdx")
	require.NoError(t, os.WriteFile(bin, fs["/pdx"].data, 0o755))
	out, err := exec.CommandContext(t.Context(), bin, "--help").CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "serve")

	// Reproducible: the same sources and time give the same archive
	// (TestReproducible shows the comparison fails on another time).
	again, err := ociimage.Build(t.Context(), spec)
	require.NoError(t, err)
	againDigest, err := again.Digest()
	require.NoError(t, err)
	require.Equal(t, digest, againDigest)
	require.Equal(t, sum(t, path), sum(t, archive(t, again, ref)))

	// A registry takes it and gives it back by the same digest.
	pushed, err := name.ParseReference(registryServer(t) + "/pdx:0.1.0-test")
	require.NoError(t, err)
	got, err := ociimage.Push(t.Context(), path, pushed)
	require.NoError(t, err)
	require.Equal(t, digest, got)
	pulled, err := remote.Image(pushed, remote.WithContext(t.Context()))
	require.NoError(t, err)
	pulledDigest, err := pulled.Digest()
	require.NoError(t, err)
	require.Equal(t, digest, pulledDigest)
}

// hello is a Spec of the small test binary for platforms, bases and
// image indexes.
func hello(platforms ...v1.Platform) ociimage.Spec {
	return ociimage.Spec{
		Dir:       root,
		Binaries:  []ociimage.Binary{{Path: "/hello", Package: "./internal/ociimage/testdata/hello"}},
		Platforms: platforms,
		Created:   created,
		Config: v1.Config{
			User: "65532:65532", Entrypoint: []string{"/hello"},
			Env:    []string{"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"},
			Labels: map[string]string{"org.opencontainers.image.title": "hello"},
		},
	}
}

// TestIndexOnBase builds for two platforms on a base image pulled from a
// registry: each platform's image is the base's image of that platform
// with the binary on top, the base's config kept where the Spec sets
// nothing, and the archive names the index, which a registry takes whole.
func TestIndexOnBase(t *testing.T) {
	reg := registryServer(t)
	amd64 := v1.Platform{OS: "linux", Architecture: "amd64"}
	arm64 := v1.Platform{OS: "linux", Architecture: "arm64"}

	// The base: an index of one image per platform, each with a file
	// naming its platform, an environment variable and a user of its own.
	base := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range []v1.Platform{amd64, arm64} {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		data := []byte(p.Architecture + "\n")
		require.NoError(t, tw.WriteHeader(&tar.Header{Name: "etc/base-platform", Mode: 0o644, Size: int64(len(data)), ModTime: created}))
		_, err := tw.Write(data)
		require.NoError(t, err)
		require.NoError(t, tw.Close())
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf.Bytes())), nil },
			tarball.WithMediaType(types.OCILayer))
		require.NoError(t, err)
		img, err := mutate.Append(mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON),
			mutate.Addendum{Layer: l})
		require.NoError(t, err)
		cf, err := img.ConfigFile()
		require.NoError(t, err)
		cf = cf.DeepCopy()
		cf.OS, cf.Architecture = p.OS, p.Architecture
		cf.Config = v1.Config{User: "1000", Env: []string{"FROM_BASE=yes"}, Labels: map[string]string{"from.base": "yes"}}
		img, err = mutate.ConfigFile(img, cf)
		require.NoError(t, err)
		base = mutate.AppendManifests(base, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
	}
	baseRef, err := name.ParseReference(reg + "/base:1")
	require.NoError(t, err)
	require.NoError(t, remote.WriteIndex(baseRef, base, remote.WithContext(t.Context())))

	spec := hello(amd64, arm64)
	spec.Base = baseRef.String()
	res, err := ociimage.Build(t.Context(), spec)
	require.NoError(t, err)
	require.NotNil(t, res.Index, "two platforms: an index")
	for i, p := range []v1.Platform{amd64, arm64} {
		img := res.Images[i]
		cf, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, p.Architecture, cf.Architecture)
		require.Equal(t, "65532:65532", cf.Config.User, "the Spec's user over the base's")
		require.ElementsMatch(t, []string{"FROM_BASE=yes", "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt"}, cf.Config.Env)
		require.Equal(t, "yes", cf.Config.Labels["from.base"])
		require.Equal(t, baseRef.Name(), cf.Config.Labels["org.opencontainers.image.base.name"])
		require.Len(t, cf.History, 2, "the base's layer and the binary's")
		fs := filesystem(t, img)
		require.Equal(t, p.Architecture+"\n", string(fs["/etc/base-platform"].data), "the base's image of the platform")
		require.Equal(t, "\x7fELF", string(fs["/hello"].data[:4]))
		require.NotContains(t, fs, "/etc/passwd", "the base's files, not the scratch base's")
	}

	ref, err := name.NewTag(reg + "/hello:1")
	require.NoError(t, err)
	path := archive(t, res, ref)
	idx, err := ociimage.Unpack(path, t.TempDir())
	require.NoError(t, err)
	require.NoError(t, validate.Index(idx))
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, 1)
	require.Equal(t, types.OCIImageIndex, im.Manifests[0].MediaType, "index.json names the index")
	indexDigest, err := res.Digest()
	require.NoError(t, err)
	require.Equal(t, indexDigest, im.Manifests[0].Digest)
	var names []string
	tf, err := os.Open(path)
	require.NoError(t, err)
	defer tf.Close()
	for tr := tar.NewReader(tf); ; {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		names = append(names, h.Name)
	}
	require.NotContains(t, names, "manifest.json", "Docker's format has no index")

	got, err := ociimage.Push(t.Context(), path, ref)
	require.NoError(t, err)
	require.Equal(t, indexDigest, got)
	pulled, err := remote.Index(ref, remote.WithContext(t.Context()))
	require.NoError(t, err)
	pm, err := pulled.IndexManifest()
	require.NoError(t, err)
	require.Len(t, pm.Manifests, 2)
	for i, p := range []v1.Platform{amd64, arm64} {
		require.Equal(t, p.Architecture, pm.Manifests[i].Platform.Architecture)
	}
}

// TestReproducible: a build's digest follows its inputs: the same Spec
// twice gives the same image, one second later another.
func TestReproducible(t *testing.T) {
	digest := func(s ociimage.Spec) v1.Hash {
		res, err := ociimage.Build(t.Context(), s)
		require.NoError(t, err)
		d, err := res.Digest()
		require.NoError(t, err)
		return d
	}
	spec := hello(host)
	first := digest(spec)
	require.Equal(t, first, digest(spec))
	spec.Created = spec.Created.Add(time.Second)
	require.NotEqual(t, first, digest(spec))
}

// TestBuildRefuses: what Build cannot do, it says.
func TestBuildRefuses(t *testing.T) {
	spec := hello(host)
	spec.Created = time.Time{}
	_, err := ociimage.Build(t.Context(), spec)
	require.ErrorContains(t, err, "SOURCE_DATE_EPOCH")

	spec = hello()
	_, err = ociimage.Build(t.Context(), spec)
	require.ErrorContains(t, err, "no platform")

	spec = hello(host)
	spec.Binaries[0].Package = "./internal/ociimage/testdata/nothing"
	_, err = ociimage.Build(t.Context(), spec)
	require.ErrorContains(t, err, "testdata/nothing")
}
