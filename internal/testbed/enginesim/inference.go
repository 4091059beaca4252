package enginesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// exchange carries one inference request from arrival to its Record.
type exchange struct {
	seq uint64
	rec Record
	req *inferenceRequest
	w   http.ResponseWriter
	r   *http.Request
	leg any // what the protocol's classify parsed for its serve method
	// rank is the DP rank that serves the request (servingRank).
	rank int
	// headersSent is set once the 200 headers of an SSE answer are out
	// (see openStream): from then on a refusal is an SSE error event.
	headersSent bool
	// work and run, when a protocol sets them, stand in for the request's
	// context: work in the phases where the engine computes or waits
	// without output, run while it generates. SGLang's end with errAborted
	// on /abort_request, and its work context notices a gone client only
	// at its disconnect checks.
	work, run context.Context
	done      []func() // run when the handler returns
}

// workContext is the context of the phases without output.
func (x *exchange) workContext() context.Context {
	if x.work != nil {
		return x.work
	}
	return x.r.Context()
}

// runContext is the context of generation.
func (x *exchange) runContext() context.Context {
	if x.run != nil {
		return x.run
	}
	return x.r.Context()
}

// onDone registers f to run when the request's handler returns.
func (x *exchange) onDone(f func()) { x.done = append(x.done, f) }

func (x *exchange) finish() {
	for _, f := range slices.Backward(x.done) {
		f()
	}
}

// errAborted ends the contexts of a request aborted by SGLang's
// /abort_request.
var errAborted = errors.New("aborted by /abort_request")

func (s *Server) handleInference(a api) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		x := &exchange{
			seq: s.arrive(),
			rec: Record{RequestID: r.Header.Get(headerReqID), Path: r.URL.Path, Headers: headerNames(r.Header)},
			w:   w,
			r:   r,
		}
		defer x.finish()
		body, err := readBody(w, r)
		x.rec.Body = s.recordBody(body)
		if err != nil {
			s.reject(x, badRequest("reading request body: %v", err))
			return
		}
		x.req, err = s.parseRequest(a, body)
		if err != nil {
			s.reject(x, err)
			return
		}
		x.rec.Fingerprint = Fingerprint(x.req.prompt)
		if s.cfg.FailStatus != 0 {
			s.reject(x, &apiError{status: s.cfg.FailStatus, msg: fmt.Sprintf("simulated engine failure (FailStatus %d)", s.cfg.FailStatus)})
			return
		}
		if x.rank, x.rec.DPRankNamed, err = s.servingRank(r, x.req); err != nil {
			s.reject(x, err)
			return
		}
		x.rec.DPRank = x.rank
		m, err := s.proto.classify(x)
		if err != nil {
			s.reject(x, err)
			return
		}
		switch m {
		case modePrefill:
			s.proto.prefill(x)
		case modeDecode:
			s.proto.decode(x)
		default:
			s.servePlain(x)
		}
	}
}

// reject records and answers a refused request: with an error status, or,
// once an SSE answer's headers are out, with an SSE error event (the record
// keeps the status the refusal would have had).
func (s *Server) reject(x *exchange, err error) {
	ae := asAPIError(err)
	x.rec.Kind, x.rec.Status, x.rec.Error = KindRejected, ae.status, ae.msg
	s.commit(x.seq, x.rec)
	if x.headersSent {
		streamError(x.w, ae)
		return
	}
	writeError(x.w, ae)
}

// abandon records a request whose client went away (or whose engine shut
// down) mid-way; there is nobody left to answer.
func (s *Server) abandon(x *exchange, err error) {
	x.rec.Status, x.rec.Error = statusClientGone, "client went away: "+err.Error()
	s.commit(x.seq, x.rec)
}

// interrupted ends a request whose context ctx ended before its answer: an
// SGLang abort finishes it with finish_reason "abort" and the tokens toks
// it had generated (SGLang's FINISH_ABORT without a status code is a normal
// finish); otherwise its client went away or its engine is closing.
func (s *Server) interrupted(x *exchange, ctx context.Context, toks []string) {
	cause := context.Cause(ctx)
	if !errors.Is(cause, errAborted) {
		s.abandon(x, cause)
		return
	}
	x.rec.Error = "aborted by /abort_request"
	if x.req.stream {
		s.stream(x, toks, func(int) time.Duration { return 0 }, "abort")
		return
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, s.answer(x, toks, "abort", nil))
}

