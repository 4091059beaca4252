package enginesim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// vllmRouterDecode is vllm-router 0.1.17's decode leg of client: the
// client's body, the router's own fields and the kv_transfer_params of the
// prefill's answer.
func vllmRouterDecode(client body, kv any) body {
	return client.with(
		"no_stop_trim", false, "return_hidden_states", false, "separate_reasoning", true, "stream_reasoning", true,
		"include_reasoning", true, "continue_final_message", false, "skip_special_tokens", true, "ignore_eos", false,
		"logprobs", false, "kv_transfer_params", kv)
}

// vllmRouterPrefill is vllm-router 0.1.17's NIXL prefill leg of client: its
// decode leg with the prefill edits (max_tokens 1, min_tokens 1, stream
// false; max_completion_tokens 1 when set, no stream_options:
// src/routers/http/vllm_pd_router.rs prepare_prefill_request in
// vllm-project/router) and do_remote_decode params.
func vllmRouterPrefill(client body) body {
	b := vllmRouterDecode(client, map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	}).with("max_tokens", 1, "min_tokens", 1, "stream", false, "stream_options", nil)
	if _, ok := client["max_completion_tokens"]; ok {
		b = b.with("max_completion_tokens", 1)
	}
	return b
}

// vllmRule is one row of what vLLM accepts and refuses: a request with the
// field set to value, and the vLLM check it mirrors.
type vllmRule struct {
	field, value string
	body         body
	accept       bool
	want         string // refused: the message (vLLM's)
	tokens       int    // accepted: the completion tokens expected (0: not checked)
	stream       bool   // accepted: answered as SSE
	pulled       bool   // the body is a decode leg: it gets a prefill's kv_transfer_params and pulls
	vllm         string // the check mirrored: file and function
}

