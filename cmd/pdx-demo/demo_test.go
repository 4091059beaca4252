package main

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The demo is the first thing a user runs: it must work and say so.
func TestDemo(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := demo(t.Context(), []string{"--port", "0", "--requests", "8"}, &stdout, &stderr)
	require.NoError(t, err, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	out := stdout.String()
	require.Contains(t, out, "simulated vLLM engines")
	require.Contains(t, out, "KV hand-off (checked by decode engine)")
	require.Equal(t, 8, strings.Count(out, "verified: own prompt's KV pulled"), out)
	require.Contains(t, out, "All 8 requests succeeded")
}

func TestDemoHelp(t *testing.T) {
	var out bytes.Buffer
	require.True(t, errors.Is(demo(t.Context(), []string{"-h"}, &out, &out), flag.ErrHelp))
	require.Contains(t, out.String(), "-keep")
	require.Contains(t, out.String(), "-engines")
	require.ErrorIs(t, demo(t.Context(), []string{"--port", "0", "--engines", "tgi"}, &out, &out), errUsage)
}
