package enginesim

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// trtllmProtocol is TensorRT-LLM's disaggregated serving, as its disagg
// server drives it (context first): a context_only request to a context
// server, whose answer carries choices[0].disaggregated_params, then the
// client's request with those params (request_type "generation_only") to a
// generation server, which pulls the KV from the context server named in
// them.
type trtllmProtocol struct {
	s    *Server
	ctxs *handoffs // KV of finished context requests, by ctx_request_id
}

func newTRTLLMProtocol(s *Server) *trtllmProtocol {
	return &trtllmProtocol{s: s, ctxs: newHandoffs("ctx_request_id", s.cfg.KVTTL)}
}

// Values of disaggregated_params.request_type.
const (
	trtllmContextOnly    = "context_only"
	trtllmGenerationOnly = "generation_only"
	trtllmBoth           = "context_and_generation"
)

// trtllmParams is a request's disaggregated_params with every member kept as
// its exact JSON text, so that 64-bit ids never pass through float64.
type trtllmParams map[string]json.RawMessage

func (d trtllmParams) has(name string) bool { return !isNull(d[name]) }

func (p *trtllmProtocol) report(st *State, now time.Time) { st.addHandoffs(p.ctxs, now) }

// trtllmFields are the members TensorRT-LLM's DisaggregatedParams declares
// (tensorrt_llm/serve/openai_protocol.py; conversation_id as the disagg
// service of the same era sets it); trtllmLegacyFields those of older
// releases. The model is a pydantic OpenAIBaseModel with extra="forbid":
// any other member is refused.
var (
	trtllmFields = []string{"request_type", "first_gen_tokens", "first_gen_log_probs", "first_gen_logits", "ctx_request_id",
		"encoded_opaque_state", "draft_tokens", "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint", "schedule_style",
		"ctx_usage", "return_prompt_token_ids_b64", "resolved_thinking", "conversation_id"}
	trtllmLegacyFields = []string{"request_type", "first_gen_tokens", "ctx_request_id", "encoded_opaque_state", "draft_tokens"}
)

// extraMembers refuses members of d the server's DisaggregatedParams does not
// declare, as pydantic's extra="forbid" does (null values too).
func (p *trtllmProtocol) extraMembers(d trtllmParams) error {
	declared := trtllmFields
	if p.s.cfg.TRTLLMLegacy {
		declared = trtllmLegacyFields
	}
	var extra []string
	for name := range d {
		if !slices.Contains(declared, name) {
			extra = append(extra, "disaggregated_params."+name)
		}
	}
	if len(extra) == 0 {
		return nil
	}
	slices.Sort(extra)
	return badRequest("%s: extra inputs are not permitted (this TensorRT-LLM server's DisaggregatedParams declares only %s)",
		strings.Join(extra, ", "), strings.Join(declared, ", "))
}

func (p *trtllmProtocol) classify(x *exchange) (mode, error) {
	if err := foreignFields(x.req, ConnectorTRTLLM, "disaggregated_params"); err != nil {
		return modePlain, err
	}
	if _, ok := x.req.fields["prompt_token_ids"]; ok && p.s.cfg.TRTLLMLegacy && x.req.api == apiChat {
		// Before the disagg server relayed the context's token ids, the
		// chat request had no such field, and it forbids extra ones.
		return modePlain, badRequest("prompt_token_ids: extra inputs are not permitted (this TensorRT-LLM server's ChatCompletionRequest does not declare it)")
	}
	if !x.req.has("disaggregated_params") {
		return modePlain, nil
	}
	var d trtllmParams
	if err := x.req.field("disaggregated_params", &d); err != nil {
		return modePlain, err
	}
	if err := p.extraMembers(d); err != nil {
		return modePlain, err
	}
	var typ string
	if err := json.Unmarshal(d["request_type"], &typ); err != nil || typ == "" {
		return modePlain, badRequest("disaggregated_params.request_type must be a string, got %s", orNothing(d["request_type"]))
	}
	x.leg = d
	role := p.s.cfg.Role
	switch typ {
	case trtllmContextOnly:
		if role == RoleDecode {
			return modePlain, badRequest("engine is a generation server (role decode): disaggregated_params.request_type must be %q, got %q",
				trtllmGenerationOnly, typ)
		}
		return modePrefill, nil
	case trtllmGenerationOnly:
		if role == RolePrefill {
			return modePlain, badRequest("engine is a context server (role prefill): disaggregated_params.request_type must be %q, got %q",
				trtllmContextOnly, typ)
		}
		return modeDecode, nil
	case trtllmBoth:
		return modePlain, nil
	}
	return modePlain, badRequest("unknown disaggregated_params.request_type %q (want %s or %s)", typ, trtllmContextOnly, trtllmGenerationOnly)
}

