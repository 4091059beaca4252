package placement

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/connectors"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/flowcontrol"
	"github.com/pdx-router/pdx/internal/jsonedit"
	"github.com/pdx-router/pdx/internal/kvcache"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/testbed/fakeengine"
)

// testPool is the placement of a pool of two prefill and two decode
// endpoints, paired in groups a and b, with pc's settings.
func testPool(t *testing.T, pc *configv1.Pool, prefills bool) *Pool {
	t.Helper()
	prefill := []endpoint.Endpoint{{Address: "127.0.0.1:8100", Group: "a"}, {Address: "127.0.0.1:8101", Group: "b"}}
	decode := []endpoint.Endpoint{{Address: "127.0.0.1:8200", Group: "a"}, {Address: "127.0.0.1:8201", Group: "a"}, {Address: "127.0.0.1:8202", Group: "b"}}
	pc.Name = "p"
	p, err := New(pc, prefill, decode, nil, Options{Prefills: prefills})
	require.NoError(t, err)
	return p
}

func placeRequest(t *testing.T, body string, eng connectors.Engine, admit func(context.Context, *picker.Set, string, string, int) (flowcontrol.Ticket, error)) (Request, *connectors.Request) {
	t.Helper()
	obj, err := jsonedit.Parse([]byte(body))
	require.NoError(t, err)
	return Request{ID: "r1", Path: connectors.ChatCompletionsPath, Body: obj, Model: "m", Engine: eng,
		Log: slog.New(slog.DiscardHandler), Admit: admit}, &connectors.Request{Body: obj}
}

// Its messages are 106 bytes: 26 tokens by the estimate.
const shortChat = `{"model":"m","messages":[{"role":"user","content":"` + "0123456789012345678901234567890123456789012345678901234567890123456789012345" + `"}]}`

func TestPlace(t *testing.T) {
	for _, tc := range []struct {
		name     string
		pc       *configv1.Pool
		prefills bool
		reason   string
		// legs are the legs Admit is asked for, in order.
		legs []string
	}{
		{name: "disaggregated", pc: &configv1.Pool{}, prefills: true, reason: ReasonDisaggregated, legs: []string{"decode", "prefill"}},
		{name: "no prefill leg", pc: &configv1.Pool{}, prefills: false, reason: "", legs: []string{"decode"}},
		{name: "short uncached prompt", pc: &configv1.Pool{Disaggregation: &configv1.Disaggregation{MinUncachedTokens: 100}}, prefills: true,
			reason: ReasonShort, legs: []string{"decode"}},
		{name: "long enough", pc: &configv1.Pool{Disaggregation: &configv1.Disaggregation{MinUncachedTokens: 10}}, prefills: true,
			reason: ReasonDisaggregated, legs: []string{"decode", "prefill"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := testPool(t, tc.pc, tc.prefills)
			var legs []string
			req, creq := placeRequest(t, shortChat, fakeengine.New(), func(_ context.Context, _ *picker.Set, _, leg string, tokens int) (flowcontrol.Ticket, error) {
				legs = append(legs, leg)
				require.Equal(t, 26, tokens, "the byte estimate")
				return flowcontrol.Ticket{}, nil
			})
			pl, err := p.Place(t.Context(), req, creq)
			require.NoError(t, err)
			defer pl.Decode.End(picker.Released)
			require.Equal(t, tc.reason, pl.Reason)
			require.Equal(t, tc.legs, legs)
			require.Equal(t, 26, pl.Tokens())
			require.Empty(t, pl.Source, "the pool does not render")
			require.Equal(t, pl.Decode.Endpoint(), creq.Decode)
			require.Equal(t, []endpoint.Endpoint{creq.Decode}, pl.Decodes, "no fallbacks configured")
			if tc.reason != ReasonDisaggregated {
				return
			}
			lease, err := pl.Prefill(t.Context())
			require.NoError(t, err)
			require.Equal(t, creq.Decode.Group, lease.Endpoint().Group, "paired with the decode's group")
			lease.End(picker.Released)
			_, err = pl.Prefill(t.Context(), lease.Endpoint())
			require.ErrorIs(t, err, ErrNoEndpoint, "its group has one prefill endpoint")
		})
	}
}

// A first prefill pick waits up to the pool's PickJitter, a wait its
// context cuts short with its cause and nothing leased; a retry's pick
// and a pool without jitter do not wait.
func TestPrefillPickJitter(t *testing.T) {
	const forever = 1000 * time.Hour // a wait no test outlives
	gone := errors.New("client gone")
	ended, cancel := context.WithCancelCause(t.Context())
	cancel(gone)
	for _, tc := range []struct {
		name   string
		jitter time.Duration
		retry  bool
		want   error
	}{
		{name: "first pick waits", jitter: forever, want: gone},
		{name: "a retry does not", jitter: forever, retry: true},
		{name: "no jitter", jitter: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := testPool(t, &configv1.Pool{}, true)
			p.PickJitter = tc.jitter
			req, creq := placeRequest(t, shortChat, fakeengine.New(), nil)
			pl, err := p.Place(t.Context(), req, creq)
			require.NoError(t, err)
			defer pl.Decode.End(picker.Released)
			var tried []endpoint.Endpoint
			if tc.retry {
				// An endpoint not the pool's: the pick still has the
				// decode's group's own.
				tried = append(tried, endpoint.Endpoint{Address: "127.0.0.1:9999"})
			}
			lease, err := pl.Prefill(ended, tried...)
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
				require.False(t, lease.Open())
				for _, ep := range p.Prefill.Set.Endpoints() {
					require.Zero(t, p.Prefill.Set.InFlight(ep), "nothing leased on %s", ep.Address)
				}
				return
			}
			require.NoError(t, err)
			require.True(t, lease.Open())
			lease.End(picker.Released)
		})
	}
}

