package envoy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterextprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/pdx-router/pdx/envoy"
	"github.com/pdx-router/pdx/internal/testbed/envoyproc"
	"github.com/pdx-router/pdx/internal/testbed/loadtest"
	"github.com/pdx-router/pdx/processor"
)

// BenchmarkEnvoyExchange measures what each shape of the ext_proc exchange
// costs Envoy, in CPU per request: a real Envoy with pdx's bootstrap, an
// ext_proc server that answers as pdx does (or as pdx could) at once, and
// an engine that answers at once. Only Envoy's CPU is counted, at a fixed
// request rate, so that every shape is measured at the same load (Envoy's
// cost per request falls as it gets busier: more events per wake-up), and
// the shapes take turns in short slices, so that this shared machine's
// noise falls on all of them alike. It reports each shape's Envoy CPU per
// request and its ratio to the floor's (Envoy without ext_proc). The
// engine checks each body it gets: a shape that loses the rewritten body
// or the destination fails the benchmark.
//
//	go test -tags vtprotobuf -run '^$' -bench EnvoyExchange -benchtime 3x ./envoy
func BenchmarkEnvoyExchange(b *testing.B) {
	bin, err := envoyproc.Binary()
	if err != nil {
		b.Fatalf("the benchmark needs Envoy: run `make envoy` or set ENVOY_BIN: %v", err)
	}
	rig := startExchangeRig(b, bin)
	for _, size := range []int{1 << 10, 32 << 10} {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			body := benchBody(size)
			cpu := make([]float64, len(exchangeShapes))
			requests := make([]int64, len(exchangeShapes))
			for i := range exchangeShapes {
				rig.slice(b, i, body, time.Second/2) // warm-up, unmeasured
			}
			for b.Loop() {
				for range exchangeRounds {
					for i := range exchangeShapes {
						c, n := rig.slice(b, i, body, exchangeSlice)
						cpu[i] += c
						requests[i] += n
					}
				}
			}
			if bad := rig.engine.bad.Swap(0); bad > 0 {
				b.Fatalf("the engine got %d requests that were not the shape's (last: %v)", bad, rig.engine.lastBad.Load())
			}
			floor := cpu[0] / float64(max(requests[0], 1))
			for i, sh := range exchangeShapes {
				per := cpu[i] / float64(max(requests[i], 1))
				b.ReportMetric(1e6*per, sh.name+"-µs/req")
				if i > 0 {
					b.ReportMetric(per/floor, sh.name+"/floor")
				}
			}
		})
	}
}

// exchangeShape is one way of answering Envoy.
type exchangeShape struct {
	name string
	// envoy is the Envoy that serves the shape: its filter's body mode.
	envoy string
	// atHeaders routes at the headers and switches the body phase off
	// (pdx's pass-through of a request without a body); no ext_proc is
	// the floor.
	atHeaders bool
	// replace sends a rewritten body back (every connector with a prefill
	// leg does); otherwise Envoy keeps the client's.
	replace bool
	// removeAtHeaders answers the headers with the removal of the
	// client's routing headers, as pdx does; otherwise the body's answer
	// removes them.
	removeAtHeaders bool
	// metadata sends the decode endpoint and request id as dynamic
	// metadata, as pdx does.
	metadata bool
	// hold asks for the response headers (a concurrent connector's
	// prefill may still fail the request); detach ends the stream once
	// routed (pdx holds it until the response ends, to count the decode
	// endpoint's in-flight requests exactly).
	hold, detach bool
}

const (
	envoyFloor    = "floor"
	envoyBuffered = envoy.BodyBuffered
	envoyDuplex   = envoy.BodyFullDuplexStreamed
)

