package server

import (
	"fmt"
	"math/bits"
	"sync"

	"google.golang.org/grpc/encoding"
	protoenc "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// codec is gRPC's proto codec with two changes for the ext_proc messages,
// whose request bodies are most of pdx's bytes. pdx's gRPC server uses it
// (grpc.ForceServerCodecV2); the process's other gRPC users, such as the
// OTLP trace exporter, keep gRPC's own.
//   - Buffers come from bufPool, which does not clear them: gRPC's default
//     pool clears a buffer's whole capacity on every use (its tiers are
//     256 B, 4, 16 and 32 KiB and 1 MiB, so a body just over 32 KiB cost a
//     1 MiB clear each way), and a fresh buffer is cleared by the allocator.
//     Every byte of what codec takes from the pool is written before it is
//     read.
//   - Messages that go-control-plane generates vtprotobuf code for (the
//     ext_proc ones) are sized and marshalled by it, without reflection.
type codec struct{}

var _ encoding.CodecV2 = codec{}

func (codec) Name() string { return protoenc.Name }

// vtMessage is the marshalling vtprotobuf generates.
type vtMessage interface {
	SizeVT() int
	MarshalToSizedBufferVTStrict([]byte) (int, error)
}

func (codec) Marshal(v any) (mem.BufferSlice, error) {
	if m, ok := v.(vtMessage); ok {
		n := m.SizeVT()
		if n < minPooled {
			buf := make([]byte, n)
			if err := marshalVT(m, buf); err != nil {
				return nil, err
			}
			return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
		}
		buf := bufPool.Get(n)
		if err := marshalVT(m, *buf); err != nil {
			bufPool.Put(buf)
			return nil, err
		}
		// gRPC puts the buffer back once it has written it.
		return mem.BufferSlice{mem.NewBuffer(buf, bufPool)}, nil
	}
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

// marshalVT marshals m into buf, which is m's size: vtprotobuf writes
// from the end, so a message that wrote less would leave buf's start as
// it was.
func marshalVT(m vtMessage, buf []byte) error {
	n, err := m.MarshalToSizedBufferVTStrict(buf)
	if err == nil && n != len(buf) {
		err = fmt.Errorf("proto: %T marshalled to %d bytes, sized %d", m, n, len(buf))
	}
	return err
}

func (codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("proto: cannot unmarshal into %T, not a proto.Message", v)
	}
	if len(data) == 1 {
		return proto.Unmarshal(data[0].ReadOnlyData(), m)
	}
	// A message of several frames is read whole first. proto.Unmarshal
	// copies what it keeps (the body too), so the buffer goes back to the
	// pool at once.
	buf := bufPool.Get(data.Len())
	defer bufPool.Put(buf)
	data.CopyTo(*buf)
	return proto.Unmarshal(*buf, m)
}

// minPooled is the smallest buffer the codec pools: below it, an
// allocation costs less than the pool's synchronisation.
const minPooled = 4 << 10

// bufPool holds buffers by powers of two from minPooled up; larger ones
// than its largest class are allocated and dropped.
var bufPool = newDirtyPool(minPooled, 16<<20)

// dirtyPool is a mem.BufferPool whose buffers keep what they held.
type dirtyPool struct {
	minShift int
	classes  []sync.Pool // class i holds buffers of capacity 1 << (minShift+i)
}

var _ mem.BufferPool = (*dirtyPool)(nil)

func newDirtyPool(minSize, maxSize int) *dirtyPool {
	lo, hi := bits.Len(uint(minSize-1)), bits.Len(uint(maxSize-1))
	return &dirtyPool{minShift: lo, classes: make([]sync.Pool, hi-lo+1)}
}

// class is the index of the smallest class holding n bytes, len(classes)
// when none does.
func (p *dirtyPool) class(n int) int {
	return max(bits.Len(uint(n-1))-p.minShift, 0)
}

func (p *dirtyPool) Get(n int) *[]byte {
	c := p.class(n)
	if c >= len(p.classes) {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<(p.minShift+c))
	return &b
}

func (p *dirtyPool) Put(b *[]byte) {
	// Only buffers of a class's exact capacity: Get reslices up to it.
	c := p.class(cap(*b))
	if c < len(p.classes) && cap(*b) == 1<<(p.minShift+c) {
		p.classes[c].Put(b)
	}
}
