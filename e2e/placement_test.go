package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/placement"
	"github.com/pdx-router/pdx/internal/testbed/enginesim"
	"github.com/pdx-router/pdx/internal/testbed/stack"
)

// shedStack is one prefill and one decode engine whose decodes take a
// while, in a pool that holds one request per decode engine.
func shedStack(t *testing.T, saturation string) *stack.Stack {
	return startStack(t, stack.Options{
		Prefill: 1, Decode: 1,
		Engine:   enginesim.Config{DecodeLatency: 1500 * time.Millisecond},
		PoolYAML: "saturation: {max_in_flight: 1, " + saturation + "}",
	})
}

type reply struct {
	status     int
	retryAfter string
	code       string
	took       time.Duration
}

// postAll sends n chat requests at once through Envoy.
func postAll(t *testing.T, st *stack.Stack, n int) []reply {
	t.Helper()
	_, hc := newClient(t, st)
	out := make([]reply, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			start := time.Now()
			resp, err := hc.Post(st.URL()+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"`+stack.Model+`","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`))
			if !noError(t, err) {
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			var e struct {
				Error struct{ Code string } `json:"error"`
			}
			_ = json.Unmarshal(b, &e)
			out[i] = reply{resp.StatusCode, resp.Header.Get("retry-after"), e.Error.Code, time.Since(start)}
		})
		time.Sleep(400 * time.Millisecond) // the first is routed, and decoding, before the next arrives
	}
	wg.Wait()
	return out
}

func noError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Error(err)
		return false
	}
	return true
}

// A decode engine that has as many of pdx's requests as the pool allows is
// saturated until Envoy ends their streams: pdx counts a decode until its
// response is over, through the real Envoy.
func TestSheddingThroughEnvoy(t *testing.T) {
	t.Run("reject", func(t *testing.T) {
		st := shedStack(t, "action: reject")
		got := postAll(t, st, 2)
		require.Equal(t, 200, got[0].status)
		require.Equal(t, reply{status: 429, retryAfter: "1", code: "overloaded"}, reply{got[1].status, got[1].retryAfter, got[1].code, 0})
		// Once the first is over, the engine has room again.
		again := postAll(t, st, 1)
		require.Equal(t, 200, again[0].status)
	})
	t.Run("queue", func(t *testing.T) {
		st := shedStack(t, "action: queue, max_queue_time: 10s")
		got := postAll(t, st, 2)
		require.Equal(t, 200, got[0].status)
		require.Equal(t, 200, got[1].status, "the second waited for the first to finish")
		require.Greater(t, got[1].took, 2*time.Second, "two decodes of 1.5s one after the other, the second sent 0.4s later")
		for _, e := range st.Decode {
			require.Zero(t, e.Tally().Rejected)
		}
	})
}

// The disaggregation decider sends a prompt with too little to prefill to
// the decode engine alone, through the real Envoy: the decode engine
// computes it (a plain request), and no prefill engine is called.
func TestDeciderDecodesShortPromptsAlone(t *testing.T) {
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1, PoolYAML: "disaggregation: {min_uncached_tokens: 1000}"})
	_, hc := newClient(t, st)
	a := post(t, hc, st.URL()+"/v1/chat/completions",
		`{"model":"`+stack.Model+`","messages":[{"role":"user","content":"hello"}],"max_tokens":3}`)
	require.Equal(t, 200, a.status, a.body)
	require.Empty(t, st.Prefill[0].Records(), "no prefill")
	recs := st.Decode[0].Records()
	require.Len(t, recs, 1)
	require.Equal(t, enginesim.KindPlain, recs[0].Kind)
	require.Equal(t, enginesim.KVRecomputed, recs[0].KV, "the decode engine computed the prompt itself")
}