func (s *Server) servePlain(x *exchange) {
	x.rec.Kind = KindPlain
	if s.cfg.Role != RolePrefill {
		x.rec.KV = KVRecomputed
		x.w.Header().Set(HeaderKV, KVRecomputed)
	}
	if err := s.computePrompt(x.workContext(), x.req); err != nil {
		s.interrupted(x, x.workContext(), nil)
		return
	}
	s.generate(x)
}

func (s *Server) servePrefill(x *exchange) {
	x.rec.Kind = KindPrefill
	if s.cfg.Role == RoleDecode {
		s.reject(x, badRequest("engine is a KV consumer (role decode) and cannot serve a do_remote_decode prefill request"))
		return
	}
	if err := validatePrefill(x.req, x.rec.RequestID); err != nil {
		s.reject(x, err)
		return
	}
	if f := s.prefillObserver.Load(); f != nil {
		(*f)(x.req.prompt)
	}
	if err := s.computePrompt(x.r.Context(), x.req); err != nil {
		s.abandon(x, err)
		return
	}
	toks, finish := prefillOutput(x, true)
	if !s.awaitPrefillTokens(x, toks) {
		return
	}
	if finish == "stop" {
		// Finished on EOS: request_finished hands nothing off unless the
		// request was length capped, and vLLM answers null params.
		s.answerVLLMPrefill(x, toks, finish, json.RawMessage("null"))
		return
	}
	// Length capped, whatever the limit: NixlConnectorScheduler
	// .request_finished holds the blocks for a decode (nixl_connector.py).
	// A streamed prefill holds them too, though its answer cannot carry
	// the params: they expire unpulled after KVTTL.
	id, blocks := s.kv.allocate(x.rec.Fingerprint, x.rec.RequestID, x.rank, promptTokens(x.req.prompt), time.Now())
	params := s.tampered(mustJSON(issuedKVParams{
		DoRemotePrefill: true,
		RemoteEngineID:  s.engineID(x.rank),
		RemoteBlockIDs:  blocks,
		RemoteRequestID: id,
		RemoteHost:      s.host,
		RemotePort:      s.port,
		TPSize:          1,
		DCPSize:         1,
		PPSize:          1,
		RemoteNumTokens: promptTokens(x.req.prompt),
		TransferMode:    "pull",
	}))
	s.answerVLLMPrefill(x, toks, finish, params)
}

// prefillOutput is what a vLLM prefill leg generates. vLLM has no
// prefill-only request: do_remote_decode only decides what becomes of the
// KV when the request finishes (nixl_connector.py
// NixlConnectorScheduler.request_finished), so a prefill generates up to
// its limit like any request, min_tokens and ignore_eos included. With
// eos, the prompt's eosMarker makes the model emit EOS at the first
// position min_tokens allows (the simulator still renders that token, so
// the text keeps its fingerprint), ending the output with "stop".
func prefillOutput(x *exchange, eos bool) ([]string, string) {
	n, finish := x.req.maxTokens, "length"
	if eos && !x.req.ignoreEOS && strings.Contains(x.req.prompt, eosMarker) {
		if at := x.req.minTokens + 1; at <= n {
			n, finish = at, "stop"
		}
	}
	return outputTokens(x.rec.Fingerprint, n), finish
}

// prefillTokenDelay is the wait before output token i of a prefill leg:
// the first comes with the prompt's computation, the others are decode
// steps.
func (s *Server) prefillTokenDelay(i int) time.Duration {
	switch {
	case i == 0:
		return 0
	case s.load.capa != nil:
		return s.load.step()
	}
	return s.cfg.DecodePerToken
}

// awaitPrefillTokens waits while a prefill leg that answers as JSON
// generates toks; a stream paces its own chunks. It reports false, having
// recorded the request as abandoned, when the client went away: vLLM then
// aborts the request, and an aborted request hands off no KV.
func (s *Server) awaitPrefillTokens(x *exchange, toks []string) bool {
	if x.req.stream {
		return true
	}
	var total time.Duration
	for i := range toks {
		total += s.prefillTokenDelay(i)
	}
	if err := sleep(x.runContext(), total); err != nil {
		s.abandon(x, err)
		return false
	}
	return true
}

