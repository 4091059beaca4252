package server

import (
	"fmt"

	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// codec is gRPC's proto codec without its default buffer pool, whose
// buffers come in tiers of 256 B, 4, 16 and 32 KiB and 1 MiB and are cleared
// whole on every use: each request body just over 32 KiB (more than one
// HTTP/2 frame) cost a 1 MiB clear to receive and another to answer, a
// fifth of pdx's CPU in a profile. Buffers sized to the message are cleared
// only as far as the message goes. pdx's gRPC server uses it
// (grpc.ForceServerCodecV2); the process's other gRPC users, such as the
// OTLP trace exporter, keep gRPC's own.
type codec struct{}

var _ encoding.CodecV2 = codec{}

func (codec) Name() string { return protoenc.Name }

func (codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("proto: cannot marshal %T, not a proto.Message", v)
	}
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("proto: cannot unmarshal into %T, not a proto.Message", v)
	}
	if len(data) == 1 {
		return proto.Unmarshal(data[0].ReadOnlyData(), m)
	}
	// proto.Unmarshal copies what it keeps: buf is garbage after it.
	buf := make([]byte, data.Len())
	data.CopyTo(buf)
	return proto.Unmarshal(buf, m)
}
