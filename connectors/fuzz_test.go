package connectors

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// The fuzz targets below drive each connector's Prepare with a fuzzed client
// body (and, where the connector reads one, a fuzzed engine answer) and check
// both legs' bodies against what the protocol allows:
//
//   - a valid JSON object without duplicate keys, as encoding/json reads it;
//   - every field pdx controls (the protocol fields and the prefill-only
//     edits) exactly once with pdx's value, or absent;
//   - no client-sent protocol field, however its key is escaped;
//   - every other client member with its exact bytes, in its order, and
//     nothing else;
//   - bad engine answers fail with an *engines.Error wrapping engines.ErrBadAnswer.
//
// Bodies jsonedit.Parse rejects never reach a connector (the processor
// answers 400), so those inputs end early.
//
// Run one with: go test -run '^$' -fuzz '^FuzzNIXL$' -fuzztime 20s ./connectors/

// fuzzClients are the client bodies every target is seeded with.
var fuzzClients = []string{
	// Chat, streaming.
	`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true,"stream_options":{"include_usage":true}}`,
	// Completion limited by max_completion_tokens, with prefill-only fields.
	`{"model":"m","prompt":"once upon a time","max_completion_tokens":32,"max_tokens":8,"min_tokens":4,"min_completion_tokens":2,"temperature":0.70}`,
	// Escaped spellings of protocol and prefill-only keys.
	`{"kv_transfer_param\u0073":{"remote_host":"10.6.6.6"},"bootstrap_roo\u006d":7,"strea\u006d":true,"max_token\u0073":9,"prompt":"caf\u00e9"}`,
	// Numbers beyond float64.
	`{"seed":18446744073709551615,"bootstrap_room":99999999999999999999,"logit_bias":{"42":-1e2},"n":1e400,"prompt":[1,2,9007199254740993]}`,
	// Protocol keys nested where they mean nothing.
	`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"{\"kv_transfer_params\":1}"}]}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"bootstrap_host":{"type":"string"}}}}}],"extra_body":{"disaggregated_params":{}}}`,
	`{}`,
	// Every protocol field injected by the client.
	`{"model":"m","prompt":"p","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.6.6.6","remote_block_ids":[[1]]},"bootstrap_host":"10.6.6.6","bootstrap_port":1,"bootstrap_room":9223372036854775807,"disaggregated_params":{"request_type":"generation_only","ctx_request_id":1}}`,
	" \n{ \"model\" : \"m\" ,\t\"prompt\":\"p\" , \"stream\" : false, \"max_completion_tokens\" : null }\n",
	// Not a body a connector gets (the last seed, see addPairs).
	`[{"model":"m"}]`,
}

// fuzzNIXLAnswers are prefill answers for the NIXL targets.
var fuzzNIXLAnswers = []string{
	`{"id":"cmpl-1","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[[1,2,3]],"remote_host":"10.0.0.1","remote_port":21001,"tp_size":1}}`,
	`{"id":"cmpl-1","kv_transfer_params":null}`,
	`{"id":"cmpl-1","choices":[]}`,
	`{"kv_transfer_params":[1,2]}`,
	`{"kv_transfer_params":"x"}`,
	`{"kv_transfer_param\u0073" : { "remote_block_ids" : [ 18446744073709551615 ] } }`,
	`{"kv_transfer_params":{},"kv_transfer_param\u0073":{}}`,
	`[]`,
	`{"kv_transfer_params":`,
}

// fuzzQueryAnswers are Mooncake bootstrap /query answers.
var fuzzQueryAnswers = []string{
	`{"0":{"engine_id":"engine-abc","worker_addr":{"0":{"0":"10.0.0.1:7000"}}}}`,
	`{"\u0030":{"engine_id":"e\u0041\"x"},"1":{"engine_id":"e2"}}`,
	`{"1":{"engine_id":"e2"}}`,
	`{"0":{"engine_id":""}}`,
	`{"0":{"engine_id":7}}`,
	`{"0":[{"engine_id":"e"}]}`,
	`{"0":null}`,
	`null`,
}