// answerVLLMPrefill answers a vLLM prefill leg with toks, ending with
// finish: as JSON carrying kvParams (nil leaves the member out), or as SSE
// when the request streams. A stream carries no kv_transfer_params: vLLM's
// stream generators build chunks without them (chat_completion/serving.py
// chat_completion_stream_generator; ChatCompletionStreamResponse and
// CompletionStreamResponse declare none), only the full generators set
// kv_transfer_params=final_res.kv_transfer_params.
func (s *Server) answerVLLMPrefill(x *exchange, toks []string, finish string, kvParams json.RawMessage) {
	s.countPrefill(x, len(toks))
	if x.req.stream {
		s.stream(x, toks, s.prefillTokenDelay, finish)
		return
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, s.answer(x, toks, finish, kvParams))
}

// countPrefill counts what a router that derives prefills wrongly leaves
// behind: prefill legs that generated more than one token (the client's
// limit kept) and streamed ones (whose answer has no kv_transfer_params).
func (s *Server) countPrefill(x *exchange, tokens int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if tokens > 1 {
		s.longPrefills++
	}
	if x.req.stream {
		s.streamedPrefills++
	}
}

// tampered is params with Config.TamperKVParams' members put over them.
func (s *Server) tampered(params json.RawMessage) json.RawMessage {
	if s.tamper == nil {
		return params
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(params, &m); err != nil {
		return params
	}
	maps.Copy(m, s.tamper)
	return mustJSON(m)
}

func (s *Server) serveDecode(x *exchange) {
	x.rec.Kind = KindDecode
	if s.cfg.Role == RolePrefill {
		s.reject(x, badRequest("engine is a KV producer (role prefill) and cannot serve a do_remote_prefill decode request"))
		return
	}
	src, err := pullSource(x.req.kv)
	if err != nil {
		s.reject(x, err)
		return
	}
	x.rec.KVSource = src
	if x.rec.RequestID == "" {
		s.reject(x, badRequest("missing X-Request-Id header (prefill and decode must share one)"))
		return
	}
	ctx := x.r.Context()
	if err := s.queue(ctx); err != nil {
		s.abortUnscheduled(x, src, err)
		return
	}
	// Once scheduled, the decode reads its blocks whether or not the client
	// stays: vLLM frees an aborted request's KV only when its transfer is
	// done, and the prefill learns of the read from it.
	pctx, cancel := s.detached(ctx)
	done := s.holdSlot()
	pulled, err := s.pullKV(pctx, src, x.req.kv, x.rec.RequestID)
	done()
	cancel()
	switch {
	case ctx.Err() != nil:
		s.abandon(x, ctx.Err())
		return
	case err != nil:
		s.reject(x, err)
		return
	case pulled.Fingerprint != x.rec.Fingerprint:
		s.reject(x, badRequest("KV blocks hold a different prompt: pulled KV has prompt fingerprint %s, this request's prompt has %s",
			pulled.Fingerprint, x.rec.Fingerprint))
		return
	case pulled.RequestID != x.rec.RequestID:
		s.reject(x, badRequest("KV blocks belong to another request: prefilled for X-Request-Id %q, this decode is %q",
			pulled.RequestID, x.rec.RequestID))
		return
	}
	x.rec.KVSourceRank = pulled.Rank
	s.servePulled(x, src)
}

// queue is a decode's wait in vLLM's waiting queue until the scheduler takes
// it (Config.DecodeQueueLatency). The error is the client's, gone, or the
// wait context's when the engine closes.
func (s *Server) queue(ctx context.Context) error {
	if s.cfg.DecodeQueueLatency <= 0 {
		return ctx.Err() // scheduled at once, unless the client is gone already
	}
	s.mu.Lock()
	s.waiting++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.waiting--
		s.mu.Unlock()
	}()
	ctx, cancel := s.waitContext(ctx)
	defer cancel()
	return sleep(ctx, s.cfg.DecodeQueueLatency)
}

