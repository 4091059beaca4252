// Command pdx-image builds pdx's OCI image without a container engine
// (package ociimage) and pushes it to a registry. `make image` and `make
// image-push` run it:
//
//	pdx-image build --out bin/pdx-0.1.0.oci.tar --version 0.1.0 [--platform linux/amd64,linux/arm64] [--base REF]
//	pdx-image push bin/pdx-0.1.0.oci.tar registry.example.com/team/pdx:0.1.0
//
// The creation time is SOURCE_DATE_EPOCH (seconds), or the commit time of
// the checked-out commit: the same commit gives the same image.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/pdx-router/pdx/internal/ociimage"
)

const usage = `usage: pdx-image <command> [flags]

commands:
  build --out FILE --version V   build pdx's image into an OCI layout archive
  push FILE REF                  push an archive's image to a registry (as docker, podman or crane logged in)
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdx-image:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errors.New("no command")
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	switch args[0] {
	case "build":
		return build(ctx, args[1:], stdout, stderr, log)
	case "push":
		return push(ctx, args[1:], stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return nil
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("unknown command %q", args[0])
}

func build(ctx context.Context, args []string, stdout, stderr io.Writer, log *slog.Logger) error {
	fs := flag.NewFlagSet("pdx-image build", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "", "the OCI layout archive to write (required)")
	repository := fs.String("repository", ociimage.Repository, "the image's repository, which the archive names it by with --version as the tag")
	version := fs.String("version", "", "pdx's version: the image's tag and version label (required; make image uses the Helm chart's appVersion)")
	platforms := fs.String("platform", "linux/"+runtime.GOARCH, "the platforms to build, comma-separated (two or more make an image index)")
	base := fs.String("base", "", "an image to build on, pulled from its registry (e.g. gcr.io/distroless/static-debian12:nonroot); empty: scratch with the files a static binary needs")
	dir := fs.String("dir", ".", "the module's root")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("build: unexpected arguments %q", fs.Args())
	}
	if *out == "" || *version == "" {
		return errors.New("build: --out and --version are required")
	}
	ref, err := name.NewTag(*repository + ":" + *version)
	if err != nil {
		return fmt.Errorf("build: --repository and --version: %w", err)
	}
	var plats []v1.Platform
	for p := range strings.SplitSeq(*platforms, ",") {
		pl, err := v1.ParsePlatform(strings.TrimSpace(p))
		if err != nil || pl.OS == "" || pl.Architecture == "" {
			return fmt.Errorf("build: --platform %q: want os/arch[/variant], e.g. linux/amd64", p)
		}
		plats = append(plats, *pl)
	}
	created, err := creationTime(ctx, *dir)
	if err != nil {
		return fmt.Errorf("build: %w", err)
	}
	revision, dirty := gitRevision(ctx, *dir)
	if dirty {
		log.Warn("tracked files differ from the commit: the image is built from the working tree, its revision label names the commit", "revision", revision)
	}

	spec := ociimage.Pdx(*dir, *version, revision, created, plats)
	spec.Base, spec.Log = *base, log
	res, err := ociimage.Build(ctx, spec)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(*out), ".pdx-image-")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := ociimage.WriteArchive(tmp, res, ref, created); err != nil {
		tmp.Close()
		return fmt.Errorf("build: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), *out); err != nil {
		return err
	}
	digest, err := res.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s: %s@%s (%s, created %s)\n", *out, ref, digest, *platforms, created.UTC().Format(time.RFC3339))
	return nil
}

func push(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("pdx-image push", flag.ContinueOnError)
	fs.SetOutput(stderr)
	insecure := fs.Bool("insecure", false, "allow a registry over plain HTTP")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 2 {
		return errors.New("push: want the archive and the reference to push to: push FILE REGISTRY/REPOSITORY:TAG")
	}
	var opts []name.Option
	if *insecure {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.ParseReference(fs.Arg(1), opts...)
	if err != nil {
		return fmt.Errorf("push: %w", err)
	}
	digest, err := ociimage.Push(ctx, fs.Arg(0), ref)
	if err != nil {
		return fmt.Errorf("push: %w", err)
	}
	fmt.Fprintf(stdout, "pushed %s@%s\n", ref.Context(), digest)
	return nil
}

// creationTime is SOURCE_DATE_EPOCH, or the commit time of HEAD.
func creationTime(ctx context.Context, dir string) (time.Time, error) {
	s := os.Getenv("SOURCE_DATE_EPOCH")
	if s == "" {
		out, err := exec.CommandContext(ctx, "git", "-C", dir, "log", "-1", "--format=%ct").Output()
		if err != nil {
			return time.Time{}, errors.New("no SOURCE_DATE_EPOCH and no git commit to take the creation time from")
		}
		s = strings.TrimSpace(string(out))
	}
	secs, err := strconv.ParseInt(s, 10, 64)
	if err != nil || secs < 0 {
		return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q is not a count of seconds", s)
	}
	return time.Unix(secs, 0).UTC(), nil
}

// gitRevision is the commit checked out in dir ("" outside git), and
// whether the tree differs from it.
func gitRevision(ctx context.Context, dir string) (string, bool) {
	out, err := exec.CommandContext(ctx, "git", "-C", dir, "rev-parse", "HEAD").Output()
	if err != nil {
		return "", false
	}
	status, err := exec.CommandContext(ctx, "git", "-C", dir, "status", "--porcelain", "--untracked-files=no").Output()
	return strings.TrimSpace(string(out)), err == nil && len(bytes.TrimSpace(status)) > 0
}