// TestVLLMFieldRules: the vLLM dialect accepts and refuses what vLLM's
// OpenAI server does, for the fields routers send, with vLLM's messages.
// Files are under vllm/ (entrypoints/openai/ for the request models).
func TestVLLMFieldRules(t *testing.T) {
	chat, cmpl := chatBody("rules"), completionBody("rules")
	const (
		chatModel  = "chat_completion/protocol.py ChatCompletionRequest"
		cmplModel  = "completion/protocol.py CompletionRequest"
		verifyArgs = "sampling_params.py SamplingParams._verify_args"
		lax        = "pydantic lax mode: "
		extra      = "engine/protocol.py OpenAIBaseModel: extra=\"allow\", an undeclared field is logged and ignored"
	)
	null := json.RawMessage("null")
	rules := []vllmRule{
		// The legs of vllm-router 0.1.17 (NIXL).
		{field: "vllm-router prefill", value: "chat", body: vllmRouterPrefill(chat), accept: true, tokens: 1,
			vllm: chatModel + ": every field declared or extra; min_tokens 1 <= max_tokens 1 (" + verifyArgs + ")"},
		{field: "vllm-router prefill", value: "completions", body: vllmRouterPrefill(cmpl), accept: true, tokens: 1,
			vllm: cmplModel + ": logprobs false is int 0 (" + lax + "bool to int); include_reasoning, continue_final_message extra"},
		{field: "vllm-router prefill", value: "streaming client", body: vllmRouterPrefill(chat.streaming(true)), accept: true, tokens: 1,
			vllm: chatModel + ".validate_stream_options: the edits set stream false and drop stream_options"},
		{field: "vllm-router prefill", value: "max_completion_tokens client", body: vllmRouterPrefill(chat.with("max_completion_tokens", 9)), accept: true, tokens: 1,
			vllm: "chat_completion/serving.py create_chat_completion: max_completion_tokens, set to 1 too, is read first"},
		{field: "vllm-router decode", value: "chat", body: vllmRouterDecode(chat.with("max_tokens", 3), nil), accept: true, tokens: 3, pulled: true,
			vllm: chatModel + ".kv_transfer_params: dict[str, Any] | None, passed on as extra_args (to_sampling_params)"},
		{field: "vllm-router decode", value: "streaming chat", body: vllmRouterDecode(chat.with("max_tokens", 3, "stream", true), nil), accept: true,
			tokens: 3, stream: true, pulled: true, vllm: chatModel + ".stream: bool | None"},
		{field: "vllm-router decode", value: "completions", body: vllmRouterDecode(cmpl.with("max_tokens", 2), nil), accept: true, tokens: 2, pulled: true,
			vllm: cmplModel + ".kv_transfer_params"},

		// Output limits.
		{field: "max_tokens", value: "1", body: chat.with("max_tokens", 1), accept: true, tokens: 1, vllm: chatModel + ".max_tokens: int | None"},
		{field: "max_tokens", value: `"5"`, body: chat.with("max_tokens", "5"), accept: true, tokens: 5, vllm: lax + "a string of an integer is an int"},
		{field: "max_tokens", value: "5.0", body: chat.with("max_tokens", json.RawMessage("5.0")), accept: true, tokens: 5, vllm: lax + "a float without a fraction is an int"},
		{field: "max_tokens", value: "1.5", body: chat.with("max_tokens", 1.5),
			want: "max_tokens: Input should be a valid integer, got a number with a fractional part", vllm: lax + "int_from_float"},
		{field: "max_tokens", value: "0", body: chat.with("max_tokens", 0),
			want: "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", vllm: verifyArgs + ": max_tokens >= 1"},
		{field: "max_tokens", value: "-3", body: cmpl.with("max_tokens", -3),
			want: "max_tokens must be at least 1, got -3.", vllm: verifyArgs + ": max_tokens >= 1"},
		{field: "max_tokens", value: "null (chat)", body: chat.with("max_tokens", null), accept: true, tokens: defaultMaxTokens,
			vllm: "serve/utils/api_utils.py get_max_tokens: max_model_len - prompt (the simulator generates 16)"},
		{field: "max_tokens", value: "null (completions)", body: cmpl.with("max_tokens", null), accept: true, tokens: 16,
			vllm: cmplModel + ".normalize_null_max_tokens: null is the default, 16"},
		{field: "max_tokens", value: "100000", body: chat.with("max_tokens", 100000), accept: true, tokens: maxMaxTokens,
			vllm: "serve/utils/api_utils.py get_max_tokens: capped by what the context leaves"},
		{field: "max_tokens", value: "0 with echo (completions)", body: cmpl.with("max_tokens", 0, "echo", true), accept: true, tokens: 1,
			vllm: cmplModel + ".to_sampling_params: echo without generation asks for max_tokens 1"},
		{field: "max_completion_tokens", value: "3 over max_tokens 1", body: chat.with("max_completion_tokens", 3, "max_tokens", 1), accept: true, tokens: 3,
			vllm: "chat_completion/serving.py create_chat_completion: max_completion_tokens, else max_tokens"},
		{field: "max_completion_tokens", value: "0", body: chat.with("max_completion_tokens", 0),
			want: "max_tokens must be at least 1, got 0.", vllm: verifyArgs + ": max_tokens >= 1"},
		{field: "max_completion_tokens", value: `"x" (completions)`, body: cmpl.with("max_completion_tokens", "x"), accept: true, tokens: 16, vllm: extra},

		// min_tokens.
		{field: "min_tokens", value: "1, max_tokens 1", body: chat.with("min_tokens", 1, "max_tokens", 1), accept: true, tokens: 1,
			vllm: verifyArgs + ": min_tokens <= max_tokens"},
		{field: "min_tokens", value: "5, max_tokens 4", body: chat.with("min_tokens", 5, "max_tokens", 4),
			want: "min_tokens must be less than or equal to max_tokens=4, got 5.", vllm: verifyArgs + ": min_tokens <= max_tokens"},
		{field: "min_tokens", value: "-1", body: chat.with("min_tokens", -1),
			want: "min_tokens must be greater than or equal to 0, got -1.", vllm: verifyArgs + ": min_tokens >= 0"},
		{field: "min_tokens", value: "null", body: chat.with("min_tokens", null),
			want: "min_tokens: Input should be a valid integer, got null (vLLM's ChatCompletionRequest.min_tokens: int = 0)", vllm: chatModel + ".min_tokens: int = 0"},
		{field: "min_tokens", value: "20, no limit (chat)", body: chat.with("min_tokens", 20), accept: true,
			vllm: verifyArgs + ": against get_max_tokens' max_model_len - prompt"},
		{field: "min_tokens", value: "17, no limit (completions)", body: cmpl.with("min_tokens", 17),
			want: "min_tokens must be less than or equal to max_tokens=16, got 17.", vllm: verifyArgs + ": against the default 16"},
		{field: "min_completion_tokens", value: "99", body: chat.with("min_completion_tokens", 99, "max_tokens", 1), accept: true, tokens: 1, vllm: extra},

		// n.
		{field: "n", value: "2", body: chat.with("n", 2), accept: true, vllm: chatModel + ".n: int | None = 1 (the simulator answers one choice)"},
		{field: "n", value: "0", body: chat.with("n", 0), want: "n must be at least 1, got 0.", vllm: "sampling_params.py _verify_num_sequences"},
		{field: "n", value: "16385", body: cmpl.with("n", 16385),
			want: "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
			vllm: "sampling_params.py _verify_num_sequences: VLLM_MAX_N_SEQUENCES"},
		{field: "n", value: "null (chat)", body: chat.with("n", null), accept: true, vllm: chatModel + ".n: int | None = 1"},
		{field: "n", value: "null (completions)", body: cmpl.with("n", null),
			want: "n: Input should be a valid integer, got null (vLLM's CompletionRequest.n: int = 1)", vllm: cmplModel + ".n: int = 1"},
		{field: "n", value: "2 with temperature 0", body: chat.with("n", 2, "temperature", 0),
			want: "n must be 1 when using greedy sampling, got 2.", vllm: "sampling_params.py SamplingParams._verify_greedy_sampling"},

		// Sampling.
		{field: "temperature", value: "0", body: chat.with("temperature", 0), accept: true, vllm: verifyArgs + ": temperature in [0, 2]"},
		{field: "temperature", value: "2", body: chat.with("temperature", 2), accept: true, vllm: verifyArgs + ": temperature in [0, 2]"},
		{field: "temperature", value: "0.001", body: chat.with("temperature", 0.001, "n", 2), accept: true,
			vllm: "sampling_params.py SamplingParams.__post_init__: raised to _MAX_TEMP 0.01, so not greedy"},
		{field: "temperature", value: `"0.5"`, body: chat.with("temperature", "0.5"), accept: true, vllm: lax + "a string of a number is a float"},
		{field: "temperature", value: "2.5", body: chat.with("temperature", 2.5),
			want: "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)", vllm: verifyArgs + ": temperature <= 2"},
		{field: "temperature", value: "3", body: cmpl.with("temperature", 3),
			want: "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)", vllm: verifyArgs + ": a float field prints as a float"},
		{field: "temperature", value: "-0.1", body: chat.with("temperature", -0.1),
			want: "temperature must be non-negative, got -0.1.", vllm: verifyArgs + ": temperature >= 0"},
		{field: "temperature", value: `"nan"`, body: chat.with("temperature", "nan"),
			want: "temperature must be a finite number, got nan.", vllm: verifyArgs + ": temperature is finite"},
		{field: "top_p", value: "1", body: chat.with("top_p", 1), accept: true, vllm: verifyArgs + ": top_p in (0, 1]"},
		{field: "top_p", value: "0", body: chat.with("top_p", 0),
			want: "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", vllm: verifyArgs + ": top_p in (0, 1]"},
		{field: "top_p", value: "1.5", body: cmpl.with("top_p", 1.5), want: "top_p must be in (0, 1], got 1.5.", vllm: verifyArgs + ": top_p in (0, 1]"},
		{field: "top_k", value: "-1", body: chat.with("top_k", -1), accept: true, vllm: verifyArgs + ": -1 is quietly accepted as disabled"},
		{field: "top_k", value: "50", body: cmpl.with("top_k", 50), accept: true, vllm: verifyArgs + ": top_k >= -1"},
		{field: "top_k", value: "-2", body: chat.with("top_k", -2),
			want: "top_k must be 0 (disable), or at least 1, got -2.", vllm: verifyArgs + ": top_k >= -1"},
		{field: "top_k", value: "1.5", body: chat.with("top_k", 1.5),
			want: "top_k: Input should be a valid integer, got a number with a fractional part", vllm: chatModel + ".top_k: int | None"},
		{field: "min_p", value: "1.5", body: chat.with("min_p", 1.5), want: "min_p must be in [0, 1], got 1.5.", vllm: verifyArgs + ": min_p in [0, 1]"},
		{field: "presence_penalty", value: "3", body: chat.with("presence_penalty", 3),
			want: "presence_penalty must be in [-2, 2], got 3.0.", vllm: verifyArgs + ": presence_penalty in [-2, 2]"},
		{field: "frequency_penalty", value: "-2", body: chat.with("frequency_penalty", -2), accept: true, vllm: verifyArgs + ": frequency_penalty in [-2, 2]"},
		{field: "repetition_penalty", value: "0", body: chat.with("repetition_penalty", 0),
			want: "repetition_penalty must be greater than zero, got 0.0.", vllm: verifyArgs + ": repetition_penalty > 0"},
		{field: "seed", value: "42", body: chat.with("seed", 42), accept: true, vllm: chatModel + ".seed: int | None, ge=_INT64_MIN, le=_INT64_MAX"},
		{field: "seed", value: "2^64-1", body: cmpl.with("seed", json.RawMessage("18446744073709551615")),
			want: "seed: Input should be less than or equal to 9223372036854775807", vllm: cmplModel + ".seed: le=_INT64_MAX"},
		{field: "stop", value: `["a"]`, body: chat.with("stop", []string{"a"}), accept: true, vllm: "generate/base/protocol.py StopParam: str | list[str] | None"},
		{field: "stop", value: `""`, body: chat.with("stop", ""), want: "stop cannot contain an empty string.", vllm: verifyArgs + ": no empty stop string"},
		{field: "stop", value: "5", body: chat.with("stop", 5), want: "stop: Input should be a valid string or a valid list", vllm: "generate/base/protocol.py StopParam"},

		// Streaming.
		{field: "stream", value: "true", body: chat.with("stream", true, "max_tokens", 2), accept: true, tokens: 2, stream: true, vllm: chatModel + ".stream: bool | None"},
		{field: "stream", value: `"true"`, body: cmpl.with("stream", "true", "max_tokens", 2), accept: true, tokens: 2, stream: true, vllm: lax + "a bool word is a bool"},
		{field: "stream", value: "null", body: chat.with("stream", null), accept: true, vllm: chatModel + ".stream: bool | None = False"},
		{field: "stream", value: `"maybe"`, body: chat.with("stream", "maybe"),
			want: "stream: Input should be a valid boolean, unable to interpret input", vllm: lax + "bool_parsing"},
		{field: "stream_options", value: "include_usage, stream true", body: chat.with("stream", true, "stream_options", map[string]any{"include_usage": true}),
			accept: true, stream: true, vllm: chatModel + ".validate_stream_options"},
		{field: "stream_options", value: "include_usage, stream false", body: chat.with("stream", false, "stream_options", map[string]any{"include_usage": true}),
			want: "1 validation error: Value error, Stream options can only be defined when `stream=True`. (parameter=stream_options)",
			vllm: chatModel + ".validate_stream_options: `data.get(\"stream_options\") and not data.get(\"stream\")`"},
		{field: "stream_options", value: "include_usage, no stream (completions)", body: cmpl.with("stream_options", map[string]any{"include_usage": true}),
			want: "Stream options can only be defined when `stream=True`.", vllm: cmplModel + ".validate_stream_options"},
		{field: "stream_options", value: "{} without stream", body: chat.with("stream_options", map[string]any{}), accept: true,
			vllm: chatModel + ".validate_stream_options: an empty object is falsy"},
		{field: "stream_options", value: `include_usage, stream "false"`, body: chat.with("stream", "false", "stream_options", map[string]any{"include_usage": true}),
			accept: true, vllm: chatModel + ".validate_stream_options reads the raw \"false\", truthy; the field is then False"},
		{field: "stream_options", value: `"yes", stream true`, body: chat.with("stream", true, "stream_options", "yes"),
			want: "stream_options: Input should be a valid dictionary or instance of StreamOptions", vllm: chatModel + ".stream_options: StreamOptions | None"},

		// Logprobs.
		{field: "logprobs", value: "false (chat)", body: chat.with("logprobs", false), accept: true, vllm: chatModel + ".logprobs: bool | None = False"},
		{field: "logprobs", value: `"yes" (chat)`, body: chat.with("logprobs", "yes"), accept: true, vllm: lax + "a bool word is a bool"},
		{field: "top_logprobs", value: "5 with logprobs", body: chat.with("logprobs", true, "top_logprobs", 5), accept: true, vllm: chatModel + ".check_logprobs"},
		{field: "top_logprobs", value: "5 without logprobs", body: chat.with("top_logprobs", 5),
			want: "when using `top_logprobs`, `logprobs` must be set to true.", vllm: chatModel + ".check_logprobs"},
		{field: "top_logprobs", value: "-2", body: chat.with("logprobs", true, "top_logprobs", -2),
			want: "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)", vllm: chatModel + ".check_logprobs"},
		{field: "top_logprobs", value: `"5"`, body: chat.with("logprobs", true, "top_logprobs", "5"),
			want: "`top_logprobs` must be an integer.", vllm: chatModel + ".check_logprobs: a number before the comparisons"},
		{field: "top_logprobs", value: "21", body: chat.with("logprobs", true, "top_logprobs", 21),
			want: "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
			vllm: "sampling_params.py SamplingParams._validate_logprobs: max_logprobs 20"},
		{field: "logprobs", value: "false (completions)", body: cmpl.with("logprobs", false), accept: true, vllm: cmplModel + ".logprobs: int | None; " + lax + "bool to int"},
		{field: "logprobs", value: "5 (completions)", body: cmpl.with("logprobs", 5), accept: true, vllm: cmplModel + ".check_logprobs"},
		{field: "logprobs", value: "-2 (completions)", body: cmpl.with("logprobs", -2),
			want: "`logprobs` must be a positive value or -1.", vllm: cmplModel + ".check_logprobs"},
		{field: "logprobs", value: "-1 (completions)", body: cmpl.with("logprobs", -1),
			want: "Requested sample logprobs of 32000, which is greater than max allowed: 20", vllm: "sampling_params.py SamplingParams._validate_logprobs: -1 is the vocabulary"},
		{field: "logprobs", value: `"5" (completions)`, body: cmpl.with("logprobs", "5"),
			want: "`logprobs` must be an integer.", vllm: cmplModel + ".check_logprobs"},
		{field: "prompt_logprobs", value: "1 with stream", body: chat.with("prompt_logprobs", 1, "stream", true),
			want: "`prompt_logprobs` are not available when `stream=True`.", vllm: chatModel + ".check_logprobs"},

		// Flags.
		{field: "echo", value: "true (chat)", body: chat.with("echo", true), accept: true, vllm: chatModel + ".echo: bool = False"},
		{field: "echo", value: "null (chat)", body: chat.with("echo", null),
			want: "echo: Input should be a valid boolean, got null", vllm: chatModel + ".echo: bool = False"},
		{field: "echo", value: "null (completions)", body: cmpl.with("echo", null), accept: true, vllm: cmplModel + ".echo: bool | None = False"},
		{field: "ignore_eos", value: "true", body: chat.with("ignore_eos", true), accept: true, vllm: chatModel + ".ignore_eos: bool = False"},
		{field: "ignore_eos", value: `"no"`, body: cmpl.with("ignore_eos", "no"), accept: true, vllm: lax + "a bool word is a bool"},
		{field: "ignore_eos", value: "null", body: cmpl.with("ignore_eos", null),
			want: "ignore_eos: Input should be a valid boolean, got null (vLLM's CompletionRequest.ignore_eos: bool = False)", vllm: cmplModel + ".ignore_eos: bool = False"},
		{field: "skip_special_tokens", value: "false", body: chat.with("skip_special_tokens", false), accept: true, vllm: chatModel + ".skip_special_tokens: bool = True"},
		{field: "skip_special_tokens", value: "2", body: chat.with("skip_special_tokens", 2),
			want: "skip_special_tokens: Input should be a valid boolean, unable to interpret input", vllm: lax + "only 0 and 1 are bools"},
		{field: "skip_special_tokens", value: "null", body: chat.with("skip_special_tokens", null),
			want: "skip_special_tokens: Input should be a valid boolean, got null", vllm: chatModel + ".skip_special_tokens: bool = True"},
		{field: "include_reasoning", value: "null (chat)", body: chat.with("include_reasoning", null),
			want: "include_reasoning: Input should be a valid boolean, got null", vllm: chatModel + ".include_reasoning: bool = True"},
		{field: "include_reasoning", value: "null (completions)", body: cmpl.with("include_reasoning", null), accept: true, vllm: extra},
		{field: "continue_final_message", value: "true", body: chat.with("continue_final_message", true), accept: true,
			vllm: chatModel + ".check_generation_prompt reads the raw add_generation_prompt, absent here"},
		{field: "continue_final_message", value: "true with add_generation_prompt", body: chat.with("continue_final_message", true, "add_generation_prompt", true),
			want: "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", vllm: chatModel + ".check_generation_prompt"},

		// kv_transfer_params.
		{field: "kv_transfer_params", value: "null", body: chat.with("kv_transfer_params", null), accept: true, vllm: chatModel + ".kv_transfer_params: dict[str, Any] | None"},
		{field: "kv_transfer_params", value: "{}", body: chat.with("kv_transfer_params", map[string]any{}), accept: true,
			vllm: chatModel + ".to_sampling_params: `if self.kv_transfer_params:` an empty one is not passed on"},
		{field: "kv_transfer_params", value: `"yes"`, body: chat.with("kv_transfer_params", "yes"),
			want: "kv_transfer_params: Input should be a valid dictionary", vllm: chatModel + ".kv_transfer_params: dict[str, Any] | None"},
		{field: "kv_transfer_params", value: "[]", body: cmpl.with("kv_transfer_params", []any{}),
			want: "kv_transfer_params: Input should be a valid dictionary", vllm: cmplModel + ".kv_transfer_params: dict[str, Any] | None"},

		// Undeclared fields.
		{field: "no_stop_trim", value: "false", body: chat.with("no_stop_trim", false), accept: true, vllm: extra},
		{field: "x_unknown", value: `{"deep":[1]}`, body: cmpl.with("x_unknown", map[string]any{"deep": []int{1}}), accept: true, vllm: extra},
	}
	for _, tt := range rules {
		verdict := "refused"
		if tt.accept {
			verdict = "accepted"
		}
		t.Run(fmt.Sprintf("%s=%s %s", tt.field, tt.value, verdict), func(t *testing.T) {
			require.NotEmpty(t, tt.vllm, "every rule names the vLLM check it mirrors")
			s := startSim(t, Config{})
			b := tt.body
			if tt.pulled {
				b = b.with("kv_transfer_params", prefill(t, s, "req-1", b.with("kv_transfer_params", nil)))
			}
			r := post(t, s, pathFor(b), "req-1", b)
			if !tt.accept {
				requireRejected(t, s, r, http.StatusBadRequest, tt.want)
				return
			}
			require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
			text := answerText(t, r, tt.stream)
			fp := Fingerprint(promptOf(t, b))
			require.True(t, strings.HasPrefix(text, "pdx-sim:"+fp), "text: %s", text)
			if tt.tokens > 0 {
				require.Equal(t, strings.Join(outputTokens(fp, tt.tokens), ""), text)
			}
			if tt.pulled {
				require.Equal(t, KVPulled, r.header.Get(HeaderKV))
			}
		})
	}
}