// abortUnscheduled ends a decode aborted before it was scheduled, its
// client gone (or its engine closing). vLLM's NixlConnector then reads no
// block but still notifies the prefill, which frees the KV: "the request
// must have been aborted before it was scheduled ... notify and free blocks
// in the prefill instance" (nixl_connector.py request_finished, PR #19223).
func (s *Server) abortUnscheduled(x *exchange, src string, err error) {
	ctx, cancel := s.detached(x.r.Context())
	defer cancel()
	note := fmt.Sprintf("notified the prefill engine at %s to release the KV of remote_request_id %s", src, *x.req.kv.RemoteRequestID)
	var ok struct{}
	if nerr := s.sideCall(ctx, s.client, "the KV release notification to "+src, "http://"+src+"/sim/kv/release", x.rec.RequestID,
		releaseRequest{RemoteEngineID: *x.req.kv.RemoteEngineID, RemoteRequestID: *x.req.kv.RemoteRequestID, RequestID: x.rec.RequestID}, &ok); nerr != nil {
		note = asAPIError(nerr).msg
	}
	if x.r.Context().Err() == nil {
		s.reject(x, &apiError{status: http.StatusServiceUnavailable, msg: "engine is shutting down; " + note})
		return
	}
	x.rec.Status = statusClientGone
	x.rec.Error = "client went away before the request was scheduled: " + err.Error() + "; " + note
	s.commit(x.seq, x.rec)
}

// prefillTime is the simulated cost of computing the prompt's KV.
func (s *Server) prefillTime(req *inferenceRequest) time.Duration {
	return s.cfg.PrefillLatency + time.Duration(promptTokens(req.prompt))*s.cfg.PrefillPerToken
}

// tokenDelay is the wait before output token i (0-based).
func (s *Server) tokenDelay(i int) time.Duration {
	if i == 0 {
		return s.cfg.DecodeLatency
	}
	return s.cfg.DecodePerToken
}

// outputTokens is the deterministic output: the prompt's fingerprint, then
// " t1", " t2", ... up to n tokens.
func outputTokens(fingerprint string, n int) []string {
	toks := make([]string, n)
	toks[0] = "pdx-sim:" + fingerprint
	for i := 1; i < n; i++ {
		toks[i] = " t" + strconv.Itoa(i)
	}
	return toks
}

// generate runs the decode phase and answers, as JSON or as SSE.
func (s *Server) generate(x *exchange) {
	if s.load.capa != nil {
		s.generateBatched(x)
		return
	}
	seat, _ := s.load.admit(x.r.Context(), x.req, s.adapterOf(x.req)) // without Capacity it only counts
	defer seat.leave()
	toks := outputTokens(x.rec.Fingerprint, x.req.maxTokens)
	if x.req.stream {
		s.stream(x, toks, s.tokenDelay, "length")
		return
	}
	var total time.Duration
	for i := range toks {
		total += s.tokenDelay(i)
	}
	ctx, start := x.runContext(), time.Now()
	if err := sleep(ctx, total); err != nil {
		s.interrupted(x, ctx, toks[:s.tokensBy(time.Since(start), len(toks))])
		return
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, s.answer(x, toks, "length", nil))
}

// tokensBy is how many of n output tokens are out after elapsed.
func (s *Server) tokensBy(elapsed time.Duration, n int) int {
	var t time.Duration
	for i := range n {
		if t += s.tokenDelay(i); t > elapsed {
			return i
		}
	}
	return n
}

// answerPrefill answers an SGLang prefill leg at once with its one token,
// as SSE when the request streams, and records it. (vLLM-dialect prefills
// generate up to their limit: answerVLLMPrefill.)
func (s *Server) answerPrefill(x *exchange, finish string) {
	first := outputTokens(x.rec.Fingerprint, 1)
	if x.req.stream {
		s.stream(x, first, func(int) time.Duration { return 0 }, finish)
		return
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, s.answer(x, first, finish, nil))
}