// fuzzContextAnswers are TensorRT-LLM context answers.
var fuzzContextAnswers = []string{
	`{"id":"c","choices":[{"index":0,"finish_reason":"length","disaggregated_params":{"request_type":"context_only","first_gen_tokens":[29871],"ctx_request_id":18446744073709551615,"encoded_opaque_state":"TQ==","draft_tokens":null}}]}`,
	`{"choices":[ {"finish_reason":"not_finished","disaggregated_params":{ "ctx_request_id" : -1 , "request_typ\u0065" : "context_only" }} ]}`,
	`{"choices":[{"finish_reason":null,"disaggregated_params":{"ctx_request_id":1e3}}]}`,
	`{"choices":[{"finish_reason":"stop","disaggregated_params":{"ctx_request_id":1}}]}`,
	`{"choices":[{"finish_reason":"length"}]}`,
	`{"choices":[{"disaggregated_params":null}]}`,
	`{"choices":[{"disaggregated_params":{"ctx_request_id":"1"}}]}`,
	`{"choices":[{"disaggregated_params":[{"ctx_request_id":1}]}]}`,
	`{"choices":[{"disaggregated_params":{"ctx_request_id":1}},{"disaggregated_params":{"ctx_request_id":2}}]}`,
	`{"choices":null}`,
	`[]`,
}

// addPairs seeds f with every client and every answer, each answer with a
// client a connector gets (all but the last).
func addPairs(f *testing.F, answers []string) {
	valid := fuzzClients[:len(fuzzClients)-1]
	for i := range max(len(valid), len(answers)) {
		f.Add([]byte(valid[i%len(valid)]), []byte(answers[i%len(answers)]))
	}
	f.Add([]byte(fuzzClients[len(fuzzClients)-1]), []byte(answers[0]))
}

func addClients(f *testing.F) {
	for _, c := range fuzzClients {
		f.Add([]byte(c))
	}
}

func FuzzNIXL(f *testing.F) {
	addPairs(f, fuzzNIXLAnswers)
	f.Fuzz(func(t *testing.T, client, answer []byte) { fuzzNIXL(t, NIXL{}, client, answer) })
}

func FuzzMooncakeNIXL(f *testing.F) {
	c, err := newFor(f, "mooncake", MooncakeNIXL)
	if err != nil {
		f.Fatal(err)
	}
	addPairs(f, fuzzNIXLAnswers)
	f.Fuzz(func(t *testing.T, client, answer []byte) { fuzzNIXL(t, c, client, answer) })
}

func FuzzHTTP(f *testing.F) {
	addClients(f)
	f.Fuzz(func(t *testing.T, client []byte) {
		req, cm := fuzzRequest(client)
		if req == nil {
			return
		}
		engine := fakeengine.New().On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: `{"id":"cmpl-1"}`})
		d, err := HTTP{}.Prepare(t.Context(), Env{Engine: engine}, req)
		if err != nil {
			t.Fatalf("Prepare: %v", err)
		}
		p := onePost(t, engine, req.ID)
		checkLeg(t, "prefill", cm, []byte(p.Body), prefillOnlyWant(cm))
		checkLeg(t, "decode", cm, d.Decode.Body, protocolAbsent(cm))
		if d.Decode.RequestID != "" || d.Prefill != nil {
			t.Fatalf("decode %+v: a sequential connector keeps the request id", d)
		}
		// The fallback's body (no prefill) is the same stripped client body.
		if plain := Plain(req.Body); !bytes.Equal(plain, d.Decode.Body) {
			t.Fatalf("Plain %q, HTTP decode %q", plain, d.Decode.Body)
		}
	})
}

func FuzzP2PNCCL(f *testing.F) {
	addClients(f)
	f.Fuzz(func(t *testing.T, client []byte) {
		req, cm := fuzzRequest(client)
		if req == nil {
			return
		}
		engine := fakeengine.New().On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: `{"id":"cmpl-1"}`})
		d, err := P2PNCCL{}.Prepare(t.Context(), Env{Engine: engine}, req)
		if err != nil {
			t.Fatalf("Prepare: %v", err)
		}
		if !p2pID.MatchString(d.Decode.RequestID) {
			t.Fatalf("decode request id %q", d.Decode.RequestID)
		}
		p := onePost(t, engine, d.Decode.RequestID)
		checkLeg(t, "prefill", cm, []byte(p.Body), prefillOnlyWant(cm))
		checkLeg(t, "decode", cm, d.Decode.Body, protocolAbsent(cm))
	})
}