func orNothing(raw json.RawMessage) string {
	if raw == nil {
		return "nothing"
	}
	return string(raw)
}

// trtllmIssued is the disaggregated_params a context server answers with.
type trtllmIssued struct {
	RequestType        string `json:"request_type"`
	FirstGenTokens     []int  `json:"first_gen_tokens"`
	CtxRequestID       uint64 `json:"ctx_request_id"`
	EncodedOpaqueState string `json:"encoded_opaque_state"`
	DraftTokens        []int  `json:"draft_tokens"`
	// DisaggRequestID echoes the request's disagg_request_id, exactly (the
	// disagg service checks that the context answer carries it).
	DisaggRequestID json.RawMessage `json:"disagg_request_id,omitempty"`
}

// intMember checks that a member of d, when set, is a JSON integer, and
// returns its canonical digits ("" when unset); TensorRT-LLM's ids go up
// to 2^63-1, so they are never parsed as float64.
func intMember(d trtllmParams, name string, problems *[]string) string {
	if !d.has(name) {
		return ""
	}
	t, ok := intText(d[name])
	if !ok {
		*problems = append(*problems, "disaggregated_params."+name+" must be an integer, got "+string(d[name]))
	}
	return t
}

func (p *trtllmProtocol) prefill(x *exchange) {
	s := p.s
	x.rec.Kind = KindPrefill
	d := x.leg.(trtllmParams)
	var problems []string
	if x.req.stream {
		problems = append(problems, "stream must be false on a context_only request")
	}
	for _, name := range []string{"ctx_request_id", "first_gen_tokens", "encoded_opaque_state", "draft_tokens"} {
		if d.has(name) {
			problems = append(problems, "disaggregated_params."+name+" must be absent on a context_only request")
		}
	}
	disaggID := intMember(d, "disagg_request_id", &problems)
	if string(d["return_prompt_token_ids_b64"]) == "true" {
		problems = append(problems, "disaggregated_params.return_prompt_token_ids_b64 is not modelled (a simulator limitation, not TensorRT-LLM's)")
	}
	if len(problems) > 0 {
		s.reject(x, badRequest("invalid trtllm context request: %s", strings.Join(problems, "; ")))
		return
	}
	if err := s.computePrompt(x.r.Context(), x.req); err != nil {
		s.abandon(x, err)
		return
	}
	issued := trtllmIssued{
		RequestType:        trtllmContextOnly,
		FirstGenTokens:     []int{firstTokenID(x.rec.Fingerprint)},
		CtxRequestID:       newCtxRequestID(),
		EncodedOpaqueState: base64.StdEncoding.EncodeToString([]byte(s.addr)),
	}
	if disaggID != "" {
		issued.DisaggRequestID = json.RawMessage(disaggID)
	}
	finish := "length"
	if strings.Contains(x.req.prompt, eosMarker) {
		// The context phase finished the request: no KV is kept for a
		// generation server, and the disagg server answers with this.
		finish = "stop"
	} else {
		a := kvAnswer{Fingerprint: x.rec.Fingerprint, RequestID: x.rec.RequestID, Source: s.addr}
		if err := p.ctxs.put(strconv.FormatUint(issued.CtxRequestID, 10), a, time.Now()); err != nil {
			s.reject(x, err)
			return
		}
	}
	resp := s.completion(x, outputTokens(x.rec.Fingerprint, 1), finish, nil)
	resp.Choices[0].DisaggregatedParams = mustJSON(issued)
	if !p.s.cfg.TRTLLMLegacy {
		// The context's tokenization of the prompt, which the disagg
		// server hands the generation server in place of the prompt.
		resp.PromptTokenIDs = mustJSON(tokenize(x.req.prompt))
	}
	x.rec.Status = http.StatusOK
	s.commit(x.seq, x.rec)
	writeJSON(x.w, http.StatusOK, resp)
}

// newCtxRequestID is a random id in [2^62, 2^63): beyond 2^53, so that a
// router passing it through float64 is caught.
func newCtxRequestID() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return 1<<62 | binary.BigEndian.Uint64(b[:])&(1<<62-1)
}

// firstTokenID is the token id of the first output token of a prompt.
func firstTokenID(fingerprint string) int {
	n, _ := strconv.ParseUint(fingerprint[:4], 16, 32)
	return int(n) + 1000
}

// ctxPull is the body of POST /sim/kv/ctx on a context server: the stand-in
// for the generation server's KV transfer from it.
type ctxPull struct {
	CtxRequestID string `json:"ctx_request_id"` // decimal text
}

func (p *trtllmProtocol) addRoutes(mux *http.ServeMux) []string {
	mux.HandleFunc("POST /sim/kv/ctx", p.handleCtx)
	return []string{"/sim/kv/ctx"}
}

