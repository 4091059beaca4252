package version

import (
	"os"
	"regexp"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGet(t *testing.T) {
	tests := []struct {
		name             string
		bi               *debug.BuildInfo
		release, commit  string
		wantRel, wantRev string
	}{
		{name: "nothing recorded", wantRel: "devel", wantRev: "unknown"},
		{name: "go build in a checkout", bi: &debug.BuildInfo{Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "false"}}},
			wantRel: "devel", wantRev: "abc123"},
		{name: "a checkout with changes", bi: &debug.BuildInfo{Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}, {Key: "vcs.modified", Value: "true"}}},
			wantRel: "devel", wantRev: "abc123-dirty"},
		{name: "go install at a version", bi: &debug.BuildInfo{Main: debug.Module{Version: "v0.2.0"}},
			wantRel: "0.2.0", wantRev: "unknown"},
		{name: "set when linking", bi: &debug.BuildInfo{Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc123"}}},
			release: "0.3.0", commit: "def456", wantRel: "0.3.0", wantRev: "def456"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			info := get(tt.bi, tt.release, tt.commit)
			require.Equal(t, tt.wantRel, info.Release)
			require.Equal(t, tt.wantRev, info.Commit)
			require.Equal(t, runtime.Version(), info.Go)
			require.Equal(t, Envoy, info.Envoy)
		})
	}
}

// Envoy is the release the Makefile installs and the tests run.
func TestEnvoyIsTheMakefiles(t *testing.T) {
	data, err := os.ReadFile("../../Makefile")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^ENVOY_VERSION\s*:?=\s*(\S+)\s*$`).FindSubmatch(data)
	require.NotNil(t, m, "no ENVOY_VERSION in the Makefile")
	require.Equal(t, string(m[1]), Envoy)
}