var exchangeShapes = []exchangeShape{
	{name: "floor", envoy: envoyFloor},
	{name: "headers-only", envoy: envoyBuffered, atHeaders: true, metadata: true, detach: true},
	{name: "buffered-body-kept", envoy: envoyBuffered, removeAtHeaders: true, metadata: true},
	{name: "buffered-body-replaced", envoy: envoyBuffered, replace: true, removeAtHeaders: true, metadata: true},
	{name: "buffered-replaced-one-mutation", envoy: envoyBuffered, replace: true, metadata: true},
	{name: "buffered-replaced-no-metadata", envoy: envoyBuffered, replace: true, removeAtHeaders: true},
	{name: "buffered-replaced-detached", envoy: envoyBuffered, replace: true, removeAtHeaders: true, metadata: true, detach: true},
	{name: "buffered-replaced-held", envoy: envoyBuffered, replace: true, removeAtHeaders: true, metadata: true, hold: true},
	{name: "duplex-body-replaced", envoy: envoyDuplex, replace: true, metadata: true, detach: true},
}

const (
	exchangeRate    = 800 // requests a second, below every shape's capacity here
	exchangeClients = 64
	// Each shape gets exchangeRounds slices per iteration; /proc counts CPU
	// in 10 ms ticks, a few in each slice.
	exchangeRounds = 6
	exchangeSlice  = 400 * time.Millisecond
	// replacedMarker is what the rewritten body carries, as a decode body
	// carries its kv_transfer_params.
	replacedMarker = `"kv_transfer_params":{"remote_engine_id":"bench"},`
)

type exchangeRig struct {
	engine *benchEngine
	proc   *benchProcessor
	envoys map[string]*envoyproc.Process
	client *http.Client
}

func startExchangeRig(b *testing.B, bin string) *exchangeRig {
	r := &exchangeRig{engine: startBenchEngine(b), envoys: map[string]*envoyproc.Process{}}
	r.proc = startBenchProcessor(b, r.engine.addr)
	for _, mode := range []string{envoyFloor, envoyBuffered, envoyDuplex} {
		cfg := envoy.Config{PdxAddress: r.proc.addr, WithoutExtProc: mode == envoyFloor}
		if mode == envoyDuplex {
			cfg.RequestBodyMode = envoy.BodyFullDuplexStreamed
		}
		p, err := envoyproc.Start(b.Context(), bin, cfg, nil)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = p.Stop() })
		r.envoys[mode] = p
	}
	r.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: exchangeClients, MaxConnsPerHost: exchangeClients}}
	b.Cleanup(r.client.CloseIdleConnections)
	return r
}

// slice sends shape i's requests for d and returns the CPU seconds its
// Envoy took and the requests the engine checked.
func (r *exchangeRig) slice(b *testing.B, i int, body []byte, d time.Duration) (cpu float64, requests int64) {
	sh := &exchangeShapes[i]
	r.proc.shape.Store(sh)
	want := &engineWant{replaced: sh.replace, size: len(body)}
	if sh.replace {
		want.size += len(replacedMarker)
	}
	r.engine.want.Store(want)
	target := r.envoys[sh.envoy]
	url := target.URL() + "/v1/completions"
	c0, n0 := cpuSeconds(b, target.Pid()), r.engine.ok.Load()
	if err := paced(b.Context(), func() error { return r.post(url, body, sh.envoy == envoyFloor) }, d); err != nil {
		b.Fatalf("%s: %v", sh.name, err)
	}
	return cpuSeconds(b, target.Pid()) - c0, r.engine.ok.Load() - n0
}

func (r *exchangeRig) post(url string, body []byte, floor bool) error {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("content-type", "application/json")
	if floor {
		// Envoy alone: the client names the engine.
		req.Header.Set("x-gateway-destination-endpoint", r.engine.addr)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %s", resp.Status)
	}
	return err
}

// paced calls send exchangeRate times a second for d, from at most
// exchangeClients goroutines, and returns the first error.
func paced(ctx context.Context, send func() error, d time.Duration) error {
	var wg sync.WaitGroup
	var first atomic.Pointer[error]
	slots := make(chan struct{}, exchangeClients)
	tick := time.NewTicker(time.Second / exchangeRate)
	defer tick.Stop()
	for end := time.Now().Add(d); time.Now().Before(end); {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		select {
		case slots <- struct{}{}:
		default:
			continue // every client is busy: this request is not sent
		}
		wg.Go(func() {
			defer func() { <-slots }()
			if err := send(); err != nil {
				first.CompareAndSwap(nil, &err)
			}
		})
	}
	wg.Wait()
	if err := first.Load(); err != nil {
		return *err
	}
	return nil
}