var (
	sglangRoomText = regexp.MustCompile(`^(0|[1-9][0-9]*)$`)
	pdxRID         = regexp.MustCompile(`^"pdx-[0-9a-f]{32}"$`)
)

func FuzzSGLang(f *testing.F) {
	addClients(f)
	f.Fuzz(func(t *testing.T, client []byte) {
		req, cm := fuzzRequest(client)
		if req == nil {
			return
		}
		engine := fakeengine.New().On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: `{"id":"cmpl-1"}`})
		d, err := SGLang{}.Prepare(t.Context(), Env{Engine: engine}, req)
		if err != nil {
			t.Fatalf("Prepare: %v", err)
		}
		if err := fuzzPrefillOutcome(t, d.Prefill); err != nil {
			t.Fatalf("prefill: %v", err)
		}
		p := onePost(t, engine, req.ID)
		if p.Body != string(d.Decode.Body) {
			t.Fatalf("legs differ:\nprefill %q\n decode %q", p.Body, d.Decode.Body)
		}
		room := memberRaw(t, d.Decode.Body, "bootstrap_room")
		if n, err := strconv.ParseInt(string(room), 10, 64); !sglangRoomText.Match(room) || err != nil || n < 0 {
			t.Fatalf("bootstrap_room %q is not an integer in [0, 2^63)", room)
		}
		rid := memberRaw(t, d.Decode.Body, "rid")
		if !pdxRID.Match(rid) {
			t.Fatalf("rid %q is not pdx's", rid)
		}
		want := protocolAbsent(cm)
		want["bootstrap_host"] = []byte(`"10.0.0.1"`)
		want["bootstrap_port"] = []byte(`8998`)
		want["bootstrap_room"] = room
		want["rid"] = rid
		checkLeg(t, "decode", cm, d.Decode.Body, want)
	})
}

var hex32 = regexp.MustCompile(`^[0-9a-f]{32}$`)

func FuzzMooncakeVLLM(f *testing.F) {
	c, err := newFor(f, "mooncake", MooncakeVLLM)
	if err != nil {
		f.Fatal(err)
	}
	addPairs(f, fuzzQueryAnswers)
	f.Fuzz(func(t *testing.T, client, query []byte) {
		req, cm := fuzzRequest(client)
		if req == nil {
			return
		}
		engine := fakeengine.New().
			On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: string(query)}).
			On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: `{"id":"cmpl-1"}`})
		d, err := c.Prepare(t.Context(), Env{Engine: engine}, req)
		engineID := fuzzEngineID(query)
		if engineID == nil {
			requireBadAnswer(t, err, d, query)
			if calls := engine.Calls(); len(calls) != 1 || calls[0].Method != http.MethodGet {
				t.Fatalf("calls after a bad /query answer: %+v", calls)
			}
			return
		}
		if err != nil {
			t.Fatalf("Prepare with /query answer %q: %v", query, err)
		}
		if err := fuzzPrefillOutcome(t, d.Prefill); err != nil {
			t.Fatalf("prefill: %v", err)
		}
		if !hex32.MatchString(d.Decode.RequestID) {
			t.Fatalf("decode request id %q", d.Decode.RequestID)
		}
		p := onePost(t, engine, d.Decode.RequestID)
		transferID := `"xfer-` + d.Decode.RequestID + `"`
		want := prefillOnlyWant(cm)
		want["kv_transfer_params"] = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":` + transferID + `}`)
		checkLeg(t, "prefill", cm, []byte(p.Body), want)
		want = protocolAbsent(cm)
		want["kv_transfer_params"] = []byte(`{"do_remote_decode":false,"do_remote_prefill":true,` +
			`"remote_bootstrap_addr":"http://10.0.0.1:8998","remote_engine_id":` + string(engineID) +
			`,"transfer_id":` + transferID + `}`)
		checkLeg(t, "decode", cm, d.Decode.Body, want)
	})
}

