package main

import (
	"bytes"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestRefuses: arguments the command cannot use are refused with a
// message, before anything is built.
func TestRefuses(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		wantErr string
	}{
		{nil, "no command"},
		{[]string{"bulid"}, `unknown command "bulid"`},
		{[]string{"build", "--version", "0.1.0"}, "--out and --version are required"},
		{[]string{"build", "--out", "x.tar"}, "--out and --version are required"},
		{[]string{"build", "--out", "x.tar", "--version", "0.1.0", "extra"}, `unexpected arguments ["extra"]`},
		{[]string{"build", "--out", "x.tar", "--version", "0.1.0", "--platform", "amd64"}, `--platform "amd64": want os/arch`},
		{[]string{"build", "--out", "x.tar", "--version", "v 1"}, "--repository and --version"},
		{[]string{"push", "x.tar"}, "want the archive and the reference"},
		{[]string{"push", "x.tar", "Not A Ref"}, "push:"},
	} {
		var out, errOut bytes.Buffer
		err := run(t.Context(), tc.args, &out, &errOut)
		require.ErrorContains(t, err, tc.wantErr, "%q", tc.args)
	}
}

// TestCreationTime: SOURCE_DATE_EPOCH when set, else the commit's time.
func TestCreationTime(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "1764590400")
	got, err := creationTime(t.Context(), ".")
	require.NoError(t, err)
	require.Equal(t, time.Date(2025, 12, 1, 12, 0, 0, 0, time.UTC), got)

	t.Setenv("SOURCE_DATE_EPOCH", "yesterday")
	_, err = creationTime(t.Context(), ".")
	require.ErrorContains(t, err, `SOURCE_DATE_EPOCH "yesterday" is not a count of seconds`)

	t.Setenv("SOURCE_DATE_EPOCH", "")
	got, err = creationTime(t.Context(), ".")
	require.NoError(t, err, "the commit's time")
	require.False(t, got.IsZero())
}