func benchBody(size int) []byte {
	const head, tail = `{"model":"m","max_tokens":8,"prompt":"`, `"}`
	return []byte(head + strings.Repeat("a", max(size-len(head)-len(tail), 0)) + tail)
}

func cpuSeconds(b *testing.B, pid int) float64 {
	s, err := loadtest.CPUSeconds(pid)
	if err != nil {
		b.Fatal(err)
	}
	return s
}

// benchEngine answers every request at once, after checking its body.
type benchEngine struct {
	addr    string
	want    atomic.Pointer[engineWant]
	ok, bad atomic.Int64
	lastBad atomic.Value
}

type engineWant struct {
	replaced bool
	size     int
}

func startBenchEngine(b *testing.B) *benchEngine {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	e := &benchEngine{addr: ln.Addr().String()}
	answer := []byte(`{"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}]}`)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, err := io.ReadAll(r.Body)
		want := e.want.Load()
		switch {
		case err != nil:
			e.fail(err)
		case len(got) != want.size || bytes.Contains(got, []byte(replacedMarker)) != want.replaced:
			e.fail(fmt.Errorf("body of %d bytes, replaced %v; want %d, %v", len(got), bytes.Contains(got, []byte(replacedMarker)), want.size, want.replaced))
		case r.Header.Get("x-gateway-destination-endpoint") != e.addr:
			e.fail(fmt.Errorf("destination %q", r.Header.Get("x-gateway-destination-endpoint")))
		default:
			e.ok.Add(1)
		}
		w.Header().Set("content-type", "application/json")
		w.Header().Set("content-length", strconv.Itoa(len(answer)))
		_, _ = w.Write(answer)
	}), ReadHeaderTimeout: time.Minute}
	go func() { _ = srv.Serve(ln) }()
	b.Cleanup(func() { _ = srv.Close() })
	return e
}

func (e *benchEngine) fail(err error) {
	e.bad.Add(1)
	e.lastBad.Store(err)
}

// benchProcessor answers every stream in the current shape, at once.
type benchProcessor struct {
	extprocv3.UnimplementedExternalProcessorServer
	addr, engine string
	shape        atomic.Pointer[exchangeShape]
}

