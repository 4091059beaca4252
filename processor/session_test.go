package processor

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/metrics"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// sessionServer is one pdx replica: its own table of a pool of three
// prefill and three decode engines that keeps sessions by x-session-id,
// its own metrics, and an engine that records its prefills.
type sessionServer struct {
	srv  *Server
	pool *routing.Pool
	eng  *fakeengine.Engine
	m    *metrics.Metrics
}

func newSessionServer(t *testing.T) sessionServer {
	t.Helper()
	cfg, err := config.Parse([]byte(`
pools:
- name: p
  default: true
  connector: nixl
  session_affinity: {header: x-session-id}
  saturation: {queue_depth: 5}
  pass_through: [/v1/embeddings]
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:2}, {address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:7}, {address: 127.0.0.1:8}, {address: 127.0.0.1:9}]
`))
	require.NoError(t, err)
	table, err := routing.New(cfg)
	require.NoError(t, err)
	pool, _ := table.Pool("p")
	eng, m := answering(fakeengine.Reply{Body: kvAnswer}), metrics.New()
	return sessionServer{srv: New(table, eng, slog.New(slog.DiscardHandler), WithMetrics(m)), pool: pool, eng: eng, m: m}
}

// chat sends a chat request naming session (none when empty) and returns
// its decode and prefill engines' addresses.
func (s sessionServer) chat(t *testing.T, session string) (decode, prefill string) {
	t.Helper()
	var extra []string
	if session != "" {
		extra = []string{"x-session-id", session}
	}
	calls := len(s.eng.Calls())
	out := runOn(t, s.srv, headers("POST", "/v1/chat/completions", false, extra...), body(chatBody, true))
	require.Len(t, out, 2)
	br := out[1].GetRequestBody().GetResponse()
	require.NotContains(t, br.GetHeaderMutation().GetRemoveHeaders(), "x-session-id", "the client's header reaches the engine")
	got := s.eng.Calls()
	require.Len(t, got, calls+1, "one prefill")
	return setHeaders(br.GetHeaderMutation())[DestinationHeader], got[calls].Endpoint.Address
}

func (s sessionServer) picks(t *testing.T, leg, outcome string) float64 {
	return counterValue(t, s.m, "pdx_session_picks_total", map[string]string{"pool": "p", "leg": leg, "outcome": outcome})
}

// A session's requests, through either of two replicas, reach one decode
// and one prefill engine; the sessions spread over the engines; a request
// without the header is the policies' as before.
func TestSessionKeepsItsEngines(t *testing.T) {
	replicas := []sessionServer{newSessionServer(t), newSessionServer(t)}
	decodes, prefills := map[string]bool{}, map[string]bool{}
	for n := range 12 {
		session := fmt.Sprintf("conversation-%d", n)
		decode, prefill := replicas[0].chat(t, session)
		for i := range 4 {
			d, p := replicas[i%2].chat(t, session)
			require.Equal(t, decode, d, "session %d, request %d: its decode engine", n, i)
			require.Equal(t, prefill, p, "session %d, request %d: its prefill engine", n, i)
		}
		decodes[decode], prefills[prefill] = true, true
	}
	require.Len(t, decodes, 3, "the sessions spread over the decode engines")
	require.Len(t, prefills, 3, "and over the prefill engines")
	for _, s := range replicas {
		require.Zero(t, s.picks(t, "decode", "moved"))
		require.Zero(t, s.picks(t, "prefill", "moved"))
	}
	require.Equal(t, float64(12+12*2), replicas[0].picks(t, "decode", "kept"))
	require.Equal(t, float64(12*2), replicas[1].picks(t, "prefill", "kept"))

	replicas[0].chat(t, "")
	require.Equal(t, float64(12+12*2), replicas[0].picks(t, "decode", "kept"), "no header, no session")
}

// A session whose decode engine is saturated (by the engine's word, which
// both replicas read) moves to the same next one on both, counted as
// moved, its prefill engine staying; it returns when the engine has room.
func TestSessionMovesWhenSaturated(t *testing.T) {
	replicas := []sessionServer{newSessionServer(t), newSessionServer(t)}
	report := func(address string, waiting int) {
		for _, s := range replicas {
			s.pool.Decode.Set.Observe(address, picker.Load{Waiting: waiting, At: time.Now()})
		}
	}
	home, prefill := replicas[0].chat(t, "s")
	report(home, 5)
	moved, p := replicas[0].chat(t, "s")
	require.NotEqual(t, home, moved, "the session yields its saturated engine")
	require.Equal(t, prefill, p, "its prefill engine has room")
	d, p := replicas[1].chat(t, "s")
	require.Equal(t, moved, d, "to the same engine on the other replica")
	require.Equal(t, prefill, p)
	for _, s := range replicas {
		require.Equal(t, float64(1), s.picks(t, "decode", "moved"))
		require.Zero(t, s.picks(t, "prefill", "moved"))
	}
	report(home, 0)
	for _, s := range replicas {
		d, p := s.chat(t, "s")
		require.Equal(t, home, d, "the session returns")
		require.Equal(t, prefill, p)
	}
	require.Equal(t, float64(2), replicas[0].picks(t, "decode", "kept"))
}

// A pass-through request of a session goes to the session's decode
// engine.
func TestSessionPassThrough(t *testing.T) {
	s := newSessionServer(t)
	decode, _ := s.chat(t, "s")
	for range 3 {
		out := runOn(t, s.srv, headers("POST", "/v1/embeddings", false, "x-session-id", "s"), body(`{"model":"m","input":"x"}`, true))
		require.Len(t, out, 2)
		require.Equal(t, decode, setHeaders(out[1].GetRequestBody().GetResponse().GetHeaderMutation())[DestinationHeader])
	}
	require.Equal(t, float64(4), s.picks(t, "decode", "kept"))
}
