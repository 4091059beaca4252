package realvllm

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// flagValue is the value after flag in args, "" when absent.
func flagValue(args []string, flag string) string {
	i := slices.Index(args, flag)
	if i < 0 || i+1 >= len(args) {
		return ""
	}
	return args[i+1]
}

// The command line and environment an engine's config makes: what the
// real-engine tier relies on, checked without starting vLLM.
func TestEngineCommandLine(t *testing.T) {
	in := Install{Dir: "/tools/vllm", Python: "/tools/vllm/venv/bin/python", Model: "/tools/vllm/testmodel/model"}
	e := &Engine{in: in, port: 8000, sidePort: 8001, kvPort: 8002, replayPort: 8003}

	e.cfg = Config{Name: "p", Model: "m", Connector: ConnectorNixl, Role: RoleProducer,
		KVEvents: &KVEvents{Replay: true}, ScaleOut: true, LoRA: true, DevMode: true}
	args, err := e.args()
	require.NoError(t, err)
	require.Equal(t, []string{"-m", "vllm.entrypoints.openai.api_server"}, args[:2])
	require.Equal(t, "/tools/vllm/testmodel/model", flagValue(args, "--model"))
	require.Equal(t, "m", flagValue(args, "--served-model-name"))
	require.Equal(t, "8000", flagValue(args, "--port"))
	require.Equal(t, "64M", flagValue(args, "--kv-cache-memory-bytes"))
	require.Equal(t, "float32", flagValue(args, "--dtype"))
	require.Subset(t, args, []string{"--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-scale-out", "--enable-lora"})
	require.JSONEq(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}`, flagValue(args, "--kv-transfer-config"))
	require.JSONEq(t, `{"enable_kv_cache_events":true,"publisher":"zmq","topic":"","endpoint":"tcp://*:8002","replay_endpoint":"tcp://*:8003"}`,
		flagValue(args, "--kv-events-config"))
	require.Equal(t, 8002, e.KVEventsPort())
	require.Equal(t, 8003, e.KVEventsReplayPort())
	require.Equal(t, "127.0.0.1:8001", e.SideChannel())
	env := strings.Join(e.env(), "\n")
	for _, v := range []string{"HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "VLLM_NIXL_SIDE_CHANNEL_PORT=8001",
		"VLLM_SERVER_DEV_MODE=1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", "VLLM_CACHE_ROOT=/tools/vllm/cache"} {
		require.Contains(t, env, v)
	}

	// An engine that dials pdx's KV event socket, llm-d's topic naming it.
	e.cfg = Config{Name: "s", Model: "m", Connector: ConnectorExample, SharedStorage: "/kv",
		KVEvents: &KVEvents{Connect: "tcp://127.0.0.1:9000", Topic: "kv@"}}
	args, err = e.args()
	require.NoError(t, err)
	var events map[string]any
	require.NoError(t, json.Unmarshal([]byte(flagValue(args, "--kv-events-config")), &events))
	require.Equal(t, "tcp://127.0.0.1:9000", events["endpoint"])
	require.Equal(t, "kv@127.0.0.1:8000@m", events["topic"])
	require.NotContains(t, events, "replay_endpoint")
	require.Zero(t, e.KVEventsPort(), "it binds no publisher")
	require.JSONEq(t, `{"kv_connector":"ExampleConnector","kv_role":"kv_both","kv_connector_extra_config":{"shared_storage_path":"/kv"}}`,
		flagValue(args, "--kv-transfer-config"))
	require.NotContains(t, args, "--enable-scale-out")
	require.NotContains(t, strings.Join(e.env(), "\n"), "VLLM_SERVER_DEV_MODE")

	for _, bad := range []Config{
		{Connector: ConnectorNixl},
		{Connector: ConnectorExample},
		{Connector: "mooncake"},
	} {
		e.cfg = bad
		_, err := e.args()
		require.Error(t, err, "%+v", bad)
	}
}