func (p *trtllmProtocol) handleCtx(w http.ResponseWriter, r *http.Request) {
	s := p.s
	sr := s.startSide(r, KindKVPull)
	var cp ctxPull
	if ae := sr.readSide(w, r, &cp); ae != nil {
		s.answerSide(w, r, sr, nil, ae)
		return
	}
	a, err := p.ctxs.take(r.Context(), cp.CtxRequestID, sr.rec.RequestID, 0)
	sr.rec.Fingerprint = a.Fingerprint
	s.answerSide(w, r, sr, a, err)
}

func (p *trtllmProtocol) decode(x *exchange) {
	s := p.s
	x.rec.Kind = KindDecode
	d := x.leg.(trtllmParams)
	var problems []string
	id, idOK := intText(d["ctx_request_id"])
	if !idOK {
		problems = append(problems, "disaggregated_params.ctx_request_id must be an integer, got "+orNothing(d["ctx_request_id"]))
	}
	var firstGen []int
	if err := decodeJSON(d["first_gen_tokens"], &firstGen); err != nil || len(firstGen) == 0 {
		problems = append(problems, "disaggregated_params.first_gen_tokens must be a non-empty array of token ids, got "+orNothing(d["first_gen_tokens"]))
	}
	ctxServer, err := opaqueState(d["encoded_opaque_state"])
	if err != nil {
		problems = append(problems, err.Error())
	}
	intMember(d, "disagg_request_id", &problems)
	if d.has("ctx_usage") {
		if n, err := ctxPromptTokens(d["ctx_usage"]); err != nil {
			problems = append(problems, err.Error())
		} else {
			// The generation server reports the context's prompt tokens
			// (rewrite_usage_info_from_ctx, llmapi/disagg_utils.py).
			x.req.promptTokens = n
		}
	}
	if len(problems) > 0 {
		s.reject(x, badRequest("invalid trtllm generation request: %s", strings.Join(problems, "; ")))
		return
	}
	ctx, cancel := s.waitContext(x.r.Context())
	defer cancel()
	var got kvAnswer
	what := "KV transfer of ctx_request_id " + id + " from context server " + ctxServer
	err = s.sideCall(ctx, s.client, what, "http://"+ctxServer+"/sim/kv/ctx", x.rec.RequestID, ctxPull{CtxRequestID: id}, &got)
	if err == nil && got.Fingerprint == x.rec.Fingerprint {
		if want := []int{firstTokenID(got.Fingerprint)}; !slices.Equal(firstGen, want) {
			err = badRequest("disaggregated_params.first_gen_tokens %v differ from those the context server issued, %v", firstGen, want)
		}
	}
	s.finishDecode(x, "ctx_request_id "+id, got, err)
}

// ctxPromptTokens reads the prompt_tokens of a ctx_usage (TensorRT-LLM's
// UsageInfo, prompt_tokens: int = 0).
func ctxPromptTokens(raw json.RawMessage) (int, error) {
	var u map[string]json.RawMessage
	if err := decodeJSON(raw, &u); err != nil || u == nil {
		return 0, fmt.Errorf("disaggregated_params.ctx_usage must be a usage object, got %s", raw)
	}
	if isNull(u["prompt_tokens"]) {
		return 0, nil
	}
	num, ok := jsonNumber(u["prompt_tokens"])
	n, err := strconv.Atoi(num)
	if !ok || err != nil || n < 0 {
		return 0, fmt.Errorf("disaggregated_params.ctx_usage.prompt_tokens must be a non-negative integer, got %s", u["prompt_tokens"])
	}
	return n, nil
}

// intText returns the canonical decimal text of a JSON integer that fits
// int64 or uint64, without going through float64.
func intText(raw json.RawMessage) (string, bool) {
	if t, ok := uintText(raw); ok {
		return t, true
	}
	num, ok := jsonNumber(raw)
	if !ok {
		return "", false
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil {
		return "", false
	}
	return strconv.FormatInt(n, 10), true
}

// opaqueState decodes encoded_opaque_state, which names the context server
// that holds the KV (base64 of its HTTP address).
func opaqueState(raw json.RawMessage) (string, error) {
	var enc string
	if err := json.Unmarshal(raw, &enc); err != nil || enc == "" {
		return "", fmt.Errorf("disaggregated_params.encoded_opaque_state must be a non-empty string, got %s", orNothing(raw))
	}
	b, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return "", fmt.Errorf("disaggregated_params.encoded_opaque_state %q is not base64: %v", enc, err)
	}
	if _, _, err := net.SplitHostPort(string(b)); err != nil {
		return "", fmt.Errorf("disaggregated_params.encoded_opaque_state %q does not name a context server: %v", enc, err)
	}
	return string(b), nil
}