// stream answers with server-sent events, one chunk per token, each after
// delay(i) and flushed as produced so that a client sees the simulated
// inter-token latency; the last chunk has finish as its finish reason.
func (s *Server) stream(x *exchange, toks []string, delay func(int) time.Duration, finish string) {
	switch x.req.api {
	case apiResponses:
		s.streamResponses(x, toks, delay, finish)
		return
	case apiMessages:
		s.streamMessages(x, toks, delay, finish)
		return
	}
	ctx := x.runContext()
	if !x.headersSent {
		x.writeStreamHeader()
	}
	rc := http.NewResponseController(x.w)
	send := func(v any) error {
		if _, err := fmt.Fprintf(x.w, "data: %s\n\n", mustJSON(v)); err != nil {
			return err
		}
		return rc.Flush()
	}
	id, created := s.responseID(x), time.Now().Unix()
	chunk := func(c choice) completionResponse {
		return completionResponse{ID: id, Object: chunkObject(x.req.api), Created: created, Model: x.req.model, Choices: []choice{c}}
	}

	if x.req.api == apiChat {
		if err := send(chunk(choice{Delta: &delta{Role: "assistant", Content: new("")}})); err != nil {
			s.abandon(x, err)
			return
		}
	}
	for i, tok := range toks {
		if err := sleep(ctx, delay(i)); err != nil {
			if !errors.Is(context.Cause(ctx), errAborted) {
				s.abandon(x, context.Cause(ctx))
				return
			}
			toks, finish = toks[:i], "abort"
			break
		}
		if err := send(chunk(tokenChoice(x.req.api, tok, ""))); err != nil {
			s.abandon(x, err)
			return
		}
	}
	if err := send(chunk(tokenChoice(x.req.api, "", finish))); err != nil {
		s.abandon(x, err)
		return
	}
	if x.req.includeUsage {
		u := completionResponse{ID: id, Object: chunkObject(x.req.api), Created: created, Model: x.req.model,
			Choices: []choice{}, Usage: s.usageOf(x, len(toks))}
		if err := send(u); err != nil {
			s.abandon(x, err)
			return
		}
	}
	// Record before the terminator so that a client which has read the whole
	// stream always finds the record.
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	if _, err := fmt.Fprint(x.w, "data: [DONE]\n\n"); err == nil {
		_ = rc.Flush()
	}
}

// writeStreamHeader writes the 200 headers of an SSE answer, declaring
// trailers: the headers among them that are set afterwards are sent after
// the body.
func (x *exchange) writeStreamHeader(trailers ...string) {
	h := x.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	if len(trailers) > 0 {
		h.Set("Trailer", strings.Join(trailers, ", "))
	}
	x.w.WriteHeader(http.StatusOK)
	x.headersSent = true
}

// openStream sends the 200 headers of an SSE answer at once, before its
// content is known, as a server that answers with a stream right away does
// (SGLang's). The error is the client's, gone already.
func (x *exchange) openStream(trailers ...string) error {
	x.writeStreamHeader(trailers...)
	return http.NewResponseController(x.w).Flush()
}

// streamError ends an SSE answer with an error event and the terminator,
// the way SGLang's OpenAI server reports an error mid-stream.
func streamError(w http.ResponseWriter, e *apiError) {
	ev := streamErrorBody{Error: streamErrorDetail{Object: "error", Message: e.msg, Type: errorType(e.status), Code: e.status}}
	if _, err := fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", mustJSON(ev)); err == nil {
		_ = http.NewResponseController(w).Flush()
	}
}

// streamErrorBody is SGLang's SSE error event: its ErrorResponse under
// "error".
type streamErrorBody struct {
	Error streamErrorDetail `json:"error"`
}