func startBenchProcessor(b *testing.B, engine string) *benchProcessor {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	p := &benchProcessor{addr: ln.Addr().String(), engine: engine}
	srv := grpc.NewServer(grpc.InitialWindowSize(16<<20), grpc.InitialConnWindowSize(64<<20))
	extprocv3.RegisterExternalProcessorServer(srv, p)
	hs := health.NewServer()
	hs.SetServingStatus("envoy.service.ext_proc.v3.ExternalProcessor", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	go func() { _ = srv.Serve(ln) }()
	b.Cleanup(srv.Stop)
	return p
}

// The answers below are pdx's (processor/mutation.go), built here so that
// each part of them can be left out.

// clientRouting are the headers pdx removes from every request
// (processor's clientRoutingHeaders: the two older spellings are its
// unexported ones).
var clientRouting = []string{processor.DestinationHeader, processor.RankHeader,
	processor.ObjectiveHeader, "x-gateway-inference-objective", processor.FairnessHeader, "x-gateway-inference-fairness-id", processor.SLOTTFTHeader}

func (p *benchProcessor) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	sh := p.shape.Load()
	var body []byte
	routed := false
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		var resp []*extprocv3.ProcessingResponse
		switch m := msg.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			switch {
			case sh.atHeaders:
				resp, routed = append(resp, p.routed(sh, nil, true)), true
			case sh.envoy == envoyDuplex:
				// The answer waits for the body.
			default:
				h := &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}
				if sh.removeAtHeaders {
					h.Response.HeaderMutation = &extprocv3.HeaderMutation{RemoveHeaders: clientRouting}
				}
				r := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: h}}
				if sh.hold {
					r.ModeOverride = &filterextprocv3.ProcessingMode{
						RequestHeaderMode: filterextprocv3.ProcessingMode_SEND, RequestBodyMode: filterextprocv3.ProcessingMode_BUFFERED,
						ResponseHeaderMode: filterextprocv3.ProcessingMode_SEND, ResponseBodyMode: filterextprocv3.ProcessingMode_NONE,
						RequestTrailerMode: filterextprocv3.ProcessingMode_SKIP, ResponseTrailerMode: filterextprocv3.ProcessingMode_SKIP,
					}
				}
				resp = append(resp, r)
			}
		case *extprocv3.ProcessingRequest_RequestBody:
			body = append(body, m.RequestBody.GetBody()...)
			if !m.RequestBody.GetEndOfStream() {
				continue
			}
			out := body
			if sh.replace {
				// The decode body: a field added, as a connector adds its
				// kv_transfer_params.
				out = append([]byte(`{`+replacedMarker), body[1:]...)
			}
			routed = true
			if sh.envoy == envoyDuplex {
				resp = append(resp, p.routed(sh, out, true),
					&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
						Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
							StreamedResponse: &extprocv3.StreamedBodyResponse{Body: out, EndOfStream: true}}}}}}})
			} else {
				resp = append(resp, p.routed(sh, out, false))
			}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			resp = append(resp, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			resp = append(resp, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}})
		}
		for _, r := range resp {
			if err := stream.Send(r); err != nil {
				return err
			}
		}
		if sh.detach && routed || sh.hold && msg.GetResponseHeaders() != nil {
			return nil
		}
	}
}

// routed is pdx's routing answer: the decode endpoint, content-length and
// request id as headers, the endpoint and the client's request id as
// metadata, and the decode body unless it is the client's. atHeaders
// answers the headers (FULL_DUPLEX_STREAMED, or a request routed at its
// headers), else the buffered body.
func (p *benchProcessor) routed(sh *exchangeShape, body []byte, atHeaders bool) *extprocv3.ProcessingResponse {
	set := []*corev3.HeaderValueOption{
		benchHeader("x-gateway-destination-endpoint", p.engine),
		benchHeader("x-request-id", "0b9a7c52-5d0e-4c55-9a3e-2f3f0c7c1d11"),
	}
	if body != nil {
		set = append(set, benchHeader("content-length", strconv.Itoa(len(body))))
	}
	common := &extprocv3.CommonResponse{HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}}
	if !sh.removeAtHeaders || atHeaders {
		common.HeaderMutation.RemoveHeaders = clientRouting
	}
	var resp *extprocv3.ProcessingResponse
	if atHeaders {
		resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}
		if sh.atHeaders {
			resp.ModeOverride = &filterextprocv3.ProcessingMode{
				RequestHeaderMode: filterextprocv3.ProcessingMode_SEND, RequestBodyMode: filterextprocv3.ProcessingMode_NONE,
				ResponseHeaderMode: filterextprocv3.ProcessingMode_SKIP, ResponseBodyMode: filterextprocv3.ProcessingMode_NONE,
				RequestTrailerMode: filterextprocv3.ProcessingMode_SKIP, ResponseTrailerMode: filterextprocv3.ProcessingMode_SKIP,
			}
		}
	} else {
		if sh.replace {
			common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
		}
		resp = &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: common}}}
	}
	if sh.metadata {
		resp.DynamicMetadata = &structpb.Struct{Fields: map[string]*structpb.Value{
			"envoy.lb": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				"x-gateway-destination-endpoint": structpb.NewStringValue(p.engine),
			}}),
			"pdx": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
				"request_id": structpb.NewStringValue("client-id"),
			}}),
		}}
	}
	return resp
}

func benchHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}
