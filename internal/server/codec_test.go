package server

import (
	"bytes"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

func TestCodec(t *testing.T) {
	require.NotEqual(t, codec{}, encoding.GetCodecV2(protoenc.Name), "gRPC's codec stays the process's")
	body := bytes.Repeat([]byte("0123456789abcdef"), 6<<10) // 96 KiB: several frames
	msg := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}}
	wire, err := codec{}.Marshal(msg)
	require.NoError(t, err)
	raw := wire.Materialize()
	for _, pieces := range []int{1, 2, 7} { // as many buffers as frames arrived in
		var in mem.BufferSlice
		step := (len(raw) + pieces - 1) / pieces
		for i := 0; i < len(raw); i += step {
			in = append(in, mem.SliceBuffer(raw[i:min(i+step, len(raw))]))
		}
		var got extprocv3.ProcessingRequest
		require.NoError(t, codec{}.Unmarshal(in, &got))
		require.True(t, proto.Equal(msg, &got), "%d pieces", pieces)
	}
	require.Error(t, codec{}.Unmarshal(mem.BufferSlice{mem.SliceBuffer(raw)}, "not a message"))
}