type streamErrorDetail struct {
	Object  string  `json:"object"`
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// completionResponse is both a response and a stream chunk of either endpoint;
// the fields left empty are omitted.
type completionResponse struct {
	ID               string          `json:"id"`
	Object           string          `json:"object"`
	Created          int64           `json:"created"`
	Model            string          `json:"model"`
	Choices          []choice        `json:"choices"`
	Usage            *usage          `json:"usage,omitempty"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
	// PromptTokenIDs is a TensorRT-LLM context answer's tokenization of
	// the prompt.
	PromptTokenIDs json.RawMessage `json:"prompt_token_ids,omitempty"`
}

type choice struct {
	Index        int          `json:"index"`
	Message      *chatMessage `json:"message,omitempty"` // chat response
	Delta        *delta       `json:"delta,omitempty"`   // chat chunk
	Text         *string      `json:"text,omitempty"`    // completions
	Logprobs     *struct{}    `json:"logprobs"`          // always null
	FinishReason *string      `json:"finish_reason"`
	// DisaggregatedParams is TensorRT-LLM's, on a context_only answer.
	DisaggregatedParams json.RawMessage `json:"disaggregated_params,omitempty"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type delta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type usage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// usageOf is the usage of an answer with completion output tokens. With
// Config.PromptTokensDetails it has vLLM's prompt_tokens_details, which
// vLLM 0.32 adds whenever --enable-prompt-tokens-details is on, its
// cached_tokens 0 too (the real-engine tier saw it).
//
// Prompt tokens count in the unit of the engine's render API and KV
// events (KVEvents.TokenScale), as a real engine's usage and render agree.
func (s *Server) usageOf(x *exchange, completion int) *usage {
	scale := s.tokenScale()
	p := x.req.promptTokens * scale
	u := &usage{PromptTokens: p, CompletionTokens: completion, TotalTokens: p + completion}
	switch {
	case !s.cfg.PromptTokensDetails:
	case dialectOf(s.cfg.Connector) == dialectVLLM:
		// cached_tokens is vLLM's num_cached_tokens: the prompt tokens the
		// engine's local prefix cache held (the capacity model's hits;
		// none without one). KV a decode pulled from a prefill is not
		// among them: vLLM 0.32 reports 0 for such a decode, and counts
		// its prompt as external_kv_transfer in
		// vllm:prompt_tokens_by_source_total.
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: x.req.cachedTokens * scale}
	case x.rec.KV == KVPulled && p > 1:
		// The other engines' decodes that received their prompt's KV
		// report all of it but the last token, which they recompute to
		// sample the next one (not compared with a real engine here).
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: p - 1}
	case x.req.cachedTokens > 0:
		u.PromptTokensDetails = &promptTokensDetails{CachedTokens: x.req.cachedTokens * scale}
	}
	return u
}

// answer is a whole non-streaming response in the shape of the request's
// API (completion's for chat and completions).
func (s *Server) answer(x *exchange, toks []string, finish string, kvParams json.RawMessage) any {
	switch x.req.api {
	case apiResponses:
		if kvParams == nil {
			kvParams = json.RawMessage("null") // vLLM dumps every field
		}
		return s.responsesAnswer(x, responsesID(x), "msg_"+randomHex(16), time.Now().Unix(), toks, finish, kvParams)
	case apiMessages:
		return s.messagesAnswer(x, toks, finish, kvParams)
	}
	return s.completion(x, toks, finish, kvParams)
}

// completion is a whole non-streaming response. kvParams nil omits the
// kv_transfer_params field; JSON null sends it as null.
func (s *Server) completion(x *exchange, toks []string, finish string, kvParams json.RawMessage) completionResponse {
	text := strings.Join(toks, "")
	c := choice{FinishReason: &finish}
	object := "text_completion"
	if x.req.api == apiChat {
		c.Message = &chatMessage{Role: "assistant", Content: text}
		object = "chat.completion"
	} else {
		c.Text = &text
	}
	return completionResponse{
		ID: s.responseID(x), Object: object, Created: time.Now().Unix(), Model: x.req.model,
		Choices: []choice{c}, Usage: s.usageOf(x, len(toks)), KVTransferParams: kvParams,
	}
}

// tokenChoice is the choice of a stream chunk carrying text (or, with a
// finish reason, ending the choice).
func tokenChoice(a api, text, finish string) choice {
	var c choice
	if finish != "" {
		c.FinishReason = &finish
	}
	if a == apiCompletions {
		c.Text = &text
		return c
	}
	c.Delta = &delta{}
	if text != "" {
		c.Delta.Content = &text
	}
	return c
}

func chunkObject(a api) string {
	if a == apiChat {
		return "chat.completion.chunk"
	}
	return "text_completion"
}

// responseID follows vLLM, which derives the response id from the request id.
func (s *Server) responseID(x *exchange) string {
	rid := x.rec.RequestID
	if rid == "" {
		rid = randomHex(16)
	}
	if x.req.api == apiChat {
		return "chatcmpl-" + rid
	}
	return "cmpl-" + rid
}

// sleep waits for d unless ctx ends first.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// headerNames are the names of h, lower case, sorted.
func headerNames(h http.Header) []string {
	names := make([]string, 0, len(h))
	for k := range h {
		names = append(names, strings.ToLower(k))
	}
	slices.Sort(names)
	return names
}
