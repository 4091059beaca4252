// Package ociimage builds pdx's container image without a container
// engine. It compiles the binaries with `go build` for each platform, puts
// them in an image layer on top of a base layer that holds what a static
// Go binary needs from a filesystem (or on top of a base image pulled from
// a registry), and writes the image as an OCI image layout in a tar
// archive, which docker load, podman load, skopeo and crane read (see
// WriteArchive). Every timestamp is the Spec's creation time and every
// file list is sorted, so the same sources, Go toolchain and creation time
// give the same image digest.
package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Binary is a Go main package built into the image.
type Binary struct {
	// Path is the binary's path in the image, e.g. "/pdx".
	Path string
	// Package is the main package, relative to Spec.Dir: "./cmd/pdx".
	Package string
	// Tags are its build tags, comma-separated.
	Tags string
}

// File is a file of the module copied into the image.
type File struct {
	// Path is its path in the image; Source its path relative to Spec.Dir.
	Path, Source string
}

// Spec says what to build.
type Spec struct {
	// Dir is the module's root, where `go build` runs.
	Dir string
	// Binaries are built for each platform, statically (CGO_ENABLED=0),
	// with -trimpath and without symbol tables, owned by root and
	// executable by all.
	Binaries []Binary
	// Files are copied as they are, owned by root and readable by all.
	Files []File
	// Platforms are the OS and architecture of each image; more than one
	// makes an image index.
	Platforms []v1.Platform
	// Base is the image the binaries go on: "" is none (scratch with
	// baseFiles), else a reference pulled from its registry for each
	// platform, e.g. gcr.io/distroless/static-debian12:nonroot.
	Base string
	// Created is the images' creation time and every file's modification
	// time: SOURCE_DATE_EPOCH, for reproducible builds.
	Created time.Time
	// Config is the images' run configuration (user, entrypoint, command,
	// ports, environment, labels); a base image's is kept where it sets
	// nothing.
	Config v1.Config
	// Log receives progress; default discarded.
	Log *slog.Logger
}

// Result is a built image: one per platform, with its index when there
// are several.
type Result struct {
	// Images are by platform, in Spec.Platforms' order.
	Images []v1.Image
	// Index holds the images when there are several, else nil.
	Index v1.ImageIndex
}

// Digest is what a registry addresses the result by: the index's digest,
// or the image's.
func (r Result) Digest() (v1.Hash, error) {
	if r.Index != nil {
		return r.Index.Digest()
	}
	return r.Images[0].Digest()
}

// Build compiles the binaries and assembles the images.
func Build(ctx context.Context, s Spec) (Result, error) {
	if len(s.Platforms) == 0 {
		return Result{}, errors.New("ociimage: no platform")
	}
	if s.Created.IsZero() {
		return Result{}, errors.New("ociimage: no creation time (SOURCE_DATE_EPOCH)")
	}
	s.Created = s.Created.UTC().Truncate(time.Second)
	if s.Log == nil {
		s.Log = slog.New(slog.DiscardHandler)
	}
	files := map[string][]byte{}
	for _, f := range s.Files {
		data, err := os.ReadFile(filepath.Join(s.Dir, filepath.FromSlash(f.Source)))
		if err != nil {
			return Result{}, fmt.Errorf("ociimage: %w", err)
		}
		files[f.Path] = data
	}
	var res Result
	for _, p := range s.Platforms {
		img, err := s.image(ctx, p, files)
		if err != nil {
			return Result{}, fmt.Errorf("ociimage: %s: %w", p, err)
		}
		res.Images = append(res.Images, img)
	}
	if len(res.Images) > 1 {
		idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
		for i, img := range res.Images {
			p := s.Platforms[i]
			idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &p}})
		}
		res.Index = idx
	}
	return res, nil
}

// image builds the image of one platform.
func (s Spec) image(ctx context.Context, p v1.Platform, files map[string][]byte) (v1.Image, error) {
	var app []entry
	for _, b := range s.Binaries {
		data, err := s.build(ctx, p, b)
		if err != nil {
			return nil, err
		}
		app = append(app, entry{name: b.Path, mode: 0o755, data: data})
	}
	for name, data := range files {
		app = append(app, entry{name: name, mode: 0o644, data: data})
	}
	history := func(what string) v1.History {
		return v1.History{Created: v1.Time{Time: s.Created}, CreatedBy: "pdx-image: " + what, Comment: "built by cmd/pdx-image"}
	}

	var (
		img       v1.Image
		layerType types.MediaType = types.OCILayer
		cfg       *v1.ConfigFile
	)
	if s.Base == "" {
		img = mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
		base, err := layer(baseFiles(), s.Created, layerType)
		if err != nil {
			return nil, err
		}
		if img, err = mutate.Append(img, mutate.Addendum{Layer: base, History: history("the files of a static binary's base: /etc/passwd, /etc/group, CA certificates, /tmp")}); err != nil {
			return nil, err
		}
		cfg = &v1.ConfigFile{}
	} else {
		ref, err := name.ParseReference(s.Base)
		if err != nil {
			return nil, fmt.Errorf("base: %w", err)
		}
		s.Log.Info("pulling the base image", "base", s.Base, "platform", p.String())
		if img, err = remote.Image(ref, remote.WithContext(ctx), remote.WithPlatform(p), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
			return nil, fmt.Errorf("base %s: %w", s.Base, err)
		}
		if mt, err := img.MediaType(); err == nil && mt == types.DockerManifestSchema2 {
			layerType = types.DockerLayer
		}
		base, err := img.ConfigFile()
		if err != nil {
			return nil, fmt.Errorf("base %s: %w", s.Base, err)
		}
		cfg = base.DeepCopy()
		digest, err := img.Digest()
		if err != nil {
			return nil, err
		}
		s.Config.Labels = maps.Clone(s.Config.Labels)
		if s.Config.Labels == nil {
			s.Config.Labels = map[string]string{}
		}
		s.Config.Labels["org.opencontainers.image.base.name"] = ref.Name()
		s.Config.Labels["org.opencontainers.image.base.digest"] = digest.String()
	}
	top, err := layer(app, s.Created, layerType)
	if err != nil {
		return nil, err
	}
	if img, err = mutate.Append(img, mutate.Addendum{Layer: top, History: history("the binaries and config")}); err != nil {
		return nil, err
	}
	// The config after Append, which fills in the layers' diff IDs and
	// history.
	appended, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cfg.RootFS, cfg.History = appended.RootFS, appended.History
	cfg.Architecture, cfg.OS, cfg.Variant, cfg.OSVersion = p.Architecture, p.OS, p.Variant, p.OSVersion
	cfg.Created = v1.Time{Time: s.Created}
	cfg.Config = merge(cfg.Config, s.Config)
	return mutate.ConfigFile(img, cfg)
}

