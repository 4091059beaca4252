package main

import (
	"context"
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
		{"unknown connector", []string{"--addr", "127.0.0.1:0", "--connector", "ucx"}, "unknown connector"},
		{"unknown mooncake protocol", []string{"--addr", "127.0.0.1:0", "--connector", "mooncake", "--mooncake-protocol", "rdma"}, "unknown Mooncake protocol"},
		{"http without store", []string{"--addr", "127.0.0.1:0", "--connector", "http"}, "needs StoreAddr"},
		{"bad wait timeout", []string{"--kv-wait-timeout", "-1s"}, "KVWaitTimeout must not be negative"},
		{"bad queue latency", []string{"--decode-queue-latency", "-1s"}, "DecodeQueueLatency must not be negative"},
		{"bad disconnect check", []string{"--disconnect-check-interval", "-1s"}, "DisconnectCheckInterval must not be negative"},
		{"tampered params not an object", []string{"--tamper-kv-params", "[1]"}, "TamperKVParams must be a JSON object"},
		{"negative dp size", []string{"--addr", "127.0.0.1:0", "--dp-size", "-2"}, "DPSize must not be negative"},
		{"store on a bad address", []string{"--store", "--addr", "127.0.0.1:bad"}, "store listen"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			require.ErrorContains(t, run(t.Context(), tt.args), tt.wantErr)
		})
	}
	require.NoError(t, run(t.Context(), []string{"-h"}), "help is not an error")
}

func TestRunServesUntilDone(t *testing.T) {
	tests := []struct {
		name string
		args []string
	}{
		{"store", []string{"--store"}},
		{"nixl", nil},
		{"sglang prefill", []string{"--connector", "sglang", "--role", "prefill"}},
		{"mooncake vllm prefill", []string{"--connector", "mooncake", "--mooncake-protocol", "vllm", "--role", "prefill"}},
		{"p2p-nccl decode", []string{"--connector", "p2p-nccl", "--role", "decode", "--kv-wait-timeout", "1s"}},
		{"trtllm", []string{"--connector", "trtllm"}},
		{"trtllm legacy", []string{"--connector", "trtllm", "--trtllm-legacy"}},
		{"nixl misbehaving", []string{"--role", "prefill", "--decode-queue-latency", "10ms",
			"--tamper-kv-params", `{"remote_host":"203.0.113.66"}`}},
		{"sglang decode", []string{"--connector", "sglang", "--role", "decode", "--disconnect-check-interval", "1s"}},
		{"lmcache", []string{"--connector", "lmcache", "--store-addr", "127.0.0.1:1"}},
		{"sglang with dp ranks", []string{"--connector", "sglang", "--role", "prefill", "--dp-size", "4"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			go func() { done <- run(ctx, append([]string{"--addr", "127.0.0.1:0"}, tt.args...)) }()
			cancel()
			require.NoError(t, <-done)
		})
	}
}
