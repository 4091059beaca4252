// Package e2e tests pdx the way it runs: a real Envoy binary in front, pdx
// as its ext_proc service over real gRPC, and simulated vLLM engines that
// check every KV hand-off themselves.
package e2e

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/engines"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// zmq4's PUB writer goroutine outlives its socket's Close (a simulator
// publishing KV events); it holds nothing of a test's.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

// startStack runs Envoy, pdx and the engines for one test. Their logs are
// printed only if the test fails.
func startStack(t *testing.T, opts stack.Options) *stack.Stack {
	t.Helper()
	st, err := stack.Start(context.Background(), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(st.Logs())
		}
		assert.NoError(t, st.Close())
	})
	return st
}

// newClient returns an OpenAI client for the stack, with its own connection
// pool that is closed when the test ends.
func newClient(t *testing.T, st *stack.Stack) (openai.Client, *http.Client) {
	t.Helper()
	hc := &http.Client{Transport: engines.NewTransport(), Timeout: 2 * time.Minute}
	t.Cleanup(hc.CloseIdleConnections)
	return openai.NewClient(
		option.WithBaseURL(st.URL()+"/v1/"),
		option.WithAPIKey("unused"),
		option.WithHTTPClient(hc),
		option.WithMaxRetries(0),
	), hc
}

var ids atomic.Int64

// newRequestID makes a request id unique within the test binary, so that
// engine records can be matched to the request that caused them.
func newRequestID(t *testing.T) string {
	return fmt.Sprintf("%s-%d", t.Name(), ids.Add(1))
}

// connectorCase is a connector protocol every end-to-end behaviour is
// checked with, against engines speaking it.
type connectorCase struct {
	name string
	opts stack.Options
}

// protocolCases are the connectors checked once per protocol, by name;
// every other connector is checked once, with its defaults.
var protocolCases = map[string][]connectorCase{
	"mooncake": {
		{"mooncake-nixl", stack.Options{Connector: "mooncake"}},
		{"mooncake-vllm", stack.Options{Connector: "mooncake", MooncakeProtocol: "vllm"}},
	},
}

// connectorCases are every registered connector with a prefill leg (one
// without has no KV hand-off to check), from the connectors' registry: a
// new connector runs here as soon as the simulator speaks its protocol.
func connectorCases(t *testing.T) []connectorCase {
	t.Helper()
	for name := range protocolCases {
		_, err := connectors.Lookup(name)
		require.NoError(t, err, "protocolCases")
	}
	var cases []connectorCase
	for _, name := range connectors.Names() {
		spec, err := connectors.Lookup(name)
		require.NoError(t, err)
		pool := &configv1.Pool{Connector: name}
		if spec.Defaults != nil {
			spec.Defaults(pool)
		}
		if spec.Names[0] != name || !spec.Traits(pool).Prefills {
			continue // an alias, or aggregated engines
		}
		require.Contains(t, enginesim.Connectors(), name,
			"connector %q has no engine simulator protocol: add its file and its line in protocols (internal/testbed/enginesim/protocol.go)", name)
		if pc, ok := protocolCases[name]; ok {
			cases = append(cases, pc...)
			continue
		}
		cases = append(cases, connectorCase{name, stack.Options{Connector: name}})
	}
	return cases
}

func recordsWhere(st *stack.Stack, keep func(enginesim.Record) bool) map[string][]recordAt {
	out := map[string][]recordAt{}
	for _, e := range st.Engines() {
		for _, r := range e.Records() {
			if keep(r) {
				out[r.Kind] = append(out[r.Kind], recordAt{Record: r, Engine: e.Addr()})
			}
		}
	}
	return out
}

type recordAt struct {
	enginesim.Record
	Engine string
}

// requireHandoff checks, from the engines' own records, that the prompt (unique
// within its test) had exactly one prefill and one decode, and that the
// decode got the KV of that very prefill. Prompts, not request ids, identify
// requests: P2P NCCL rewrites the id.
func requireHandoff(t *testing.T, st *stack.Stack, promptText string) {
	t.Helper()
	fp := enginesim.Fingerprint(promptText)
	recs := recordsWhere(st, func(r enginesim.Record) bool { return r.Fingerprint == fp })
	requireOneHandoff(t, st, fp, recs)
}

func requireOneHandoff(t *testing.T, st *stack.Stack, fp string, recs map[string][]recordAt) {
	t.Helper()
	require.Len(t, recs["prefill"], 1, "one prefill for %s: %v", fp, recs)
	require.Len(t, recs["decode"], 1, "one decode for %s: %v", fp, recs)
	require.Empty(t, recs["rejected"], "no engine rejected %s", fp)
	require.Empty(t, recs["plain"], "no recomputation for %s", fp)
	p, d := recs["prefill"][0], recs["decode"][0]
	require.Equal(t, "pulled", d.KV, fp)
	require.Equal(t, p.Engine, d.KVSource, "decode of %s got the KV of the prefill that ran it", fp)
	require.True(t, isEngine(st.Prefill, p.Engine), "prefill ran on a prefill engine")
	require.True(t, isEngine(st.Decode, d.Engine), "decode ran on a decode engine")
	// vLLM serves a prefill with a limit other than 1, or streamed, so the
	// simulator does too and only counts it: pdx must send neither.
	for _, e := range st.Prefill {
		if e.Addr() == p.Engine {
			state := e.State()
			require.Zero(t, state.LongPrefills, "prefill engine %s generated more than one token on a prefill", p.Engine)
			require.Zero(t, state.StreamedPrefills, "prefill engine %s streamed a prefill", p.Engine)
		}
	}
}

func isEngine(engines []*enginesim.Server, addr string) bool {
	for _, e := range engines {
		if e.Addr() == addr {
			return true
		}
	}
	return false
}

func chatPrompt(text string) string {
	return enginesim.ChatPromptText([]enginesim.Message{{Role: "user", Content: text}})
}

func wantPrefix(promptText string) string { return "pdx-sim:" + enginesim.Fingerprint(promptText) }
