package replay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

// oracle is the replay's yardstick: a P/D router in this process that
// reads the simulators' true state (enginesim's forecasts: what each
// engine caches and has queued), which no deployable router can, and
// sends each request's legs itself, as vLLM's P/D proxy does. Per request
// it takes the path with the least forecast time to first token:
//
//   - P/D, through the prefill engine with the least forecast TTFT (the
//     work queued ahead of the prompt, each queued prompt's uncached
//     tokens after what the prompts ahead of it compute, plus its own
//     uncached tokens over the prefill rate, plus the fixed overhead, or
//     beside a decode batch the steps its chunks ride), its first token
//     then a KV pull and a decode step on a decode engine; after the
//     prefill the decode goes to the engine with the least KV pull (the
//     blocks its own cache lacks) plus two decode steps at the batch the
//     sequence joins (its first token and its time per token), preferring
//     an engine that admits it at once;
//   - or, for the oracle-reuse profile (decodeAlone), decode-alone
//     (decode-side reuse): a plain request to the decode
//     engine whose own prefill of the prompt's uncached part, by its
//     cache and prefill queue and beside its decode batch, gives the
//     first token soonest (enginesim's ForecastPlain).
//
// Forecasts closer to the least than one trace block's worth (the prefill
// of 512 real tokens; for a decode, their pull) are ties, broken round
// robin: a shared prefix shorter than a block is the synthesized prompts'
// chat prefix and id digits, not reuse, and spreading new contexts over
// the caches is worth more than that much. Between the paths a tie goes
// to P/D, which leaves the decode batch its steps.
//
// It is greedy on TTFT: the least TTFT for this request, not the placement
// that serves the whole trace best (which might, say, keep a tenant on a
// busy engine to save KV elsewhere), and it does not weigh TPOT: a prompt
// computed on a decode engine lengthens the steps of every sequence
// decoding there, which the report's TPOT shows. It has no Envoy and pdx
// in front: with roundRobin (the direct-round-robin profile) it places as
// pdx's round robin does instead, and the two rows' difference is what
// that path costs apart from placement.
type oracle struct {
	prefill, decode []*enginesim.Server
	// decodeAlone: the oracle-reuse profile, which may take the
	// decode-alone path; else every request goes P/D.
	decodeAlone bool
	// roundRobin: prefills and decodes go round robin, each placement
	// reading nothing and waiting for nothing.
	roundRobin bool
	// decodePick is the decode pick's variant (Profile.OracleDecode): ""
	// for the oracle's own.
	decodePick string
	// prefillTie and decodeTie are the ties' widths.
	prefillTie, decodeTie time.Duration
	client                *http.Client
	srv                   *http.Server
	url                   string
	served                chan struct{}

	// mu serializes placements until the engine picked has queued the
	// prompt, so that the next placement sees it there (see hold).
	mu          sync.Mutex
	nextPrefill int           // where a tie starts, under mu
	nextAlone   int           // likewise for decode-alone, under mu
	nextDecode  atomic.Uint64 // likewise for decodes, which are not serialized
	alone       atomic.Int64  // requests served decode-alone
}

// oracleArrivalWait bounds how long a pick waits for its prompt to reach
// the engine's queue before the next pick goes ahead.
const oracleArrivalWait = time.Second

// nixlPrefillParams is the kv_transfer_params of a NIXL prefill leg, as
// vLLM's P/D proxy and pdx send it.
var nixlPrefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillTie is how close two prefill forecasts are taken as equal: the
// prefill of a trace block (512 real tokens) on engines of capacity c at
// token scale s.
func prefillTie(c enginesim.Capacity, s Scale) time.Duration {
	return time.Duration(float64(s.Tokens(TraceBlockTokens)) / c.PrefillTokensPerSec * float64(time.Second))
}