// A request refused room on its prefill leg still holds its decode
// lease, which the request ends.
func TestPlaceRefusedPrefillRoom(t *testing.T) {
	p := testPool(t, &configv1.Pool{}, true)
	refused := errors.New("refused")
	req, creq := placeRequest(t, shortChat, fakeengine.New(), func(_ context.Context, _ *picker.Set, _, leg string, _ int) (flowcontrol.Ticket, error) {
		if leg == "prefill" {
			return flowcontrol.Ticket{}, refused
		}
		return flowcontrol.Ticket{}, nil
	})
	pl, err := p.Place(t.Context(), req, creq)
	require.ErrorIs(t, err, refused)
	require.True(t, pl.Decode.Open())
	pl.Decode.End(picker.Released)
}

func TestPlaceDecodeFallbacks(t *testing.T) {
	p := testPool(t, &configv1.Pool{DecodeFallbacks: 2}, true)
	req, creq := placeRequest(t, shortChat, fakeengine.New(), nil)
	pl, err := p.Place(t.Context(), req, creq)
	require.NoError(t, err)
	defer pl.Decode.End(picker.Released)
	require.Len(t, pl.Decodes, 2, "the pick and the one other endpoint of its group")
	for _, ep := range pl.Decodes {
		require.Equal(t, pl.Decodes[0].Group, ep.Group)
	}
	require.NotEqual(t, pl.Decodes[0], pl.Decodes[1])
}

// The prompt's token count is the render's where the pool renders, the
// estimate where the render fails.
func TestPlaceTokenSource(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reply  fakeengine.Reply
		source string
		tokens int
	}{
		{name: "rendered", reply: fakeengine.Reply{Body: `{"token_ids":[1,2,3,4,5,6,7]}`}, source: TokensRendered, tokens: 7},
		{name: "render failed", reply: fakeengine.Reply{Err: errors.New("503")}, source: TokensEstimate, tokens: 26},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := testPool(t, &configv1.Pool{Render: &configv1.Render{Timeout: durationpb.New(time.Second)}}, true)
			eng := fakeengine.New().On(http.MethodPost, "", RenderChatPath, tc.reply)
			req, creq := placeRequest(t, shortChat, eng, nil)
			pl, err := p.Place(t.Context(), req, creq)
			require.NoError(t, err)
			defer pl.Decode.End(picker.Released)
			require.Equal(t, tc.source, pl.Source)
			require.Equal(t, tc.tokens, pl.Tokens())
			require.Len(t, eng.Calls(), 1)
			require.Equal(t, "127.0.0.1:8100", eng.Calls()[0].Endpoint.Address, "rendered on a prefill engine")
		})
	}
}

// Defaults fills in what placement reads, once.
func TestDefaults(t *testing.T) {
	pc := &configv1.Pool{}
	Defaults(pc, true, true)
	require.Zero(t, pc.GetPrefixBlockTokens(), "unset: the engines' block")
	require.Equal(t, DefaultRenderTimeout, pc.GetRender().GetTimeout().AsDuration(), "KV events render by default")
	require.Equal(t, picker.DefaultPolicy(picker.RolePrefill), pc.GetPrefillPicker().GetPolicy())
	require.Equal(t, picker.DefaultPolicy(picker.RoleDecode), pc.GetDecodePicker().GetPolicy())

	pc = &configv1.Pool{}
	Defaults(pc, false, false)
	require.Nil(t, pc.GetRender(), "no render without KV events")
	require.Nil(t, pc.GetPrefillPicker(), "no prefill leg, no prefill picker")
}

