package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRunRejectsBadArguments(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"unknown role", []string{"--addr", "127.0.0.1:0", "--role", "router"}, "unknown role"},
		{"bad latency", []string{"--decode-latency", "soon"}, "invalid value"},
		{"unknown flag", []string{"--gpu"}, "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.ErrorContains(t, run(tt.args), tt.wantErr)
		})
	}
	require.NoError(t, run([]string{"-h"}), "help is not an error")
}