// startOracle serves the oracle on a loopback port in front of the
// engines, whose capacity is c at token scale s.
func startOracle(ctx context.Context, prefill, decode []*enginesim.Server, c enginesim.Capacity, s Scale, decodeAlone, roundRobin bool, decodePick string) (*oracle, error) {
	if len(prefill) == 0 || len(decode) == 0 {
		return nil, fmt.Errorf("oracle: %d prefill and %d decode engines", len(prefill), len(decode))
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("oracle: listen: %w", err)
	}
	block := s.Tokens(TraceBlockTokens) // simulated tokens of a trace block
	o := &oracle{
		prefill: prefill, decode: decode,
		prefillTie: prefillTie(c, s),
		decodeTie:  time.Duration((block+c.BlockTokens-1)/c.BlockTokens) * c.KVPullPerBlock,
		client:     newClient(), url: "http://" + ln.Addr().String(), served: make(chan struct{}),
		decodeAlone: decodeAlone, roundRobin: roundRobin, decodePick: decodePick,
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", o.serve)
	o.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		defer close(o.served)
		_ = o.srv.Serve(ln) // ErrServerClosed once Close shuts it down
	}()
	return o, nil
}

// URL is where clients send requests.
func (o *oracle) URL() string { return o.url }

// Close stops serving, letting requests in flight finish for a while.
func (o *oracle) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := o.srv.Shutdown(ctx)
	<-o.served
	o.client.CloseIdleConnections()
	return err
}

// oracleRequest is what the oracle reads of a chat request.
type oracleRequest struct {
	Messages  []enginesim.Message `json:"messages"`
	MaxTokens int                 `json:"max_tokens"`
}

// serve places one request (place) and runs its legs, a prefill and a
// decode or a decode engine's plain request, streaming the decode
// engine's answer back.
func (o *oracle) serve(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<20))
	if err != nil {
		http.Error(w, "oracle: reading the body: "+err.Error(), http.StatusBadRequest)
		return
	}
	var req oracleRequest
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, "oracle: "+err.Error(), http.StatusBadRequest)
		return
	}
	if err := json.Unmarshal(body, &fields); err != nil {
		http.Error(w, "oracle: "+err.Error(), http.StatusBadRequest)
		return
	}
	id := r.Header.Get("X-Request-Id")
	if id == "" {
		http.Error(w, "oracle: no X-Request-Id (both legs must carry one)", http.StatusBadRequest)
		return
	}
	prompt := enginesim.ChatPromptText(req.Messages) // the text the engines tokenize
	delete(fields, "kv_transfer_params")
	o.mu.Lock()
	e, alone := o.place(prompt, req.MaxTokens)
	answered := o.hold(e)
	if alone {
		o.alone.Add(1)
		resp, err := o.post(r.Context(), e, id, fields) // a plain request: the engine prefills it
		answered()
		o.answer(w, resp, err)
		return
	}
	var d *enginesim.Server
	if o.decodePick == OracleDecodeEarly {
		d = o.pickDecode(prompt, req.MaxTokens)
	}
	params, err := o.prefillLeg(r.Context(), e, fields, id, answered)
	if err != nil {
		http.Error(w, "oracle: prefill: "+err.Error(), http.StatusBadGateway)
		return
	}
	if params != nil { // nil: the prefill ended on EOS; the decode recomputes
		fields["kv_transfer_params"] = params
	}
	if d == nil {
		d = o.pickDecode(prompt, req.MaxTokens)
	}
	resp, err := o.post(r.Context(), d, id, fields)
	o.answer(w, resp, err)
}

// DecodeAlone is the number of requests served decode-alone so far.
func (o *oracle) DecodeAlone() int64 { return o.alone.Load() }

