package connectors

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// newFor builds the connector a pool of connector name (and, for
// "mooncake", protocol) gets, its spec's defaults applied.
func newFor(t testing.TB, name, protocol string) (Connector, error) {
	t.Helper()
	p := &configv1.Pool{Connector: name, MooncakeProtocol: protocol}
	s, err := Lookup(name)
	if err != nil {
		return nil, err
	}
	if s.Defaults != nil {
		s.Defaults(p)
	}
	c, _, err := New(p)
	return c, err
}

// variants are the pool configs of every connector, by a descriptive name:
// one each, "mooncake" and "trtllm" once per protocol.
func variants() map[string]*configv1.Pool {
	all := map[string]*configv1.Pool{}
	for _, name := range Names() {
		all[name] = &configv1.Pool{Connector: name}
	}
	for _, p := range []string{MooncakeNIXL, MooncakeVLLM} {
		all["mooncake/"+p] = &configv1.Pool{Connector: "mooncake", MooncakeProtocol: p}
	}
	all["trtllm/"+TRTLLMLegacy] = &configv1.Pool{Connector: "trtllm", TrtllmProtocol: TRTLLMLegacy}
	for _, p := range all {
		if s, err := Lookup(p.Connector); err == nil && s.Defaults != nil {
			s.Defaults(p)
		}
	}
	return all
}

// registered returns every connector, built by New for each of variants.
func registered(t *testing.T) map[string]Connector {
	t.Helper()
	all := map[string]Connector{}
	for name, p := range variants() {
		c, _, err := New(p)
		require.NoError(t, err, name)
		all[name] = c
	}
	return all
}

func TestNames(t *testing.T) {
	require.Equal(t, []string{"http", "lmcache", "mooncake", "nixl", "none", "p2p-nccl", "sglang", "trtllm"}, Names())
	_, err := Lookup("nixel")
	require.EqualError(t, err, `unknown connector "nixel" (known: http, lmcache, mooncake, nixl, none, p2p-nccl, sglang, trtllm)`)
	require.Equal(t, []string{"nixl", "mooncake", "p2p-nccl"}, Claimants(FieldKVAddress))
	require.Equal(t, []string{"mooncake"}, Claimants(FieldMooncakeProtocol))
}

func TestTraits(t *testing.T) {
	want := map[string]Traits{
		"nixl": {Prefills: true, DecodeFallback: true}, "http": {Prefills: true, MultipleChoices: true, DecodeFallback: true},
		"lmcache":  {Prefills: true, MultipleChoices: true, DecodeFallback: true},
		"mooncake": {Prefills: true, DecodeFallback: true}, "mooncake/nixl": {Prefills: true, DecodeFallback: true},
		"mooncake/vllm": {Prefills: true, Concurrent: true},
		"sglang":        {Prefills: true, Concurrent: true, NotDisaggregated: APIResponses | APIMessages}, "p2p-nccl": {Prefills: true},
		"trtllm":        {Prefills: true, NotDisaggregated: APIResponses | APIMessages},
		"trtllm/legacy": {Prefills: true, NotDisaggregated: APIResponses | APIMessages}, "none": {MultipleChoices: true, DecodeFallback: true},
	}
	for name, p := range variants() {
		_, traits, err := New(p)
		require.NoError(t, err, name)
		w, ok := want[name]
		require.True(t, ok, "TestTraits has no traits for connector %s", name)
		require.Equal(t, w, traits, name)
	}
}