func FuzzTRTLLM(f *testing.F) {
	addPairs(f, fuzzContextAnswers)
	f.Fuzz(func(t *testing.T, client, answer []byte) {
		for _, legacy := range []bool{true, false} {
			fuzzTRTLLM(t, legacy, client, answer)
		}
	})
}

// fuzzTRTLLM checks the TensorRT-LLM connector, legacy or current, for one
// client body and context answer.
func fuzzTRTLLM(t *testing.T, legacy bool, client, answer []byte) {
	req, cm := fuzzRequest(client)
	if req == nil {
		return
	}
	engine := fakeengine.New().On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: string(answer)})
	d, err := TRTLLM{Legacy: legacy}.Prepare(t.Context(), Env{Engine: engine}, req)
	p := onePost(t, engine, req.ID)
	want := protocolAbsent(cm)
	want["stream"] = []byte(`false`)
	want["stream_options"] = nil
	ctxParams := []byte(`{"request_type":"context_only"}`)
	var disaggID []byte
	if !legacy {
		raw := memberRaw(t, []byte(p.Body), "disaggregated_params")
		ms, err := fuzzMembers(raw)
		if err != nil || len(ms) != 2 || ms[0].key != "request_type" || ms[1].key != "disagg_request_id" {
			t.Fatalf("context disaggregated_params %q", raw)
		}
		if n, err := strconv.ParseUint(string(ms[1].raw), 10, 64); err != nil || n < 1<<40 || n >= 1<<63-1 {
			t.Fatalf("disagg_request_id %q out of range", ms[1].raw)
		}
		disaggID, ctxParams = ms[1].raw, raw
	}
	want["disaggregated_params"] = ctxParams
	checkLeg(t, "context", cm, []byte(p.Body), want)

	params, extra, finished, ok := fuzzGenerationParams(answer, legacy, disaggID)
	if !ok {
		requireBadAnswer(t, err, d, answer)
		return
	}
	if err != nil {
		t.Fatalf("Prepare with answer %q: %v", answer, err)
	}
	if finished {
		if d.Decode.Body != nil || d.Answer == nil || d.Answer.ContentType == "" || len(d.Answer.Body) == 0 {
			t.Fatalf("a finished context answer is the client's answer, got %+v", d)
		}
		return
	}
	want = protocolAbsent(cm)
	raw := memberRaw(t, d.Decode.Body, "disaggregated_params")
	got, err := fuzzMembers(raw)
	if err != nil || !slices.EqualFunc(got, params, equalMember) {
		t.Fatalf("generation disaggregated_params %q (%v), want members %q", raw, err, params)
	}
	want["disaggregated_params"] = raw
	for _, m := range extra {
		want[m.key] = m.raw
	}
	checkLeg(t, "generation", cm, d.Decode.Body, want)
	if d.Decode.RequestID != "" || d.Prefill != nil {
		t.Fatalf("decode %+v: a sequential connector keeps the request id", d)
	}
}

// fuzzNIXL checks a NIXL connector (the "nixl" one or "mooncake" with the
// nixl protocol) for one client body and prefill answer.
func fuzzNIXL(t *testing.T, c Connector, client, answer []byte) {
	req, cm := fuzzRequest(client)
	if req == nil {
		return
	}
	engine := fakeengine.New().On(http.MethodPost, testPrefill.Address, fuzzPath, fakeengine.Reply{Body: string(answer)})
	d, err := c.Prepare(t.Context(), Env{Engine: engine}, req)
	p := onePost(t, engine, req.ID)
	want := prefillOnlyWant(cm)
	want["kv_transfer_params"] = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,` +
		`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)
	checkLeg(t, "prefill", cm, []byte(p.Body), want)

	// The answer's kv_transfer_params: an object goes to the decode as
	// is, null or absent leaves the key out, anything else is bad.
	ms, aerr := fuzzMembers(answer)
	kv, found := lookup(ms, "kv_transfer_params")
	if aerr != nil || found && string(kv) != "null" && (kv[0] != '{' || !fuzzKVSourceOK(kv)) {
		requireBadAnswer(t, err, d, answer)
		return
	}
	if err != nil {
		t.Fatalf("Prepare with answer %q: %v", answer, err)
	}
	want = protocolAbsent(cm)
	if found && string(kv) != "null" {
		want["kv_transfer_params"] = kv
	}
	checkLeg(t, "decode", cm, d.Decode.Body, want)
	if d.Decode.RequestID != "" || d.Prefill != nil {
		t.Fatalf("decode %+v: a sequential connector keeps the request id", d)
	}
}

