package server

import (
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	configv1 "github.com/pdx-router/pdx/api/pdx/config/v1"
	"github.com/pdx-router/pdx/internal/config"
	"github.com/pdx-router/pdx/internal/endpoint"
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/testbed/loopback"
)

// peerConfig is a one-pool config whose replica serves its admin listener
// at admin and reads the peers at every one of peers.
func peerConfig(t *testing.T, admin string, peers []string) *configv1.Config {
	t.Helper()
	cfg, err := config.Parse(fmt.Appendf(nil, `
grpc_address: 127.0.0.1:0
admin_address: %q
engine_metrics: {disabled: true}
peers: {addresses: [%s]}
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}, {address: 127.0.0.1:3}]
  decode: [{address: 127.0.0.1:2}]
`, admin, strings.Join(peers, ", ")))
	require.NoError(t, err)
	return cfg
}

// Two replicas, each listing both (itself included; b names a by host
// name, which resolves to a's address and nothing else): each counts the
// other's prefills on their engines, from a snapshot of those in flight
// when it starts reading, then as they start and end; none counts its
// own twice; a replica gone takes its prefills with it.
func TestPeersExchangePrefills(t *testing.T) {
	admins := []string{loopback.FreeAddr(t), loopback.FreeAddr(t)}
	ep := endpoint.Endpoint{Address: "127.0.0.1:1"}
	a, err := Start(peerConfig(t, admins[0], admins), discard)
	require.NoError(t, err)
	aPrefill := a.proc.Table().Pools()[0].Prefill
	before, ok := aPrefill.Pick(picker.Request{Subset: []string{ep.Address}, Tokens: 700})
	require.True(t, ok)

	// b names a by a host name: each of its addresses is a replica.
	_, aPort, err := net.SplitHostPort(admins[0])
	require.NoError(t, err)
	b, err := Start(peerConfig(t, admins[1], []string{"localhost:" + aPort, admins[1]}), discard)
	require.NoError(t, err)
	defer func() { require.NoError(t, shutdown(t, b)) }()
	bSet := b.proc.Table().Pools()[0].Prefill.Set
	counted := func(n int) func() bool {
		return func() bool { return bSet.InFlight(ep) == n && bSet.PeerLeases() == n }
	}
	require.Eventually(t, counted(1), guard, 5*time.Millisecond, "the lease in flight when b started reading")

	// A prompt's blocks come with its lease: b counts them as sent there.
	blocks := picker.Blocks(nil, []byte(strings.Repeat("a shared system prompt. ", 20)), 16)
	after, ok := aPrefill.Pick(picker.Request{Subset: []string{ep.Address}, Tokens: 300, Blocks: blocks, BlockTokens: 16})
	require.True(t, ok)
	require.Eventually(t, counted(2), guard, 5*time.Millisecond, "a lease started since")
	before.End(picker.Succeeded)
	require.Eventually(t, counted(1), guard, 5*time.Millisecond, "a lease ended")
	// Answered: b's model of the engine learned from it as a's did.
	learned := func(s *picker.Set) picker.Service { m, _ := s.Service(ep); return m }
	require.EqualValues(t, 1, learned(aPrefill.Set).Samples)
	require.EqualValues(t, 1, learned(bSet).Samples, "b learned a's answer")
	// As a did, but for the wire's microseconds.
	require.InEpsilon(t, learned(aPrefill.Set).PromptRate, learned(bSet).PromptRate, 1e-3)

	mine, ok := b.proc.Table().Pools()[0].Prefill.Pick(picker.Request{Subset: []string{ep.Address}, Tokens: 400, Blocks: blocks, BlockTokens: 16})
	require.True(t, ok)
	require.Equal(t, 16*len(blocks), mine.Cached(), "the prompt a sent there counts as cached on b")
	aSet := aPrefill.Set
	require.Eventually(t, func() bool { return aSet.InFlight(ep) == 2 && aSet.PeerLeases() == 1 }, guard, 5*time.Millisecond, "b's lease, on a")
	time.Sleep(50 * time.Millisecond) // room for a mistake: b reading itself
	require.Equal(t, 2, bSet.InFlight(ep), "b counts its own lease once")
	require.Equal(t, 1, bSet.PeerLeases())
	mine.End(picker.Released)
	require.Eventually(t, func() bool { return aSet.PeerLeases() == 0 }, guard, 5*time.Millisecond, "b's lease ended")
	require.EqualValues(t, 1, learned(aSet).Samples, "an end unanswered teaches nothing")

	require.NoError(t, shutdown(t, a))
	require.Eventually(t, counted(0), guard, 5*time.Millisecond, "a gone: its leases with it")
	after.End(picker.Released)
}

// Without peers in the config, the journal is not served.
func TestPeersOff(t *testing.T) {
	s, err := Start(testConfig(t, "127.0.0.1:0", "127.0.0.1:0"), discard)
	require.NoError(t, err)
	defer func() { require.NoError(t, shutdown(t, s)) }()
	require.Nil(t, s.proc.Table().Journal())
	code, body, err := get(t, "http://"+s.AdminAddr()+peersPath)
	require.NoError(t, err)
	require.Equal(t, http.StatusNotFound, code)
	require.Contains(t, body, "peers are off")
}