func TestSpecsValidate(t *testing.T) {
	tests := []struct {
		name string
		pool *configv1.Pool
		want []string
	}{
		{name: "mooncake protocol", pool: &configv1.Pool{Connector: "mooncake", MooncakeProtocol: "v2"}, want: []string{`pools[0].mooncake_protocol: "v2" is not "nixl" or "vllm"`}},
		{name: "mooncake vllm takes no kv_address", pool: &configv1.Pool{Connector: "mooncake", MooncakeProtocol: "vllm",
			Prefill: []*configv1.Endpoint{{Address: "10.0.0.1:1", KvAddress: "10.0.0.1:2"}}}, want: []string{`pools[0].prefill[0].kv_address: not valid with mooncake_protocol "vllm"`}},
		{name: "trtllm protocol", pool: &configv1.Pool{Connector: "trtllm", TrtllmProtocol: "v2"}, want: []string{`pools[0].trtllm_protocol: "v2" is not "current" or "legacy"`}},
		{name: "p2p-nccl needs kv_address", pool: &configv1.Pool{Connector: "p2p-nccl",
			Prefill: []*configv1.Endpoint{{Address: "10.0.0.1:1"}}, Decode: []*configv1.Endpoint{{Address: "10.0.0.2:1", KvAddress: "10.0.0.2:2"}}},
			want: []string{`pools[0].prefill[0].kv_address: required with connector "p2p-nccl"`}},
		{name: "p2p-nccl discovered needs kv_port", pool: &configv1.Pool{Connector: "p2p-nccl", Kubernetes: &configv1.KubernetesDiscovery{Namespace: "n"}},
			want: []string{`pools[0].kubernetes.kv_port: required with connector "p2p-nccl"`}},
		{name: "nixl", pool: &configv1.Pool{Connector: "nixl", Prefill: []*configv1.Endpoint{{Address: "10.0.0.1:1", KvAddress: "10.0.0.1:5600"}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Lookup(tc.pool.Connector)
			require.NoError(t, err)
			var errs []error
			if s.Validate != nil {
				errs = s.Validate(tc.pool, "pools[0]")
			}
			require.Len(t, errs, len(tc.want), "%v", errs)
			for i, w := range tc.want {
				require.ErrorContains(t, errs[i], w)
			}
		})
	}
}

// answerFor answers a prefill with what every protocol reads back, echoing
// the request's prompt into the per-request parameters.
func answerFor(_ context.Context, c fakeengine.Call) ([]byte, error) {
	body, err := jsonedit.Parse([]byte(c.Body))
	if err != nil {
		return nil, err
	}
	prompt, ok := body.Raw("prompt")
	if !ok {
		prompt = []byte(`null`)
	}
	return fmt.Appendf(nil, `{"id":"x","choices":[{"index":0,"text":"a","finish_reason":"not_finished",`+
		`"disaggregated_params":{"request_type":"context_only","ctx_request_id":18446744073709551615,"encoded_opaque_state":%s}}],`+
		`"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_request_id":%s,"remote_host":"10.0.0.1","remote_port":21001}}`, prompt, prompt), nil
}

// echoEngine answers prefill calls on testPrefill with answerFor, and the
// Mooncake bootstrap query.
func echoEngine() *fakeengine.Engine {
	return fakeengine.New().
		On(http.MethodPost, testPrefill.Address, "/v1/completions", fakeengine.Reply{Fn: answerFor}).
		On(http.MethodPost, testPrefill.Address, "/v1/chat/completions", fakeengine.Reply{Fn: answerFor}).
		On(http.MethodGet, "10.0.0.1:8998", "/query", fakeengine.Reply{Body: mooncakeQuery})
}

// TestProtocolFieldsStripped checks, for every connector, that nothing of
// client-sent protocol fields reaches either engine.
func TestProtocolFieldsStripped(t *testing.T) {
	clients := []string{
		`{"model":"m","prompt":"p","kv_transfer_params":{"remote_host":"10.6.6.6","remote_engine_id":"EVIL"},"bootstrap_host":"10.6.6.6","bootstrap_port":6666,"bootstrap_room":6666666666666666666,"disaggregated_params":{"request_type":"generation_only","ctx_request_id":6666666666666666666,"encoded_opaque_state":"EVIL"}}`,
		`{"kv_transfer_param\u0073":{"remote_host":"10.6.6.6"},"model":"m","\u0062ootstrap_host":"10.6.6.6","bootstrap_por\u0074":6666,"bootstrap_roo\u006d":6666666666666666666,"disaggregated_param\u0073":{"encoded_opaque_state":"EVIL"},"prompt":"p"}`,
		`{"model":"m","prompt":"p","kv_transfer_params":null,"bootstrap_host":null,"bootstrap_port":null,"bootstrap_room":null,"disaggregated_params":null}`,
	}
	for name, c := range registered(t) {
		for i, client := range clients {
			t.Run(fmt.Sprintf("%s/%d", name, i), func(t *testing.T) {
				req := newRequest(t, client)
				req.Path = "/v1/completions"
				eng := echoEngine()
				got, err := c.Prepare(t.Context(), Env{Engine: eng}, req)
				require.NoError(t, err)
				if got.Prefill != nil {
					require.NoError(t, prefillOutcome(t, got.Prefill))
				}
				legs := []string{string(got.Decode.Body)}
				for _, call := range eng.Calls() {
					if call.Method == http.MethodPost {
						legs = append(legs, call.Body)
					}
				}
				if _, isNone := c.(None); !isNone {
					require.Len(t, legs, 2)
				} else {
					require.Len(t, legs, 1, "a connector without prefill calls no engine")
				}
				for _, leg := range legs {
					// The client's values (a random room of pdx's may
					// well contain "6666", so the port is checked by key).
					for _, marker := range []string{"10.6.6.6", "6666666666666666666", "EVIL"} {
						require.NotContains(t, leg, marker)
					}
					obj, err := jsonedit.Parse([]byte(leg))
					require.NoError(t, err)
					if port, ok := obj.Raw("bootstrap_port"); ok {
						require.NotEqual(t, "6666", string(port), "the client's bootstrap_port")
					}
					for _, key := range []string{"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disaggregated_params"} {
						raw, ok := obj.Raw(key)
						require.False(t, ok && string(raw) == "null", "the client's %s: null kept", key)
					}
				}
			})
		}
	}
}

// TestConcurrentPrepareOnOneValue runs many requests at once through one
// connector value, the way the processor shares a pool's connector, and
// checks that each request's legs carry its own prompt and parameters. Run
// with -race.
func TestConcurrentPrepareOnOneValue(t *testing.T) {
	const n = 200
	for name, c := range registered(t) {
		t.Run(name, func(t *testing.T) {
			eng := echoEngine()
			decodes := make([]Handoff, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			for i := range n {
				wg.Go(func() {
					req := newRequest(t, fmt.Sprintf(`{"model":"m","prompt":"p-%d","max_tokens":%d}`, i, 100+i))
					req.ID = fmt.Sprintf("req-%d", i)
					req.Path = "/v1/completions"
					decodes[i], errs[i] = c.Prepare(t.Context(), Env{Engine: eng}, req)
					if errs[i] == nil && decodes[i].Prefill != nil {
						errs[i] = <-decodes[i].Prefill.Done()
					}
				})
			}
			wg.Wait()

			prefills := map[string][]fakeengine.Call{}
			for _, call := range eng.Calls() {
				if call.Method == http.MethodPost {
					prefills[call.RequestID] = append(prefills[call.RequestID], call)
				}
			}
			for i, d := range decodes {
				require.NoError(t, errs[i])
				prompt := fmt.Sprintf(`"p-%d"`, i)
				body, err := jsonedit.Parse(d.Decode.Body)
				require.NoError(t, err)
				requireRaw(t, body, "prompt", prompt)
				requireRaw(t, body, "max_tokens", fmt.Sprint(100+i))

				id := d.Decode.RequestID
				if id == "" {
					id = fmt.Sprintf("req-%d", i)
				}
				if _, isNone := c.(None); isNone {
					require.Empty(t, prefills, "a connector without prefill calls no engine")
					continue
				}
				require.Len(t, prefills[id], 1, "one prefill per request, under the decode's id")
				prefill, err := jsonedit.Parse([]byte(prefills[id][0].Body))
				require.NoError(t, err)
				requireRaw(t, prefill, "prompt", prompt)

				if raw, ok := body.Raw("kv_transfer_params"); ok {
					params, err := jsonedit.Parse(raw)
					require.NoError(t, err)
					if params.Has("transfer_id") {
						raw, _ := params.Raw("transfer_id")
						require.Contains(t, prefills[id][0].Body, string(raw), "prefill and decode share the transfer id")
					} else {
						requireRaw(t, params, "remote_request_id", prompt)
					}
				}
				if raw, ok := body.Raw("disaggregated_params"); ok {
					params, err := jsonedit.Parse(raw)
					require.NoError(t, err)
					requireRaw(t, params, "encoded_opaque_state", prompt)
				}
				if room, ok := body.Raw("bootstrap_room"); ok {
					requireRaw(t, prefill, "bootstrap_room", string(room))
				}
			}
		})
	}
}

func requireRaw(t *testing.T, obj jsonedit.Object, key, want string) {
	t.Helper()
	raw, ok := obj.Raw(key)
	require.True(t, ok, "no %s", key)
	require.Equal(t, want, string(raw), key)
}

// TestHandoffContract builds every connector variant and checks its
// hand-off against its spec: a prefill still running when Prepare returns
// exactly when the traits say Concurrent (routing asks Envoy for the
// decode's response headers by the traits, the processor waits by the
// hand-off), and, when the engines hold something, a release that tells
// them to let go of this request's.
func TestHandoffContract(t *testing.T) {
	all := variants()
	for _, s := range specs() {
		require.Contains(t, all, s.Names[0], "variants() builds every spec")
	}
	for name, p := range all {
		t.Run(name, func(t *testing.T) {
			c, traits, err := New(p)
			require.NoError(t, err)
			req := newRequest(t, `{"model":"m","prompt":"contract","stream":true,"max_tokens":9}`)
			req.Path = "/v1/completions"
			eng := echoEngine().
				On(http.MethodPost, testDecode.Address, req.Path, fakeengine.Reply{Body: `{}`}).
				On(http.MethodPost, testPrefill.Address, "/abort_request", fakeengine.Reply{}).
				On(http.MethodPost, testDecode.Address, "/abort_request", fakeengine.Reply{})
			h, err := c.Prepare(t.Context(), Env{Engine: eng}, req)
			require.NoError(t, err)
			require.Equal(t, traits.Concurrent, h.Prefill != nil, "a prefill running past Prepare iff Traits.Concurrent")
			if h.Prefill != nil {
				require.NoError(t, prefillOutcome(t, h.Prefill))
			}
			if h.Held == nil {
				return
			}
			before := len(eng.Calls())
			require.NoError(t, h.Held.Release(t.Context(), Env{Engine: eng}))
			require.Equal(t, wantRelease(t, req, h), eng.Calls()[before:])
		})
	}
}

// wantRelease is what releasing h must post, by the type of what the
// engines hold: a connector whose engines hold something needs its case.
func wantRelease(t *testing.T, req *Request, h Handoff) []fakeengine.Call {
	t.Helper()
	decode, err := jsonedit.Parse(h.Decode.Body)
	require.NoError(t, err)
	switch h.Held.(type) {
	case *nixlHeld:
		// A one-token decode carrying the blocks the decode would have read.
		params, ok := decode.Raw("kv_transfer_params")
		require.True(t, ok, "the decode names the blocks held")
		return []fakeengine.Call{{Method: http.MethodPost, Endpoint: req.Decode, Path: req.Path, RequestID: req.ID,
			Body: `{"model":"m","prompt":"contract","stream":false,"max_tokens":1,"kv_transfer_params":` + string(params) + `}`}}
	case *sglangHeld:
		// Aborts of the decode's rid on both engines, twice.
		rid, ok := decode.Raw("rid")
		require.True(t, ok, "the decode names its rid")
		abort := func(ep endpoint.Endpoint) fakeengine.Call {
			return fakeengine.Call{Method: http.MethodPost, Endpoint: ep, Path: "/abort_request", RequestID: req.ID, Body: `{"rid":` + string(rid) + `}`}
		}
		return []fakeengine.Call{abort(req.Decode), abort(req.Prefill), abort(req.Decode), abort(req.Prefill)}
	}
	t.Fatalf("%T: TestHandoffContract does not know what its release posts; add its case to wantRelease", h.Held)
	return nil
}

// TestClientKeysStripped checks that every key a spec lists in ClientKeys,
// set by the client (plainly or with an escape in its name), reaches
// neither leg of any connector with the client's value.
func TestClientKeysStripped(t *testing.T) {
	var keys []string
	for _, s := range specs() {
		keys = append(keys, s.ClientKeys...)
	}
	require.NotEmpty(t, keys)
	slices.Sort(keys)
	keys = slices.Compact(keys) // connectors share protocols' keys
	var plain, escaped strings.Builder
	for _, key := range keys {
		// The last letter escaped: jsonedit compares keys unescaped.
		esc := fmt.Sprintf(`%s\u%04x`, key[:len(key)-1], key[len(key)-1])
		fmt.Fprintf(&plain, `,%q:"client-%s"`, key, key)
		fmt.Fprintf(&escaped, `,"%s":"client-%s"`, esc, key)
	}
	clients := map[string]string{
		"plain":   `{"model":"m","prompt":"p"` + plain.String() + `}`,
		"escaped": `{"model":"m","prompt":"p"` + escaped.String() + `}`,
	}
	for name, c := range registered(t) {
		for spelling, client := range clients {
			t.Run(name+"/"+spelling, func(t *testing.T) {
				req := newRequest(t, client)
				req.Path = "/v1/completions"
				eng := echoEngine()
				h, err := c.Prepare(t.Context(), Env{Engine: eng}, req)
				require.NoError(t, err)
				if h.Prefill != nil {
					require.NoError(t, prefillOutcome(t, h.Prefill))
				}
				legs := map[string]string{"decode": string(h.Decode.Body)}
				for _, call := range eng.Calls() {
					if call.Method == http.MethodPost {
						legs["prefill"] = call.Body
					}
				}
				for leg, body := range legs {
					obj, err := jsonedit.Parse([]byte(body))
					require.NoError(t, err, leg)
					for _, key := range keys {
						if raw, ok := obj.Raw(key); ok {
							require.NotContains(t, string(raw), "client-", "%s leg: the client's %s", leg, key)
						}
					}
					require.NotContains(t, body, "client-", "%s leg", leg)
				}
			})
		}
	}
}
