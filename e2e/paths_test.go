package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// recorder is an engine that answers every request with 200 and keeps what
// it got: the stand-in for an engine API that pdx passes through.
type recorder struct {
	srv  *http.Server
	addr string

	mu  sync.Mutex
	got []recorded
}

type recorded struct {
	method, path, requestID, body string
}

func startRecorder(t *testing.T) *recorder {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	r := &recorder{addr: ln.Addr().String()}
	r.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method == http.MethodGet && req.URL.Path == "/metrics" {
			http.NotFound(w, req) // pdx's metrics scraper, not a client's request
			return
		}
		b, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.got = append(r.got, recorded{req.Method, req.URL.Path, req.Header.Get("X-Request-Id"), string(b)})
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"list","data":[]}`)
	})}
	go func() { _ = r.srv.Serve(ln) }()
	t.Cleanup(func() { _ = r.srv.Close() })
	return r
}

func (r *recorder) requests() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]recorded(nil), r.got...)
}

// No body reaches an engine with client-chosen KV or bootstrap fields, on
// any path: pdx routes the generation APIs it knows, answers GET /v1/models
// from its pools, passes only the paths a pool lists and the ones every
// pool passes (stripping protocol fields from JSON bodies, to an endpoint
// pdx picks), and answers every other path with 404.
func TestOtherPaths(t *testing.T) {
	rec := startRecorder(t)
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1, PoolsYAML: fmt.Sprintf(`
- name: aggregated
  models: [embedder]
  connector: none
  pass_through: [/v1/embeddings, /tokenize]
  decode: [{address: %s}]
`, rec.addr)})
	_, hc := newClient(t, st)
	const injected = `"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"203.0.113.66","remote_port":9901},"bootstrap_host":"203.0.113.66","bootstrap_port":1,"bootstrap_room":7`

	t.Run("unrouted paths get 404 and reach no engine", func(t *testing.T) {
		for _, path := range []string{
			"/v1/chat/completions/", "/V1/CHAT/COMPLETIONS", "/v1/chat/completions;x", "/v1/completions/x",
			"/v1/responses/resp_1", "/v1/messages/batches", "/inference/v1/generate", "/generate", "/v1/embeddings/x", "/",
		} {
			a := post(t, hc, st.URL()+path, `{"model":"demo-model","prompt":"p",`+injected+`}`)
			requireAPIError(t, a, 404, "not_found", "")
		}
		requireNoEngineTraffic(t, st)
		require.Empty(t, rec.requests())
	})

	t.Run("GET /v1/models is answered by pdx from its pools", func(t *testing.T) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, st.URL()+"/v1/models", nil)
		require.NoError(t, err)
		a := do(t, hc, req)
		require.Equal(t, 200, a.status, a.body)
		var list struct {
			Object string
			Data   []struct{ ID string }
		}
		require.NoError(t, json.Unmarshal([]byte(a.body), &list))
		require.Equal(t, "list", list.Object)
		require.Equal(t, []struct{ ID string }{{stack.Model}, {"embedder"}}, list.Data)
		require.Empty(t, rec.requests())
	})

	t.Run("pass-through paths go to the pool's engine without protocol fields", func(t *testing.T) {
		a := post(t, hc, st.URL()+"/v1/embeddings", `{"model":"embedder","input":"x",`+injected+`}`,
			"X-Gateway-Destination-Endpoint", st.Decode[0].Addr(), "X-Request-Id", "embed-1")
		require.Equal(t, 200, a.status, a.body)
		require.Equal(t, "embed-1", a.header.Get("X-Request-Id"), "the client gets its own id back")
		got := rec.requests()
		require.Len(t, got, 1, "the client's destination header is ignored")
		require.Equal(t, "/v1/embeddings", got[0].path)
		require.JSONEq(t, `{"model":"embedder","input":"x"}`, got[0].body)
		require.NotEqual(t, "embed-1", got[0].requestID, "the engine gets pdx's id")

		// Not JSON: passed as it is (it carries no field an engine reads as
		// a KV instruction); JSON that does not parse: refused. (Without a
		// model, the only pool that lists the path.)
		a = post(t, hc, st.URL()+"/v1/embeddings", `prompt=hi&kv_transfer_params=x`)
		require.Equal(t, 200, a.status, a.body)
		require.Equal(t, `prompt=hi&kv_transfer_params=x`, rec.requests()[1].body)
		requireAPIError(t, post(t, hc, st.URL()+"/v1/embeddings", `{"prompt":"hi",`+injected+`,}`), 400, "invalid_json", "")
		require.Len(t, rec.requests(), 2)

		// A model whose pool does not list the path: 404.
		requireAPIError(t, post(t, hc, st.URL()+"/v1/embeddings", `{"model":"demo-model","input":"x"}`), 404, "not_found", "demo-model")
		require.Len(t, rec.requests(), 2)
		requireNoEngineTraffic(t, st)
	})

	t.Run("a body with a method pdx does not route", func(t *testing.T) {
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPut, st.URL()+"/v1/chat/completions", strings.NewReader(`{}`))
		require.NoError(t, err)
		requireAPIError(t, do(t, hc, req), 405, "method_not_allowed", "use POST")
	})
}