// TestEnginesSayTheirKVSize: pdx reads the KV size of vLLM's and SGLang's
// engines from their metrics (vLLM's cache_config_info, SGLang's token
// pool), scraped from the engines' listeners, and says the size of the
// cache it replays for each, in its prefix blocks: vLLM's own blocks,
// which cache_config_info names, and for SGLang, which names none, 64
// tokens (placement.DefaultPrefixBlockTokens).
func TestEnginesSayTheirKVSize(t *testing.T) {
	for connector, blocks := range map[string]float64{"nixl": 96, "sglang": 96 * 16 / placement.DefaultPrefixBlockTokens} {
		t.Run(connector, func(t *testing.T) {
			c := enginesim.ReferenceCapacity(1, 1)
			c.KVBlocks = 96
			st := startStack(t, stack.Options{Prefill: 1, Decode: 1, Connector: connector, Engine: enginesim.Config{Capacity: &c}})
			admin := "http://" + st.Pdx.AdminAddr() + "/metrics"
			for _, e := range []struct{ role, addr string }{{"prefill", st.Prefill[0].Addr()}, {"decode", st.Decode[0].Addr()}} {
				// 96 blocks of 16 tokens.
				require.Eventually(t, func() bool {
					return value(scrape(t, admin), "pdx_endpoint_kv_capacity_blocks", map[string]string{"role": e.role, "endpoint": e.addr}) == blocks
				}, 10*time.Second, 20*time.Millisecond, "pdx read the %s engine's KV size", e.role)
			}
		})
	}
}

// TestPrefixIndexFollowsEviction: a prefill engine whose KV holds 96
// blocks of 16 tokens says so in its metrics (vLLM's cache_config_info),
// and pdx replays what it sends there on a cache of that size. A prompt
// sent again, or one sharing part of it, is predicted cached as the engine
// finds it, within one of the engine's blocks; after four other
// prompts of its size pushed it out of the engine's cache, pdx predicts
// none of it cached, as the engine reports. pdx counting every block it
// sent as held would predict it cached still.
func TestPrefixIndexFollowsEviction(t *testing.T) {
	c := enginesim.ReferenceCapacity(1, 1)
	c.KVBlocks = 96
	st := startStack(t, stack.Options{Prefill: 1, Decode: 1,
		Engine: enginesim.Config{Capacity: &c, PromptTokensDetails: true}})
	admin := "http://" + st.Pdx.AdminAddr() + "/metrics"
	prefill := map[string]string{"role": "prefill", "endpoint": st.Prefill[0].Addr()}
	// 96 blocks of 16 tokens, which pdx's prefix blocks are.
	require.Eventually(t, func() bool { return value(scrape(t, admin), "pdx_endpoint_kv_capacity_blocks", prefill) == 96 },
		10*time.Second, 20*time.Millisecond, "pdx read the engine's KV size")

	hc := &http.Client{Timeout: 30 * time.Second}
	t.Cleanup(hc.CloseIdleConnections)
	// About 500 tokens each: a third of the engine's cache.
	prompt := func(name string) string {
		return name + ": " + strings.Repeat(fmt.Sprintf("a sentence of %s. ", name), 2000/(len(name)+15))
	}
	cached := func(text string) (predicted, reported float64) {
		t.Helper()
		source := func(s string) float64 {
			return value(scrape(t, admin), "pdx_placement_cached_tokens_total", map[string]string{"endpoint": st.Prefill[0].Addr(), "source": s})
		}
		p0, r0 := source("predicted"), source("reported")
		a := post(t, hc, st.URL()+"/v1/chat/completions", chatBody(text))
		require.Equal(t, 200, a.status, a.body)
		return source("predicted") - p0, source("reported") - r0
	}
	first := prompt("the first prompt")
	predicted, reported := cached(first)
	require.Zero(t, predicted)
	require.Zero(t, reported)
	predicted, reported = cached(first)
	require.Positive(t, reported, "the engine kept it")
	// pdx hashes the prompt in the engine's own blocks: it predicts what
	// the engine finds, within one of them.
	require.InDelta(t, reported, predicted, 16, "pdx predicted it kept")
	// A prompt sharing its first two thirds, which end inside a block.
	predicted, reported = cached(first[:len(first)*2/3+5] + "and then something else entirely")
	require.Positive(t, reported, "the engine kept the shared part")
	require.InDelta(t, reported, predicted, 16, "pdx predicted the shared part")

	for i := range 4 {
		predicted, reported = cached(prompt(fmt.Sprintf("another prompt, %d", i)))
		require.Zero(t, reported, "prompts that share nothing")
	}
	predicted, reported = cached(first)
	require.Zero(t, reported, "the engine evicted it")
	require.Zero(t, predicted, "pdx predicted it evicted")

	// The engine counted every prompt's tokens: pdx learned how many of
	// its own (a prompt's bytes over 4) make one of the engine's, and
	// replays the engine's cache in that many of its blocks for each of
	// the engine's.
	scale := value(scrape(t, admin), "pdx_prefill_tokens_per_engine_token", nil)
	require.NotEqual(t, 1.0, scale, "learned from the engine's answers")
	require.InDelta(t, 1, scale, 0.5)
	require.Eventually(t, func() bool {
		return value(scrape(t, admin), "pdx_endpoint_kv_capacity_blocks", prefill) == math.Floor(96*16*scale/16)
	}, 10*time.Second, 20*time.Millisecond, "pdx replays the engine's 96 blocks as %.2f× as many of its own", scale)
	for _, e := range st.Engines() {
		require.Zero(t, e.Tally().Rejected, e.Addr())
	}
}