// TestVLLMRouterHandoff: vllm-router 0.1.17's legs hand off end to end
// between a NIXL prefill and a decode engine: the prefill generates its one
// token and returns kv_transfer_params, the decode of the client's body
// with them pulls the KV.
func TestVLLMRouterHandoff(t *testing.T) {
	for _, api := range bothAPIs {
		for _, stream := range []bool{false, true} {
			t.Run(api.name+streamName(stream), func(t *testing.T) {
				p := startSim(t, Config{Role: RolePrefill, EngineID: "prefill-engine"})
				d := startSim(t, Config{Role: RoleDecode})
				client := api.body.streaming(stream)
				fp := Fingerprint(promptOf(t, client))

				pr := post(t, p, pathFor(client), "req-1", vllmRouterPrefill(client)).decode(t)
				require.Equal(t, "pdx-sim:"+fp, pr.text())
				require.Equal(t, "length", pr.Choices[0].FinishReason, "min_tokens 1 holds EOS back: the prefill is length capped")
				var kv map[string]any
				require.NoError(t, json.Unmarshal(pr.KVTransferParams, &kv))
				require.Equal(t, "prefill-engine", kv["remote_engine_id"])

				dr := post(t, d, pathFor(client), "req-1", vllmRouterDecode(client, kv))
				requireDecodePulled(t, d, p, dr, client, stream, wantText(t, client))
				require.Equal(t, Tally{}, p.Tally(), "no long or streamed prefill")
				require.Equal(t, State{KVPulled: 1}, p.State())
			})
		}
	}
}