// In a pool whose decode is picked late, Settle picks the decode again
// once the prefill has answered: within the first pick's group, moving
// the lease, the request's endpoint and rank and its fallbacks when
// another endpoint is better by then; otherwise the first pick stands.
func TestSettle(t *testing.T) {
	for _, tc := range []struct {
		name        string
		late, again bool
		moved       bool
	}{
		{name: "picked again", late: true, again: true, moved: true},
		{name: "not again: the decode computes the prompt", late: true},
		{name: "a pool whose decode is not picked late", again: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prefill := []endpoint.Endpoint{{Address: "127.0.0.1:8100", Group: "a"}, {Address: "127.0.0.1:8101", Group: "b"}}
			decode := []endpoint.Endpoint{{Address: "127.0.0.1:8200", Group: "a"}, {Address: "127.0.0.1:8201", Group: "a"}, {Address: "127.0.0.1:8202", Group: "b"}}
			p, err := New(&configv1.Pool{Name: "p", DecodeFallbacks: 1}, prefill, decode, nil, Options{Prefills: true, LateDecode: tc.late})
			require.NoError(t, err)
			req, creq := placeRequest(t, shortChat, fakeengine.New(), nil)
			pl, err := p.Place(t.Context(), req, creq)
			require.NoError(t, err)
			first := creq.Decode
			require.Equal(t, decode[0], first, "a fresh pool's first pick")
			require.Equal(t, []endpoint.Endpoint{decode[0], decode[1]}, pl.Decodes)

			// Two requests reach the first pick's engine while the prefill
			// runs.
			var others []picker.Lease
			for range 2 {
				l, ok := p.Decode.Pick(picker.Request{Subset: []string{first.Address}})
				require.True(t, ok)
				others = append(others, l)
			}
			require.Equal(t, tc.moved, pl.Settle(creq, tc.again))
			want := first
			if tc.moved {
				want = decode[1] // of the first pick's group, not 8202
			}
			require.Equal(t, want, creq.Decode)
			require.Equal(t, want, pl.Decode.Endpoint())
			require.Equal(t, want, pl.Decodes[0], "the fallbacks follow the decode")
			require.Len(t, pl.Decodes, 2)
			if tc.moved {
				require.Equal(t, 1, p.Decode.Set.InFlight(want))
				require.Equal(t, 2, p.Decode.Set.InFlight(first), "the first pick no longer counts there")
			} else {
				require.Equal(t, 3, p.Decode.Set.InFlight(first))
			}
			pl.Decode.End(picker.Released)
			for _, l := range others {
				l.End(picker.Released)
			}
			for _, ep := range decode {
				require.Zero(t, p.Decode.Set.InFlight(ep))
			}
		})
	}
}

// longChat's messages are 1,054 bytes: 16 blocks of 16 tokens.
var longChat = `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("0123456789abcdef", 64) + `"}]}`

// A pool hashes its prompts in prefix_block_tokens, or unset in its
// prefill engines' KV block once they say it (its decode engines' without
// a prefill leg), DefaultPrefixBlockTokens until then and where the
// engines' KV events are read.
func TestBlockTokens(t *testing.T) {
	for _, tc := range []struct {
		name       string
		configured uint32
		prefills   bool
		kvEvents   bool
		noRender   bool
		// prefill and decode are the blocks the legs' engines say.
		prefill, decode int
		want            int
	}{
		{name: "unset, not said", prefills: true, want: DefaultPrefixBlockTokens},
		{name: "unset: the prefill engines'", prefills: true, prefill: 32, decode: 128, want: 32},
		{name: "unset, no prefill leg: the decode engines'", prefill: 32, decode: 128, want: 128},
		{name: "configured", configured: 64, prefills: true, prefill: 32, decode: 32, want: 64},
		{name: "unset, KV events read", prefills: true, kvEvents: true, prefill: 32, decode: 32, want: DefaultPrefixBlockTokens},
		{name: "unset, KV events not read: no render", prefills: true, kvEvents: true, noRender: true, prefill: 32, decode: 32, want: 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := Options{Prefills: tc.prefills}
			if tc.kvEvents {
				opts.Cache = kvcache.New(kvcache.Config{BlockSize: 16, MaxEntries: 1 << 10})
			}
			prefill := []endpoint.Endpoint{{Address: "127.0.0.1:8100", Group: "a"}, {Address: "127.0.0.1:8101", Group: "b"}}
			decode := []endpoint.Endpoint{{Address: "127.0.0.1:8200", Group: "a"}, {Address: "127.0.0.1:8202", Group: "b"}}
			pc := &configv1.Pool{Name: "p", PrefixBlockTokens: tc.configured}
			if tc.noRender {
				pc.Render = &configv1.Render{Disabled: true}
			}
			p, err := New(pc, prefill, decode, nil, opts)
			require.NoError(t, err)
			for _, leg := range []struct {
				set   *picker.Set
				block int
			}{{p.Prefill.Set, tc.prefill}, {p.Decode.Set, tc.decode}} {
				for _, ep := range leg.set.Endpoints() {
					leg.set.Observe(ep.Address, picker.Load{KVTokens: 1 << 20, KVBlockTokens: leg.block, At: time.Now()})
				}
			}
			require.Equal(t, tc.want, p.BlockTokens())
			req, creq := placeRequest(t, longChat, fakeengine.New(), nil)
			pl, err := p.Place(t.Context(), req, creq)
			require.NoError(t, err)
			defer pl.Decode.End(picker.Released)
			require.Equal(t, tc.want, pl.prompt.BlockTokens)
			require.Equal(t, picker.Blocks(nil, prompt(creq.Path, creq.Body), tc.want), pl.prompt.Blocks)
		})
	}
}
