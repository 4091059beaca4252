package loadtest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// Streams is what one pdx did with many concurrent ext_proc streams.
type Streams struct {
	Streams     int     `json:"streams"`
	Connections int     `json:"connections"`
	MaxOpen     int64   `json:"max_open"` // routed streams waiting for their prefill at once
	Routed      int64   `json:"routed"`
	Errors      int64   `json:"errors"`
	FirstError  string  `json:"first_error,omitempty"`
	Seconds     float64 `json:"seconds"`
	HeapMiB     float64 `json:"heap_mib"` // live, with all streams open
	RSSMiB      float64 `json:"rss_mib"`
}

// streamConns is how many HTTP/2 connections carry the streams, as an Envoy
// with a few workers would use.
const streamConns = 8

// runStreams opens plan.OpenStreams ext_proc streams to pdx at once, as
// Envoy would, each a request whose prefill takes plan.ParkedPrefill, and checks
// that every one is routed.
func runStreams(ctx context.Context, plan Plan, rep *Report) error {
	r, err := startRig(ctx, rigOptions{
		pdxBin: plan.PdxBin, envoyBin: plan.EnvoyBin,
		engine:  enginesim.Config{PrefillLatency: plan.ParkedPrefill},
		prefill: 2, decode: 2, prefillTimeout: 60 * time.Second,
	})
	if err != nil {
		return err
	}
	defer r.close()
	var conns []extprocv3.ExternalProcessorClient
	for range streamConns {
		cc, err := grpc.NewClient(r.pdx.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return err
		}
		defer cc.Close()
		conns = append(conns, extprocv3.NewExternalProcessorClient(cc))
	}
	body := requestBody(modelPD, 1024, false)
	s := &Streams{Streams: plan.OpenStreams, Connections: streamConns}
	var open, maxOpen atomic.Int64
	var firstErr sync.Once
	start := time.Now()
	var wg sync.WaitGroup
	for i := range plan.OpenStreams {
		wg.Go(func() {
			err := oneStream(ctx, conns[i%len(conns)], body, i, func() {
				n := open.Add(1)
				for m := maxOpen.Load(); n > m && !maxOpen.CompareAndSwap(m, n); m = maxOpen.Load() {
				}
			})
			if err != nil {
				if atomic.AddInt64(&s.Errors, 1) == 1 {
					firstErr.Do(func() { s.FirstError = err.Error() })
				}
				return
			}
			open.Add(-1)
			atomic.AddInt64(&s.Routed, 1)
		})
	}
	// Every stream is open and waiting for its prefill well before it ends.
	if err := sleep(ctx, plan.ParkedPrefill*3/4); err != nil {
		return err
	}
	heap, herr := liveHeap(ctx, r.pdx.pprofAt)
	rss, rerr := rssBytes(r.pdx.pid())
	if plan.SaveProfile != nil && herr == nil {
		herr = fetchProfile(ctx, "http://"+r.pdx.pprofAt+"/debug/pprof/heap?gc=1", func(b []byte) error {
			return plan.SaveProfile(fmt.Sprintf("heap-streams-%d", plan.OpenStreams), b)
		})
	}
	wg.Wait()
	if herr != nil || rerr != nil {
		return fmt.Errorf("reading pdx memory: %v %v", herr, rerr)
	}
	s.Seconds = time.Since(start).Seconds()
	s.MaxOpen = maxOpen.Load()
	s.HeapMiB, s.RSSMiB = float64(heap)/(1<<20), float64(rss)/(1<<20)
	rep.Streams = s
	if plan.Progress != nil {
		fmt.Fprintf(plan.Progress, "streams   %d over %d connections: %d routed, %d errors, at most %d open at once, live heap %.1f MiB, rss %.1f MiB, %.1fs %s\n",
			s.Streams, s.Connections, s.Routed, s.Errors, s.MaxOpen, s.HeapMiB, s.RSSMiB, s.Seconds, s.FirstError)
	}
	return nil
}

// oneStream plays Envoy for one request: headers, then the buffered body;
// opened is called once pdx has answered the headers.
func oneStream(ctx context.Context, c extprocv3.ExternalProcessorClient, body []byte, i int, opened func()) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	st, err := c.Process(ctx)
	if err != nil {
		return err
	}
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: []byte("/v1/completions")},
		{Key: "x-request-id", RawValue: fmt.Appendf(nil, "stream-%d", i)},
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}},
	}}); err != nil {
		return err
	}
	if _, err := st.Recv(); err != nil {
		return fmt.Errorf("headers answer: %w", err)
	}
	opened()
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true},
	}}); err != nil {
		return err
	}
	resp, err := st.Recv()
	if err != nil {
		return fmt.Errorf("body answer: %w", err)
	}
	if ir := resp.GetImmediateResponse(); ir != nil {
		return fmt.Errorf("pdx answered %d: %s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	for _, h := range resp.GetRequestBody().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "x-gateway-destination-endpoint" {
			return st.CloseSend()
		}
	}
	return fmt.Errorf("body answer without a destination: %v", resp)
}
