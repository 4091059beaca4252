package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Annotations of index.json naming the image, as `docker save` writes them
// (and containerd reads the first).
const (
	annotationImageName = "io.containerd.image.name"
	annotationRefName   = "org.opencontainers.image.ref.name"
)

// blob is one file of blobs/sha256/.
type blob struct {
	size int64
	open func() (io.ReadCloser, error)
}

// WriteArchive writes r to w as an OCI image layout in a tar archive, the
// layout `docker save` writes since Docker 25: oci-layout; index.json,
// whose one entry is the image (or the index of images) named ref; the
// blobs under blobs/sha256/; and for a single image the manifest.json of
// Docker's own archive format, which names the same blobs, so that older
// docker load and crane push read it too. Entries are sorted and dated
// mtime: the same image gives the same archive.
func WriteArchive(w io.Writer, r Result, ref name.Tag, mtime time.Time) error {
	blobs := map[v1.Hash]blob{}
	addRaw := func(data []byte, err error) (v1.Hash, error) {
		if err != nil {
			return v1.Hash{}, err
		}
		h, _, err := v1.SHA256(bytes.NewReader(data))
		if err != nil {
			return v1.Hash{}, err
		}
		blobs[h] = blob{size: int64(len(data)), open: func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }}
		return h, nil
	}
	type dockerManifest struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	var docker []dockerManifest
	blobPath := func(h v1.Hash) string { return "blobs/" + h.Algorithm + "/" + h.Hex }
	for _, img := range r.Images {
		if _, err := addRaw(img.RawManifest()); err != nil {
			return err
		}
		cfg, err := addRaw(img.RawConfigFile())
		if err != nil {
			return err
		}
		layers, err := img.Layers()
		if err != nil {
			return err
		}
		dm := dockerManifest{Config: blobPath(cfg), RepoTags: []string{ref.String()}}
		for _, l := range layers {
			h, err := l.Digest()
			if err != nil {
				return err
			}
			size, err := l.Size()
			if err != nil {
				return err
			}
			blobs[h] = blob{size: size, open: l.Compressed}
			dm.Layers = append(dm.Layers, blobPath(h))
		}
		docker = append(docker, dm)
	}

	var top v1.Descriptor
	var err error
	if r.Index != nil {
		top.Digest, err = addRaw(r.Index.RawManifest())
		if err == nil {
			top.MediaType, err = r.Index.MediaType()
		}
		if err == nil {
			top.Size, err = r.Index.Size()
		}
		docker = nil // Docker's format has no index
	} else {
		img := r.Images[0]
		top.Digest, err = img.Digest()
		if err == nil {
			top.MediaType, err = img.MediaType()
		}
		if err == nil {
			top.Size, err = img.Size()
		}
	}
	if err != nil {
		return err
	}
	top.Annotations = map[string]string{annotationImageName: ref.String(), annotationRefName: ref.TagStr()}
	index, err := json.Marshal(v1.IndexManifest{SchemaVersion: 2, MediaType: types.OCIImageIndex, Manifests: []v1.Descriptor{top}})
	if err != nil {
		return err
	}

	tw := tar.NewWriter(w)
	file := func(name string, size int64, body io.Reader) error {
		h := &tar.Header{Name: name, Mode: 0o644, Size: size, ModTime: mtime, Typeflag: tar.TypeReg, Format: tar.FormatUSTAR}
		if body == nil {
			h.Typeflag, h.Mode = tar.TypeDir, 0o755
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if body != nil {
			if n, err := io.Copy(tw, body); err != nil || n != size {
				return cmpErr(err, fmt.Errorf("%s: %d bytes, not %d", name, n, size))
			}
		}
		return nil
	}
	small := func(name string, data []byte) error { return file(name, int64(len(data)), bytes.NewReader(data)) }
	if err := small("oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)); err != nil {
		return err
	}
	if err := small("index.json", index); err != nil {
		return err
	}
	if docker != nil {
		data, err := json.Marshal(docker)
		if err != nil {
			return err
		}
		if err := small("manifest.json", data); err != nil {
			return err
		}
	}
	for _, dir := range []string{"blobs/", "blobs/sha256/"} {
		if err := file(dir, 0, nil); err != nil {
			return err
		}
	}
	for _, h := range slices.SortedFunc(maps.Keys(blobs), func(a, b v1.Hash) int { return strings.Compare(a.String(), b.String()) }) {
		b := blobs[h]
		rc, err := b.open()
		if err != nil {
			return err
		}
		err = file(blobPath(h), b.size, rc)
		rc.Close()
		if err != nil {
			return fmt.Errorf("blob %s: %w", h, err)
		}
	}
	return tw.Close()
}

func cmpErr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

// Unpack extracts an archive of WriteArchive into dir, as an OCI image
// layout, and returns its index (index.json). It takes regular files and
// directories only, and none outside dir.
func Unpack(archive, dir string) (v1.ImageIndex, error) {
	f, err := os.Open(archive)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", archive, err)
		}
		name := path.Clean(h.Name)
		if !filepath.IsLocal(name) {
			return nil, fmt.Errorf("%s: entry %q leaves the archive", archive, h.Name)
		}
		target := filepath.Join(dir, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(target, 0o755)
		case tar.TypeReg:
			err = writeFile(target, tr)
		default:
			err = fmt.Errorf("entry %q is neither a file nor a directory", h.Name)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", archive, err)
		}
	}
	return layout.ImageIndexFromPath(dir)
}

func writeFile(target string, r io.Reader) error {
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	f, err := os.Create(target)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Push uploads the image (or index of images) of an archive of
// WriteArchive to ref, authenticated as docker, podman and crane log in
// (their config files), and returns the digest the registry has it by.
func Push(ctx context.Context, archive string, ref name.Reference, opts ...remote.Option) (v1.Hash, error) {
	dir, err := os.MkdirTemp("", "pdx-image-push-")
	if err != nil {
		return v1.Hash{}, err
	}
	defer os.RemoveAll(dir)
	idx, err := Unpack(archive, dir)
	if err != nil {
		return v1.Hash{}, err
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return v1.Hash{}, err
	}
	if len(m.Manifests) != 1 {
		return v1.Hash{}, fmt.Errorf("%s: index.json names %d images, not one", archive, len(m.Manifests))
	}
	d := m.Manifests[0]
	opts = append([]remote.Option{remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)}, opts...)
	if d.MediaType.IsIndex() {
		ii, err := idx.ImageIndex(d.Digest)
		if err != nil {
			return v1.Hash{}, err
		}
		return d.Digest, remote.WriteIndex(ref, ii, opts...)
	}
	img, err := idx.Image(d.Digest)
	if err != nil {
		return v1.Hash{}, err
	}
	return d.Digest, remote.Write(ref, img, opts...)
}