// merge lays c over base: the fields c sets replace base's, its labels,
// ports and environment variables are added to base's.
func merge(base, c v1.Config) v1.Config {
	out := base
	if c.User != "" {
		out.User = c.User
	}
	if c.WorkingDir != "" {
		out.WorkingDir = c.WorkingDir
	}
	if c.Entrypoint != nil {
		out.Entrypoint = slices.Clone(c.Entrypoint)
	}
	if c.Cmd != nil {
		out.Cmd = slices.Clone(c.Cmd)
	}
	out.Labels = maps.Clone(base.Labels)
	if len(c.Labels) > 0 && out.Labels == nil {
		out.Labels = map[string]string{}
	}
	maps.Copy(out.Labels, c.Labels)
	out.ExposedPorts = maps.Clone(base.ExposedPorts)
	if len(c.ExposedPorts) > 0 && out.ExposedPorts == nil {
		out.ExposedPorts = map[string]struct{}{}
	}
	maps.Copy(out.ExposedPorts, c.ExposedPorts)
	out.Env = slices.Clone(base.Env)
	for _, kv := range c.Env {
		k, _, _ := strings.Cut(kv, "=")
		out.Env = slices.DeleteFunc(out.Env, func(e string) bool { return strings.HasPrefix(e, k+"=") })
		out.Env = append(out.Env, kv)
	}
	return out
}

// build compiles b for p and returns the binary.
func (s Spec) build(ctx context.Context, p v1.Platform, b Binary) ([]byte, error) {
	dir, err := os.MkdirTemp("", "pdx-image-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	out := filepath.Join(dir, path.Base(b.Path))
	args := []string{"build", "-trimpath", "-ldflags=-s -w -buildid=", "-o", out}
	if b.Tags != "" {
		args = append(args, "-tags", b.Tags)
	}
	args = append(args, b.Package)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = s.Dir
	// The environment decides the binary: fixed here, whatever the
	// caller's (GOFLAGS could add tags, or -race).
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture, "GOFLAGS=-mod=readonly")
	switch {
	case p.Architecture == "arm" && p.Variant != "":
		cmd.Env = append(cmd.Env, "GOARM="+strings.TrimPrefix(p.Variant, "v"))
	case p.Architecture == "amd64" && p.Variant != "":
		cmd.Env = append(cmd.Env, "GOAMD64="+p.Variant)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	s.Log.Info("building", "package", b.Package, "platform", p.String())
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return os.ReadFile(out)
}

// entry is a file or directory of a layer. A name ending in "/" is a
// directory.
type entry struct {
	name     string
	mode     int64
	uid, gid int
	data     []byte
}

// layer makes a gzip-compressed layer of entries, sorted by name, every
// one with mtime, and the directories that hold them (0755, root's)
// unless listed.
func layer(entries []entry, mtime time.Time, mt types.MediaType) (v1.Layer, error) {
	byName := map[string]entry{}
	for _, e := range entries {
		e.name = strings.TrimPrefix(e.name, "/")
		byName[e.name] = e
		for dir := path.Dir(strings.TrimSuffix(e.name, "/")); dir != "."; dir = path.Dir(dir) {
			if _, ok := byName[dir+"/"]; !ok {
				byName[dir+"/"] = entry{name: dir + "/", mode: 0o755}
			}
		}
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range slices.Sorted(maps.Keys(byName)) {
		e := byName[n]
		h := &tar.Header{
			Name: e.name, Mode: e.mode, Uid: e.uid, Gid: e.gid, ModTime: mtime,
			Typeflag: tar.TypeReg, Size: int64(len(e.data)), Format: tar.FormatUSTAR,
		}
		if strings.HasSuffix(e.name, "/") {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, fmt.Errorf("layer: %s: %w", e.name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	// Compressed once, here: given gzip, the layer keeps it as it is.
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.DefaultCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(buf.Bytes()); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	data := gz.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil },
		tarball.WithMediaType(mt))
}