// fuzzKVSourceOK reports whether kv, a kv_transfer_params object, names
// testPrefill's kv_address as the KV source, however the host is written.
func fuzzKVSourceOK(kv []byte) bool {
	ms, err := fuzzMembers(kv)
	if err != nil {
		return false
	}
	rawHost, _ := lookup(ms, "remote_host")
	rawPort, _ := lookup(ms, "remote_port")
	var host string
	if len(rawHost) == 0 || rawHost[0] != '"' || json.Unmarshal(rawHost, &host) != nil {
		return false
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Unmap() == netip.MustParseAddr("10.0.0.1") && string(rawPort) == "21001"
}

const fuzzPath = "/v1/chat/completions"

// fuzzRequest returns the request for a client body and the body's members,
// or nil if jsonedit.Parse rejects the body (the processor answers 400 then).
func fuzzRequest(client []byte) (*Request, []fuzzMember) {
	obj, err := jsonedit.Parse(client)
	if err != nil {
		return nil, nil
	}
	ms, err := fuzzMembers(client)
	if err != nil {
		panic("jsonedit.Parse accepted a body encoding/json reads differently: " + err.Error())
	}
	return &Request{ID: "req-1", Path: fuzzPath, Body: obj, Prefill: testPrefill, Decode: testDecode}, ms
}

// onePost returns the one call engine received, which must be a POST of
// the prefill with requestID.
func onePost(t *testing.T, engine *fakeengine.Engine, requestID string) fakeengine.Call {
	t.Helper()
	var posts []fakeengine.Call
	for _, c := range engine.Calls() {
		if c.Method == http.MethodPost {
			posts = append(posts, c)
		}
	}
	if len(posts) != 1 {
		t.Fatalf("%d prefill POSTs, want 1: %+v", len(posts), posts)
	}
	p := posts[0]
	if p.Endpoint != testPrefill || p.Path != fuzzPath || p.RequestID != requestID {
		t.Fatalf("prefill POST to %+v %s as %q, want %+v %s as %q", p.Endpoint, p.Path, p.RequestID, testPrefill, fuzzPath, requestID)
	}
	return p
}

// fuzzPrefillOutcome waits for a concurrent prefill's outcome.
func fuzzPrefillOutcome(t *testing.T, p Pending) error {
	t.Helper()
	if p == nil {
		t.Fatal("a concurrent connector returns its pending prefill")
	}
	if ch := p.Done(); ch == nil || cap(ch) != 1 {
		t.Fatal("a concurrent connector returns a buffered prefill channel")
	}
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	select {
	case err := <-p.Done():
		select {
		case again := <-p.Done():
			t.Fatalf("a second prefill outcome: %v", again)
		default:
		}
		return err
	case <-timer.C:
		t.Fatal("no prefill outcome")
	}
	return nil
}

// requireBadAnswer checks Prepare's result for an engine answer the
// protocol does not allow.
func requireBadAnswer(t *testing.T, err error, d Handoff, answer []byte) {
	t.Helper()
	ee, ok := errors.AsType[*engines.Error](err)
	if !ok {
		t.Fatalf("Prepare with bad answer %q: %T %v, want an *engines.Error", answer, err, err)
	}
	if ee.Endpoint != testPrefill || !errors.Is(err, engines.ErrBadAnswer) {
		t.Fatalf("Prepare with bad answer %q: %v (endpoint %+v), want engines.ErrBadAnswer from %+v", answer, err, ee.Endpoint, testPrefill)
	}
	if d.Decode.Body != nil || d.Decode.RequestID != "" || d.Prefill != nil {
		t.Fatalf("Prepare failed but returned a decode: %+v", d)
	}
}

// protocolKeys are the members through which engines take KV transfer
// instructions, spelled independently of the package's constants.
var protocolKeys = []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disaggregated_params"}

// protocolAbsent returns the wanted members of a leg of the client body cm
// that carries no protocol field: all absent (nil), and so are the options
// pdx reads that the client set to null.
func protocolAbsent(cm []fuzzMember) map[string][]byte {
	want := make(map[string][]byte, 16)
	for _, k := range protocolKeys {
		want[k] = nil
	}
	for _, k := range []string{"stream", "stream_options", "max_tokens", "max_completion_tokens", "n"} {
		if v, ok := lookup(cm, k); ok && string(v) == "null" {
			want[k] = nil
		}
	}
	return want
}

// prefillOnlyWant returns the wanted members of a one-token, non-streaming
// prefill of the client body cm, without protocol fields.
func prefillOnlyWant(cm []fuzzMember) map[string][]byte {
	want := protocolAbsent(cm)
	want["stream"] = []byte(`false`)
	want["stream_options"] = nil
	want["min_tokens"] = nil
	want["min_completion_tokens"] = nil
	want["max_tokens"] = []byte(`1`)
	if v, ok := lookup(cm, "max_completion_tokens"); ok && string(v) != "null" {
		want["max_completion_tokens"] = []byte(`1`)
	}
	return want
}

// checkLeg checks a leg's body: a JSON object without duplicate keys; the
// members in want exactly with their value, or absent when it is nil; every
// other member of the client body cm unchanged and in order; nothing else.
func checkLeg(t *testing.T, leg string, cm []fuzzMember, body []byte, want map[string][]byte) {
	t.Helper()
	got, err := fuzzMembers(body)
	if err != nil {
		t.Fatalf("%s body %q: %v", leg, body, err)
	}
	obj, err := jsonedit.Parse(body)
	if err != nil || !slices.Equal(obj.Keys(), memberKeys(got)) {
		t.Fatalf("%s body %q: jsonedit reads keys %q (%v), encoding/json %q", leg, body, obj.Keys(), err, memberKeys(got))
	}
	var others []fuzzMember
	for _, m := range got {
		w, controlled := want[m.key]
		switch {
		case !controlled:
			others = append(others, m)
		case w == nil:
			t.Fatalf("%s body %q has %q, which it must not", leg, body, m.key)
		case !bytes.Equal(m.raw, w):
			t.Fatalf("%s body %q has %q = %q, want %q", leg, body, m.key, m.raw, w)
		}
	}
	for k, w := range want {
		if _, ok := lookup(got, k); w != nil && !ok {
			t.Fatalf("%s body %q lacks %q (want %q)", leg, body, k, w)
		}
	}
	var kept []fuzzMember
	for _, m := range cm {
		if _, controlled := want[m.key]; !controlled {
			kept = append(kept, m)
		}
	}
	if !slices.EqualFunc(others, kept, equalMember) {
		t.Fatalf("%s body %q: other members %q, want the client's %q", leg, body, others, kept)
	}
}

// memberRaw returns the raw value of key in body, failing if it is absent.
func memberRaw(t *testing.T, body []byte, key string) []byte {
	t.Helper()
	ms, err := fuzzMembers(body)
	if err != nil {
		t.Fatalf("body %q: %v", body, err)
	}
	raw, ok := lookup(ms, key)
	if !ok {
		t.Fatalf("body %q lacks %q", body, key)
	}
	return raw
}

// fuzzEngineID returns the engine id (a JSON string's bytes) a Mooncake
// /query answer gives for dp rank 0, or nil if the answer gives none.
func fuzzEngineID(query []byte) []byte {
	ranks, err := fuzzMembers(query)
	if err != nil {
		return nil
	}
	raw, ok := lookup(ranks, "0")
	if !ok {
		return nil
	}
	rank, err := fuzzMembers(raw)
	if err != nil {
		return nil
	}
	id, ok := lookup(rank, "engine_id")
	if !ok || id[0] != '"' || string(id) == `""` {
		return nil
	}
	return id
}

// fuzzGenerationParams models trtllmGenerationParams: ok reports an answer
// the protocol allows; finished one that ends the request; params are the
// members the generation's disaggregated_params must have.
func fuzzGenerationParams(answer []byte, legacy bool, disaggID []byte) (params, extra []fuzzMember, finished, ok bool) {
	resp, err := fuzzMembers(answer)
	if err != nil {
		return nil, nil, false, false
	}
	raw, ok := lookup(resp, "choices")
	if !ok || raw[0] != '[' {
		return nil, nil, false, false
	}
	var choices []json.RawMessage
	if err := json.Unmarshal(raw, &choices); err != nil || len(choices) != 1 {
		return nil, nil, false, false
	}
	choice, err := fuzzMembers(choices[0])
	if err != nil {
		return nil, nil, false, false
	}
	if reason, ok := lookup(choice, "finish_reason"); ok && reason[0] == '"' {
		var s string
		if json.Unmarshal(reason, &s) == nil && s != "length" && s != "not_finished" {
			return nil, nil, true, true
		}
	}
	raw, ok = lookup(choice, "disaggregated_params")
	if !ok {
		return nil, nil, false, false
	}
	params, err = fuzzMembers(raw)
	if err != nil {
		return nil, nil, false, false
	}
	if id, ok := lookup(params, "ctx_request_id"); !ok || !bytes.ContainsAny(id[:1], "-0123456789") {
		return nil, nil, false, false
	}
	if e, ok := lookup(params, "ctx_info_endpoint"); ok && string(e) != "null" {
		return nil, nil, false, false // the seeds name no host; a fuzzed one is anywhere
	}
	set := func(key string, v []byte) {
		if i := slices.IndexFunc(params, func(m fuzzMember) bool { return m.key == key }); i >= 0 {
			params[i].raw = v
		} else {
			params = append(params, fuzzMember{key: key, raw: v})
		}
	}
	set("request_type", []byte(`"generation_only"`))
	if legacy {
		return params, nil, false, true
	}
	if usage, ok := lookup(resp, "usage"); ok && string(usage) != "null" {
		set("ctx_usage", usage)
	}
	set("disagg_request_id", disaggID)
	if ids, ok := lookup(resp, "prompt_token_ids"); ok && ids[0] == '[' {
		extra = append(extra, fuzzMember{key: "prompt_token_ids", raw: ids}) // fuzzPath is chat
	}
	return params, extra, false, true
}

// fuzzMember is a top-level member as encoding/json reads it: the unescaped
// key and the value's bytes.
type fuzzMember struct {
	key string
	raw []byte
}

func equalMember(a, b fuzzMember) bool { return a.key == b.key && bytes.Equal(a.raw, b.raw) }

func memberKeys(ms []fuzzMember) []string {
	keys := make([]string, len(ms))
	for i, m := range ms {
		keys[i] = m.key
	}
	return keys
}

func lookup(ms []fuzzMember, key string) ([]byte, bool) {
	for _, m := range ms {
		if m.key == key {
			return m.raw, true
		}
	}
	return nil, false
}

// fuzzMembers reads the top-level members of b with encoding/json, an
// implementation independent of jsonedit. It fails unless b is a JSON object
// whose keys, unescaped, are all different.
func fuzzMembers(b []byte) ([]fuzzMember, error) {
	if !json.Valid(b) {
		return nil, errors.New("not valid JSON")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("not an object")
	}
	ms := []fuzzMember{}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key := tok.(string)
		if seen[key] {
			return nil, errors.New("duplicate key " + strconv.Quote(key))
		}
		seen[key] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		ms = append(ms, fuzzMember{key: key, raw: raw})
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, errors.New("object does not end")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("data after the object")
	}
	return ms, nil
}
