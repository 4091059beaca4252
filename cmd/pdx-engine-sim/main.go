// Command pdx-engine-sim runs a simulated vLLM engine (see package enginesim)
// in the prefill, decode or both role, speaking one KV connector protocol,
// for testing the pdx router end to end without GPUs. With --store it runs
// the shared KV store that engines of --connector http use instead.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/pdx-router/pdx/internal/testbed/enginesim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdx-engine-sim:", err)
		os.Exit(1)
	}
}

// run serves until ctx is done.
func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("pdx-engine-sim", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8000", "address to listen on")
	role := fs.String("role", string(enginesim.RoleBoth), "engine role: prefill, decode or both")
	var cfg enginesim.Config
	fs.StringVar(&cfg.EngineID, "engine-id", "", "engine id advertised in kv_transfer_params (default random)")
	fs.DurationVar(&cfg.PrefillLatency, "prefill-latency", 0, "fixed latency of a prefill")
	fs.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", 0, "extra prefill latency per prompt token")
	fs.DurationVar(&cfg.DecodeLatency, "decode-latency", 0, "time to first output token")
	fs.DurationVar(&cfg.DecodePerToken, "decode-per-token", 0, "time per further output token")
	fs.DurationVar(&cfg.KVTTL, "kv-ttl", 0, "how long unpulled KV is kept (default 2m)")
	fs.StringVar(&cfg.Connector, "connector", enginesim.ConnectorNIXL,
		"KV connector protocol: "+strings.Join(enginesim.Connectors(), ", "))
	fs.StringVar(&cfg.MooncakeProtocol, "mooncake-protocol", enginesim.MooncakeNIXL, "protocol of --connector mooncake: nixl or vllm")
	fs.StringVar(&cfg.BootstrapAddr, "bootstrap-addr", "127.0.0.1:0", "bootstrap server address (sglang, mooncake vllm; prefill and both roles)")
	fs.StringVar(&cfg.KVAddr, "kv-addr", "127.0.0.1:0", "KV listener address (p2p-nccl)")
	fs.StringVar(&cfg.StoreAddr, "store-addr", "", "address of the KV store (http; see --store)")
	fs.DurationVar(&cfg.KVWaitTimeout, "kv-wait-timeout", 0, "how long a decode waits for a concurrent or late prefill's KV (default 30s)")
	fs.DurationVar(&cfg.DecodeQueueLatency, "decode-queue-latency", 0, "how long a NIXL decode waits in vLLM's queue before it pulls its KV")
	fs.DurationVar(&cfg.DisconnectCheckInterval, "disconnect-check-interval", 0,
		"how often SGLang notices a waiting request's gone client (default 4s for sglang)")
	tamper := fs.String("tamper-kv-params", "", "JSON object whose members override the kv_transfer_params a NIXL prefill returns")
	fs.IntVar(&cfg.DPSize, "dp-size", 0, "data-parallel ranks behind the engine's address (vLLM --data-parallel-size, SGLang --dp-size); 0 or 1: none")
	fs.BoolVar(&cfg.PromptTokensDetails, "enable-prompt-tokens-details", false, "report usage.prompt_tokens_details.cached_tokens, as vLLM's flag of that name")
	fs.BoolVar(&cfg.TRTLLMLegacy, "trtllm-legacy", false, "play an older TensorRT-LLM server (DisaggregatedParams without disagg_request_id, ctx_usage, ...)")
	store := fs.Bool("store", false, "run the shared KV store of --connector http on --addr instead of an engine")
	capacity := fs.Bool("capacity", false, "model an engine under load: Llama-3-8B on one H100 (batch, queues, prefix cache, KV pulls; see docs/simulator.md)")
	tokenScale := fs.Float64("token-scale", 1, "with --capacity: prompts and outputs have 1/this of the real tokens")
	timeScale := fs.Float64("time-scale", 1, "with --capacity: the engine runs this many times the real time")
	loraModules := fs.String("lora-modules", "", "comma-separated LoRA adapter names the engine serves (vLLM's --lora-modules names): a request whose model is one uses it")
	maxLoRAs := fs.Int("max-loras", 0, "with --capacity: adapter slots (vLLM's --max-loras): adapters on the GPU, distinct adapters in one batch; 0: no adapter model")
	loraLoad := fs.Duration("lora-load", 50*time.Millisecond, "with --capacity and --max-loras: time to load an adapter that is not on the GPU (an assumption, not a measurement)")
	var kv enginesim.KVEvents
	fs.StringVar(&kv.Endpoint, "kv-events-endpoint", "", "with --capacity: publish the prefix cache's changes as vLLM's KV events on this ZMQ PUB endpoint (e.g. tcp://127.0.0.1:5557; port 0: a free one)")
	fs.BoolVar(&kv.Connect, "kv-events-connect", false, "dial --kv-events-endpoint (a subscriber that binds, e.g. pdx's or llm-d's central socket) instead of binding it")
	fs.StringVar(&kv.ReplayEndpoint, "kv-events-replay-endpoint", "", "ZMQ ROUTER endpoint answering replay requests for missed KV event batches")
	fs.StringVar(&kv.Topic, "kv-events-topic", "", "topic frame of the KV event messages")
	fs.StringVar(&kv.Encoding, "kv-events-encoding", enginesim.EventsMap, "KV events as tagged maps (map: vLLM since PR #42892) or tagged arrays (array: older vLLM)")
	fs.IntVar(&kv.TokenScale, "kv-events-token-scale", 1, "publish (and render) each simulated token as this many token ids: with --token-scale N, N gives real-size blocks (vllm-router reads 16-token blocks)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	cfg.Role = enginesim.Role(*role)
	if *capacity {
		c := enginesim.ReferenceCapacity(*tokenScale, *timeScale)
		c.MaxLoRA, c.LoRALoad = *maxLoRAs, *loraLoad
		cfg.Capacity = &c
	}
	if *loraModules != "" {
		cfg.LoRAModules = strings.Split(*loraModules, ",")
	}
	if kv.Endpoint != "" {
		cfg.KVEvents = &kv
	}
	if *tamper != "" {
		cfg.TamperKVParams = json.RawMessage(*tamper)
	}
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	cfg.Logger = logger

	if *store {
		st, err := enginesim.StartStore(ctx, *addr)
		if err != nil {
			return err
		}
		logger.Info("KV store listening", "addr", st.Addr())
		<-ctx.Done()
		return st.Close()
	}
	srv, err := enginesim.Start(ctx, *addr, cfg)
	if err != nil {
		return err
	}
	logger.Info("engine ready", "addr", srv.Addr(), "bootstrap_port", srv.BootstrapPort(), "kv_addr", srv.KVAddr(),
		"kv_events_endpoint", srv.KVEventsEndpoint(), "kv_events_replay_endpoint", srv.KVEventsReplayEndpoint())
	<-ctx.Done()
	return srv.Close()
}
