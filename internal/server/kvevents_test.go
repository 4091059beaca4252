package server

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/pdx-router/pdx/internal/config"
)

// A pdx with kv_events subscribes at start, exports what it reads and
// stops its subscriptions at shutdown: in mode bind an engine's publisher
// that dials it is read, in mode dial a publisher that is not up yet is
// not an error.
func TestKVEventsLifecycle(t *testing.T) {
	for _, kv := range []string{
		`{mode: bind, bind_address: "tcp://127.0.0.1:0"}`,
		`{port: 1}`, // nothing listens on the engines' port 1
	} {
		t.Run(kv, func(t *testing.T) {
			cfg, err := config.Parse(fmt.Appendf(nil, `
grpc_address: 127.0.0.1:0
admin_address: 127.0.0.1:0
kv_events: %s
pools:
- name: p
  default: true
  connector: nixl
  prefill: [{address: 127.0.0.1:1}]
  decode: [{address: 127.0.0.1:2}]
`, kv))
			require.NoError(t, err)
			s, err := Start(cfg, discard)
			require.NoError(t, err)
			if addr := s.KVEventsAddr(); addr != "" {
				pub := zmq4.NewPub(t.Context())
				require.NoError(t, pub.Dial(addr))
				// The topic names an engine pdx does not know: counted.
				require.Eventually(t, func() bool {
					_ = pub.Send(zmq4.NewMsgFrom([]byte("kv@10.9.9.9:8000@m"), make([]byte, 8), []byte{0x93, 0x00, 0x90, 0xc0}))
					_, body, err := get(t, "http://"+s.AdminAddr()+"/metrics")
					return err == nil && strings.Contains(body, `pdx_kv_events_total{kind="unknown_topics"}`) &&
						!strings.Contains(body, `pdx_kv_events_total{kind="unknown_topics"} 0`)
				}, guard, 20*time.Millisecond)
				require.NoError(t, pub.Close())
			} else {
				code, body, err := get(t, "http://"+s.AdminAddr()+"/metrics")
				require.NoError(t, err)
				require.Equal(t, http.StatusOK, code)
				require.Contains(t, body, `pdx_kv_events_total{kind="batches"} 0`)
				require.Contains(t, body, `pdx_kv_cache_ignored_total{kind="orphans_dropped"} 0`)
				require.Contains(t, body, `pdx_kv_cache_orphans_joined_total 0`)
			}
			require.NoError(t, shutdown(t, s))
		})
	}
}