// TestDecodePickedAgainThroughEnvoy: NIXL's decode request names no decode
// engine, so pdx picks the decode again once the prefill has answered,
// and Envoy sends it there. Requests sent to the first pick's engine
// directly during the prefill, which its metrics show running, move the
// decode to the other engine, which pulls the prefill's KV; with nothing
// sent the first pick stands.
func TestDecodePickedAgainThroughEnvoy(t *testing.T) {
	for _, busy := range []bool{true, false} {
		t.Run(fmt.Sprintf("busy=%t", busy), func(t *testing.T) {
			st := startStack(t, stack.Options{Prefill: 1, Decode: 2,
				Tune: func(role enginesim.Role, _ int, c *enginesim.Config) {
					if role == enginesim.RolePrefill {
						c.PrefillLatency = 2 * time.Second // time to make the first pick busy
					} else {
						c.DecodePerToken = 100 * time.Millisecond // the direct requests run 5s
					}
				}})
			admin := "http://" + st.Pdx.AdminAddr() + "/metrics"
			_, hc := newClient(t, st)
			text := "a prompt whose decode may move, " + newRequestID(t)
			done := make(chan answer, 1)
			go func() {
				var a answer
				resp, err := hc.Post(st.URL()+"/v1/chat/completions", "application/json", strings.NewReader(chatBody(text)))
				if noError(t, err) {
					b, err := io.ReadAll(resp.Body)
					resp.Body.Close()
					noError(t, err)
					a = answer{status: resp.StatusCode, body: string(b)}
				}
				done <- a
			}()

			// The first pick: the decode endpoint holding the request
			// while its prefill runs.
			first, other := "", ""
			require.Eventually(t, func() bool {
				fams := scrape(t, admin)
				for i, e := range st.Decode {
					if value(fams, "pdx_endpoint_in_flight", map[string]string{"role": "decode", "endpoint": e.Addr()}) == 1 {
						first, other = e.Addr(), st.Decode[1-i].Addr()
						return true
					}
				}
				return false
			}, time.Second, 10*time.Millisecond, "a decode endpoint counts the request during its prefill")

			var direct sync.WaitGroup
			if busy {
				for i := range 2 {
					direct.Go(func() {
						body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"sent directly, %d"}],"max_tokens":50}`, stack.Model, i)
						resp, err := hc.Post("http://"+first+"/v1/chat/completions", "application/json", strings.NewReader(body))
						if noError(t, err) {
							_, _ = io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
							assert.Equal(t, 200, resp.StatusCode)
						}
					})
				}
			}
			a := <-done
			require.Equal(t, 200, a.status, a.body)
			requireHandoff(t, st, chatPrompt(text))
			want := first
			if busy {
				want = other
			}
			d := recordsWhere(st, func(r enginesim.Record) bool {
				return r.Fingerprint == enginesim.Fingerprint(chatPrompt(text)) && r.Kind == enginesim.KindDecode
			})
			require.Equal(t, want, d[enginesim.KindDecode][0].Engine, "the decode engine (first pick %s)", first)
			repicks := func(moved bool) float64 {
				return value(scrape(t, admin), "pdx_decode_repicks_total", map[string]string{"pool": "demo", "moved": fmt.Sprint(moved)})
			}
			require.Equal(t, 1.0, repicks(busy))
			require.Zero(t, repicks(!busy))
			direct.Wait()
		})
	}
}
