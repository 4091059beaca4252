// Package version says which pdx this is: its release, the commit it was
// built from, the Go that built it and the Envoy it is tested with.
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Release and Commit may be set when linking, as a release build does:
//
//	go build -ldflags "-X github.com/pdx-router/pdx/internal/version.Release=0.2.0 \
//	  -X github.com/pdx-router/pdx/internal/version.Commit=$(git rev-parse HEAD)" ./cmd/pdx
//
// Left empty, Get takes them from what the Go toolchain records: the
// module's version (`go install ...@v0.2.0`) and the git commit of a
// `go build` in a checkout.
var (
	Release string
	Commit  string
)

// Envoy is the Envoy release pdx's tests run against: the Makefile's
// ENVOY_VERSION, which a test keeps this equal to.
const Envoy = "1.40.0"

// Info is what `pdx version` prints.
type Info struct {
	// Release is pdx's version: "devel" for a build from a checkout
	// without one.
	Release string
	// Commit is the git commit built, with "-dirty" when the checkout had
	// changes; "unknown" when nothing recorded it (`go run`).
	Commit string
	// Go is the toolchain that built pdx, and its OS/architecture.
	Go, Platform string
	// Envoy is the Envoy release pdx is tested with.
	Envoy string
}

// Get returns this binary's Info.
func Get() Info {
	bi, _ := debug.ReadBuildInfo()
	return get(bi, Release, Commit)
}

func get(bi *debug.BuildInfo, release, commit string) Info {
	info := Info{Release: release, Commit: commit, Go: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH, Envoy: Envoy}
	if bi != nil {
		if info.Release == "" && bi.Main.Version != "(devel)" {
			info.Release = strings.TrimPrefix(bi.Main.Version, "v")
		}
		if info.Commit == "" {
			settings := map[string]string{}
			for _, s := range bi.Settings {
				settings[s.Key] = s.Value
			}
			info.Commit = settings["vcs.revision"]
			if info.Commit != "" && settings["vcs.modified"] == "true" {
				info.Commit += "-dirty"
			}
		}
	}
	if info.Release == "" {
		info.Release = "devel"
	}
	if info.Commit == "" {
		info.Commit = "unknown"
	}
	return info
}

// String is the text `pdx version` prints.
func (i Info) String() string {
	return fmt.Sprintf("pdx %s\ncommit: %s\ngo:     %s %s\nenvoy:  %s (the release pdx is tested with)\n",
		i.Release, i.Commit, i.Go, i.Platform, i.Envoy)
}