// answer streams a decode engine's answer back, or the error posting to
// it.
func (o *oracle) answer(w http.ResponseWriter, resp *http.Response, err error) {
	if err != nil {
		http.Error(w, "oracle: decode: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	relay(w, resp)
}

// hold keeps o.mu, which the caller holds, until e's prefill server has
// queued a prompt, or until the function returned is called (e answered),
// or for oracleArrivalWait, so that the next placement's forecast counts
// the prompt: the oracle is the only sender to the engines, so the next
// arrival there is this request's.
func (o *oracle) hold(e *enginesim.Server) (answered func()) {
	if o.roundRobin { // the next placement reads nothing of this one
		o.mu.Unlock()
		return func() {}
	}
	_, queued := e.PrefillArrivals()
	done := make(chan struct{})
	go func() {
		select {
		case <-queued:
		case <-done:
		case <-time.After(oracleArrivalWait):
		}
		o.mu.Unlock()
	}()
	return func() { close(done) }
}

// prefillLeg sends e the one-token, non-streaming prefill leg of a
// request of the client's fields and returns the kv_transfer_params it
// answered (nil for none); answered is called once e has answered.
func (o *oracle) prefillLeg(ctx context.Context, e *enginesim.Server, client map[string]json.RawMessage, id string, answered func()) (json.RawMessage, error) {
	leg := make(map[string]json.RawMessage, len(client)+1)
	for k, v := range client {
		switch k {
		case "stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params":
		default:
			leg[k] = v
		}
	}
	leg["stream"], leg["max_tokens"] = json.RawMessage("false"), json.RawMessage("1")
	if _, ok := client["max_completion_tokens"]; ok {
		leg["max_completion_tokens"] = json.RawMessage("1")
	}
	leg["kv_transfer_params"] = nixlPrefillParams
	resp, err := o.post(ctx, e, id, leg)
	answered()
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("%s: reading the answer: %w", e.Addr(), err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s answered %d: %s", e.Addr(), resp.StatusCode, bytes.TrimSpace(data))
	}
	var answer struct {
		KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(data, &answer); err != nil {
		return nil, fmt.Errorf("%s: %w", e.Addr(), err)
	}
	if p := answer.KVTransferParams; len(p) == 0 || string(p) == "null" {
		return nil, nil
	}
	return answer.KVTransferParams, nil
}

// place picks a request's path, the one whose first token is forecast
// sooner: the prefill engine with the least forecast TTFT, then a KV pull
// and a decode step on the decode engine soonest at that (alone false;
// the decode is picked after the prefill, by pickDecode), or the decode
// engine whose own prefill of the prompt, as a plain request, is soonest
// (alone true). Of ties, the first after the last pick; between the
// paths, P/D. o.mu is held.
func (o *oracle) place(prompt string, maxTokens int) (e *enginesim.Server, alone bool) {
	if o.roundRobin {
		e, o.nextPrefill = o.prefill[o.nextPrefill], (o.nextPrefill+1)%len(o.prefill)
		return e, false
	}
	ttft := make([]time.Duration, len(o.prefill))
	for i, p := range o.prefill {
		ttft[i] = p.ForecastPrefill(prompt).TTFT()
	}
	i := leastOf(ttft, o.nextPrefill, o.prefillTie)
	if !o.decodeAlone {
		o.nextPrefill = (i + 1) % len(o.prefill)
		return o.prefill[i], false
	}
	join := make([]time.Duration, len(o.decode))  // P/D's first token after its prefill
	plain := make([]time.Duration, len(o.decode)) // decode-alone's first token
	for j, d := range o.decode {
		f := d.ForecastDecode(prompt, maxTokens)
		if join[j] = f.Pull + f.Step; !f.Fits {
			join[j] += noPlace
		}
		g := d.ForecastPlain(prompt, maxTokens)
		if plain[j] = g.TTFT(); !g.Fits {
			plain[j] += noPlace
		}
	}
	j := leastOf(plain, o.nextAlone, o.prefillTie)
	if plain[j]+o.prefillTie < ttft[i]+slices.Min(join) {
		o.nextAlone = (j + 1) % len(o.decode)
		return o.decode[j], true
	}
	o.nextPrefill = (i + 1) % len(o.prefill)
	return o.prefill[i], false
}

// noPlace is added to the cost of a decode engine that cannot admit the
// sequence at once, so that any that can comes first (above any prompt's
// cached tokens in OracleDecodeRoomPrefix's cost).
const noPlace = 1 << 20 * time.Hour

// Variants of the oracle's decode pick (Profile.OracleDecode), which take
// its lead on the decode leg apart: each reads the engines' true state as
// the oracle's own does.
const (
	// OracleDecodeEarly is the oracle's pick made when the prefill is
	// placed, before it runs, as pdx's first pick is.
	OracleDecodeEarly = "early"
	// OracleDecodeRoomPrefix: the engines that admit the sequence at once
	// first, then the one caching the most of its prompt, then the one
	// with the fewest sequences running and waiting.
	OracleDecodeRoomPrefix = "room-prefix"
	// OracleDecodeRoomFewest: those that admit it at once first, then the
	// fewest sequences.
	OracleDecodeRoomFewest = "room-fewest"
	// OracleDecodeFewest: the fewest sequences alone.
	OracleDecodeFewest = "fewest"
	// OracleDecodeRoundRobin: in turn, reading nothing.
	OracleDecodeRoundRobin = "round-robin"
)

// pickDecode is the decode engine with the least KV pull plus two decode
// steps for a sequence of prompt, among those that admit it at once if
// any does (or by o.decodePick's variant); ties go round robin.
func (o *oracle) pickDecode(prompt string, maxTokens int) *enginesim.Server {
	if o.roundRobin || o.decodePick == OracleDecodeRoundRobin {
		return o.decode[(o.nextDecode.Add(1)-1)%uint64(len(o.decode))]
	}
	cost := make([]time.Duration, len(o.decode))
	for i, e := range o.decode {
		f := e.ForecastDecode(prompt, maxTokens)
		// The variants' keys in one cost, each far above the next: a
		// second a sequence, an hour a token cached.
		sequences := time.Duration(f.Running+f.Waiting) * time.Second
		switch o.decodePick {
		case OracleDecodeRoomPrefix:
			cost[i] = sequences - time.Duration(f.CachedTokens)*time.Hour
		case OracleDecodeRoomFewest, OracleDecodeFewest:
			cost[i] = sequences
		default:
			cost[i] = f.Pull + 2*f.Step
		}
		if !f.Fits && o.decodePick != OracleDecodeFewest {
			cost[i] += noPlace
		}
	}
	return o.decode[leastOf(cost, int(o.nextDecode.Add(1)%uint64(len(o.decode))), o.decodeTie)]
}

// leastOf is the first index from start on (round) whose cost is within
// tie of the least.
func leastOf(cost []time.Duration, start int, tie time.Duration) int {
	least := slices.Min(cost)
	for k := range cost {
		if i := (start + k) % len(cost); cost[i] <= least+tie {
			return i
		}
	}
	return start // unreachable: the least is within tie of itself
}

// post sends a leg to an engine's chat endpoint.
func (o *oracle) post(ctx context.Context, e *enginesim.Server, id string, fields map[string]json.RawMessage) (*http.Response, error) {
	body, err := json.Marshal(fields)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+e.Addr()+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	resp, err := o.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", e.Addr(), err)
	}
	return resp, nil
}

// relay copies an engine's answer to the client, flushing each read so
// that the stream's chunks keep their timing.
func relay(w http.ResponseWriter, resp *http.Response) {
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		w.Header().Set("Content-Type", ct)
	}
	w.WriteHeader(resp.StatusCode)
	rc := http.NewResponseController(w)
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return // the client went away
			}
			if ferr := rc.Flush(); ferr != nil && !errors.Is(ferr, http.ErrNotSupported) {
				return
			}
		}
		if err != nil {
			return // io.EOF, or the engine cut the stream: the client sees it cut
		}
	}
}
