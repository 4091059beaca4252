package server

import (
	"bytes"
	"strconv"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
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

// routingAnswer is a routing answer as pdx sends it: a body mutation, headers
// and dynamic metadata (a structpb.Struct, marshalled by vtprotobuf's
// well-known types).
func routingAnswer(t testing.TB, body []byte) *extprocv3.ProcessingResponse {
	md, err := structpb.NewStruct(map[string]any{"envoy.lb": map[string]any{"x-gateway-destination-endpoint": "127.0.0.1:8200"}})
	require.NoError(t, err)
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
			ClearRouteCache: true,
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{
				{Header: &corev3.HeaderValue{Key: "x-gateway-destination-endpoint", RawValue: []byte("127.0.0.1:8200")}},
				{Header: &corev3.HeaderValue{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))}},
			}},
			BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}},
		}}},
		DynamicMetadata: md,
	}
}

// What the codec marshals (vtprotobuf, into pooled buffers) reads back as
// the message, also from a buffer that held a larger message before.
func TestCodecMarshalsPooled(t *testing.T) {
	for _, size := range []int{0, 100, 40 << 10, 33 << 10, 5 << 20, 20 << 20} {
		msg := routingAnswer(t, bytes.Repeat([]byte{byte('a' + size%26)}, size))
		wire, err := codec{}.Marshal(msg)
		require.NoError(t, err)
		want, err := proto.Marshal(msg)
		require.NoError(t, err)
		got := wire.Materialize()
		wire.Free() // back to the pool, for the next size
		var back extprocv3.ProcessingResponse
		require.NoError(t, proto.Unmarshal(got, &back))
		require.True(t, proto.Equal(msg, &back), "%d bytes", size)
		require.Len(t, got, len(want))
	}
}

// A message without vtprotobuf code (the health service's, the tag left
// out) is marshalled by reflection.
func TestCodecMarshalsOthers(t *testing.T) {
	msg, err := structpb.NewStruct(map[string]any{"status": "SERVING"})
	require.NoError(t, err)
	_, isVT := any(msg).(vtMessage)
	require.False(t, isVT)
	wire, err := codec{}.Marshal(msg)
	require.NoError(t, err)
	var back structpb.Struct
	require.NoError(t, codec{}.Unmarshal(wire, &back))
	require.True(t, proto.Equal(msg, &back))
	_, err = codec{}.Marshal("not a message")
	require.Error(t, err)
}

func TestDirtyPool(t *testing.T) {
	p := newDirtyPool(4<<10, 64<<10)
	for _, tc := range []struct{ n, capacity int }{
		{1, 4 << 10}, {4 << 10, 4 << 10}, {4<<10 + 1, 8 << 10}, {33 << 10, 64 << 10}, {64 << 10, 64 << 10},
		{64<<10 + 1, 64<<10 + 1}, // above the largest class: its own size
	} {
		b := p.Get(tc.n)
		require.Len(t, *b, tc.n)
		require.Equal(t, tc.capacity, cap(*b), "Get(%d)", tc.n)
		p.Put(b)
	}
	odd := make([]byte, 5<<10)
	p.Put(&odd) // not a class's capacity: dropped, never handed out short
	for range 100 {
		require.GreaterOrEqual(t, cap(*p.Get(8 << 10)), 8<<10)
	}
}

// BenchmarkCodec is the codec against gRPC's proto codec, side by side, on
// the messages that carry a 32 KiB body: the routing answer pdx sends
// (its decode body) and the request body Envoy sends, in three frames.
func BenchmarkCodec(b *testing.B) {
	body := bytes.Repeat([]byte("0123456789abcdef"), 2<<10)
	answer := routingAnswer(b, body)
	req := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}}
	raw, err := proto.Marshal(req)
	require.NoError(b, err)
	frames := mem.BufferSlice{mem.SliceBuffer(raw[:16<<10]), mem.SliceBuffer(raw[16<<10 : 32<<10]), mem.SliceBuffer(raw[32<<10:])}
	for _, c := range []struct {
		name  string
		codec encoding.CodecV2
	}{{"grpc", encoding.GetCodecV2(protoenc.Name)}, {"pdx", codec{}}} {
		b.Run("marshal/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				wire, err := c.codec.Marshal(answer)
				if err != nil {
					b.Fatal(err)
				}
				wire.Free() // as gRPC does once it is written
			}
		})
		b.Run("unmarshal/"+c.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				var got extprocv3.ProcessingRequest
				if err := c.codec.Unmarshal(frames, &got); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
