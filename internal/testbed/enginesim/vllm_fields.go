package enginesim

import (
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// The request model of the vLLM dialect (connectors nixl, mooncake,
// http/lmcache, p2p-nccl): what vLLM's OpenAI server accepts and refuses in
// the fields a router sends, in the order vLLM checks them.
//
//  1. The request models' "before" model validators, on the raw JSON
//     (ChatCompletionRequest and CompletionRequest in
//     vllm/entrypoints/openai/{chat_completion,completion}/protocol.py:
//     validate_stream_options, check_logprobs, check_generation_prompt).
//  2. Pydantic's lax field validation of the declared fields (lax mode
//     coerces "5" and 5.0 to an int and 0/1 to a bool; null is accepted
//     only by Optional fields). Undeclared fields are accepted and ignored
//     (OpenAIBaseModel: extra="allow", logged as ignored).
//  3. The serving code's output limit (get_max_tokens in
//     vllm/entrypoints/serve/utils/api_utils.py) and SamplingParams'
//     checks (vllm/sampling_params.py: _verify_args,
//     _verify_greedy_sampling, _validate_logprobs).
//
// Refusals are 400s. Messages are vLLM's: a VLLMValidationError reads
// "<message> (parameter=<p>, value=<v>)" (vllm/exceptions.py __str__); the
// validation errors of step 1 and 2 come as pydantic reports them, prefixed
// with the count as vLLM's validation_exception_handler does.

// pyType is the type a vLLM request model declares for a field.
type pyType int

const (
	pyInt           pyType = iota
	pyFloat                // float
	pyBool                 // bool
	pyDict                 // dict[str, Any]
	pyStreamOptions        // StreamOptions, a model of Optional bools
	pyStop                 // StopParam: str | list[str]
)

func (t pyType) String() string {
	return [...]string{"int", "float", "bool", "dict[str, Any]", "StreamOptions", "str | list[str]"}[t]
}

// vllmField is one declared field of a vLLM request model.
type vllmField struct {
	name     string
	typ      pyType
	optional bool   // declared "| None": null is accepted (and means the default)
	def      string // the declared default, for messages
	int64    bool   // Field(ge=_INT64_MIN, le=_INT64_MAX)
}

// Fields of ChatCompletionRequest (chat_completion/protocol.py) that
// routers send, as declared there.
var vllmChatFields = []vllmField{
	{name: "max_tokens", typ: pyInt, optional: true, def: "None"},
	{name: "max_completion_tokens", typ: pyInt, optional: true, def: "None"},
	{name: "min_tokens", typ: pyInt, def: "0"},
	{name: "n", typ: pyInt, optional: true, def: "1"},
	{name: "temperature", typ: pyFloat, optional: true, def: "None"},
	{name: "top_p", typ: pyFloat, optional: true, def: "None"},
	{name: "top_k", typ: pyInt, optional: true, def: "None"},
	{name: "min_p", typ: pyFloat, optional: true, def: "None"},
	{name: "presence_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "frequency_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "repetition_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "seed", typ: pyInt, optional: true, def: "None", int64: true},
	{name: "stop", typ: pyStop, optional: true, def: "[]"},
	{name: "stream", typ: pyBool, optional: true, def: "False"},
	{name: "stream_options", typ: pyStreamOptions, optional: true, def: "None"},
	{name: "logprobs", typ: pyBool, optional: true, def: "False"},
	{name: "top_logprobs", typ: pyInt, optional: true, def: "0"},
	{name: "prompt_logprobs", typ: pyInt, optional: true, def: "None"},
	{name: "echo", typ: pyBool, def: "False"},
	{name: "ignore_eos", typ: pyBool, def: "False"},
	{name: "skip_special_tokens", typ: pyBool, def: "True"},
	{name: "include_reasoning", typ: pyBool, def: "True"},
	{name: "add_generation_prompt", typ: pyBool, def: "True"},
	{name: "continue_final_message", typ: pyBool, def: "False"},
	{name: "kv_transfer_params", typ: pyDict, optional: true, def: "None"},
}

// Fields of CompletionRequest (completion/protocol.py). It declares no
// max_completion_tokens, include_reasoning or continue_final_message:
// those are extra fields there, ignored whatever their value.
var vllmCompletionFields = []vllmField{
	{name: "max_tokens", typ: pyInt, optional: true, def: "16"},
	{name: "min_tokens", typ: pyInt, def: "0"},
	{name: "n", typ: pyInt, def: "1"},
	{name: "temperature", typ: pyFloat, optional: true, def: "None"},
	{name: "top_p", typ: pyFloat, optional: true, def: "None"},
	{name: "top_k", typ: pyInt, optional: true, def: "None"},
	{name: "min_p", typ: pyFloat, optional: true, def: "None"},
	{name: "presence_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "frequency_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "repetition_penalty", typ: pyFloat, optional: true, def: "None"},
	{name: "seed", typ: pyInt, optional: true, def: "None", int64: true},
	{name: "stop", typ: pyStop, optional: true, def: "[]"},
	{name: "stream", typ: pyBool, optional: true, def: "False"},
	{name: "stream_options", typ: pyStreamOptions, optional: true, def: "None"},
	{name: "logprobs", typ: pyInt, optional: true, def: "None"},
	{name: "prompt_logprobs", typ: pyInt, optional: true, def: "None"},
	{name: "echo", typ: pyBool, optional: true, def: "False"},
	{name: "ignore_eos", typ: pyBool, def: "False"},
	{name: "skip_special_tokens", typ: pyBool, def: "True"},
	{name: "kv_transfer_params", typ: pyDict, optional: true, def: "None"},
}

// Limits of vLLM's defaults that the simulator stands in for.
const (
	// vllmMaxN is VLLM_MAX_N_SEQUENCES' default (vllm/envs.py).
	vllmMaxN = 16384
	// vllmMaxLogprobs is ModelConfig.max_logprobs' default (--max-logprobs).
	vllmMaxLogprobs = 20
	// simVocabSize is the vocabulary logprobs -1 asks for: the simulator's
	// tokenizer packs four bytes a token, but no model has a vocabulary
	// under max_logprobs, which is all the check needs.
	simVocabSize = 32000
	// samplingEps is sampling_params.py's _SAMPLING_EPS: below it the
	// temperature means greedy sampling.
	samplingEps = 1e-5
	// maxTempFloor is sampling_params.py's _MAX_TEMP: a temperature in
	// (0, _MAX_TEMP) is raised to it.
	maxTempFloor = 1e-2
)

// vllmRequest is what vLLM made of a request's sampling fields.
type vllmRequest struct {
	values map[string]any // validated declared fields present and not null: int64, float64, bool, map
	limit  int64          // max_tokens as get_max_tokens resolves it
}

func (v *vllmRequest) int(name string, def int64) int64 {
	if n, ok := v.values[name].(int64); ok {
		return n
	}
	return def
}

func (v *vllmRequest) float(name string, def float64) float64 {
	if f, ok := v.values[name].(float64); ok {
		return f
	}
	return def
}

func (v *vllmRequest) bool(name string, def bool) bool {
	if b, ok := v.values[name].(bool); ok {
		return b
	}
	return def
}

func (v *vllmRequest) set(name string) bool {
	_, ok := v.values[name]
	return ok
}

// parseVLLM validates the sampling fields of a vLLM-dialect request and
// sets stream, includeUsage, maxTokens, minTokens and ignoreEOS.
func (r *inferenceRequest) parseVLLM() error {
	raw, err := r.rawValues()
	if err != nil {
		return err
	}
	if err := vllmBeforeValidators(r.api, raw); err != nil {
		return err
	}
	fields, model := vllmChatFields, "ChatCompletionRequest"
	if r.api == apiCompletions {
		fields, model = vllmCompletionFields, "CompletionRequest"
	}
	v := &vllmRequest{values: make(map[string]any)}
	var errs []string
	for _, f := range fields {
		val, present := raw[f.name]
		if !present {
			continue
		}
		got, msg := f.validate(val)
		if msg != "" {
			errs = append(errs, fmt.Sprintf("%s: %s (vLLM's %s.%s: %s)", f.name, msg, model, f.name, f.decl()))
			continue
		}
		if got != nil {
			v.values[f.name] = got
		}
	}
	if len(errs) > 0 {
		return validationError(errs...)
	}
	v.resolveLimit(r.api)
	if err := v.verifySampling(r.api); err != nil {
		return err
	}
	r.stream = v.bool("stream", false)
	if opts, ok := v.values["stream_options"].(map[string]any); ok && r.stream {
		// should_include_usage (serve/utils/api_utils.py).
		r.includeUsage, _ = opts["include_usage"].(bool)
	}
	r.maxTokens = int(v.limit)
	if r.api == apiChat && !v.set("max_completion_tokens") && !v.set("max_tokens") {
		// vLLM generates up to max_model_len - prompt; the simulator keeps
		// its short default so that tests without a limit stay fast.
		r.maxTokens = defaultMaxTokens
	}
	r.minTokens = int(v.int("min_tokens", 0))
	r.ignoreEOS = v.bool("ignore_eos", false)
	return nil
}

// rawValues decodes the top-level fields as Python's json.loads would see
// them (numbers kept as json.Number).
func (r *inferenceRequest) rawValues() (map[string]any, error) {
	out := make(map[string]any, len(r.fields))
	for k, raw := range r.fields {
		var v any
		if err := decodeJSON(raw, &v); err != nil {
			return nil, badRequest("invalid %s: %v", k, err)
		}
		out[k] = v
	}
	return out, nil
}

// validationError is a 400 in the shape of vLLM's
// validation_exception_handler (serve/utils/server_utils.py): the count of
// pydantic's errors, then each.
func validationError(errs ...string) *apiError {
	label := "error"
	if len(errs) > 1 {
		label = "errors"
	}
	return badRequest("%d validation %s: %s", len(errs), label, strings.Join(errs, "; "))
}

// vllmValidationError is str() of vLLM's VLLMValidationError: the message,
// then the parameter and value when given (vllm/exceptions.py __str__).
func vllmValidationError(msg, param string, value any) *apiError {
	var extras []string
	if param != "" {
		extras = append(extras, "parameter="+param)
	}
	if value != nil {
		extras = append(extras, "value="+pyStr(value))
	}
	if len(extras) > 0 {
		msg += " (" + strings.Join(extras, ", ") + ")"
	}
	return badRequest("%s", msg)
}

// beforeValidatorError is a VLLMValidationError raised in a "before" model
// validator, as pydantic reports it.
func beforeValidatorError(msg, param string, value any) *apiError {
	return validationError("Value error, " + vllmValidationError(msg, param, value).msg)
}

func (f vllmField) decl() string {
	t := f.typ.String()
	if f.optional {
		t += " | None"
	}
	return t + " = " + f.def
}

// vllmBeforeValidators are the request models' mode="before" validators,
// which see the raw JSON: truthiness, not the validated values, decides.
func vllmBeforeValidators(a api, raw map[string]any) error {
	// validate_stream_options: `data.get("stream_options") and not
	// data.get("stream")`, so {} and null pass without stream.
	if truthy(raw["stream_options"]) && !truthy(raw["stream"]) {
		return beforeValidatorError("Stream options can only be defined when `stream=True`.", "stream_options", nil)
	}
	// check_logprobs: the counts must be numbers before they are compared.
	counts := []string{"prompt_logprobs", "top_logprobs"}
	if a == apiCompletions {
		counts = []string{"prompt_logprobs", "logprobs"}
	}
	for _, name := range counts {
		if v := raw[name]; v != nil && !isPyNumber(v) {
			return beforeValidatorError("`"+name+"` must be an integer.", name, v)
		}
	}
	if v := raw["prompt_logprobs"]; v != nil {
		n := pyNumber(v)
		if truthy(raw["stream"]) && (n > 0 || n == -1) {
			return beforeValidatorError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs", nil)
		}
		if n < 0 && n != -1 {
			return beforeValidatorError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", v)
		}
	}
	if a == apiCompletions {
		if v := raw["logprobs"]; v != nil {
			if n := pyNumber(v); n < 0 && n != -1 {
				return beforeValidatorError("`logprobs` must be a positive value or -1.", "logprobs", v)
			}
		}
		return nil
	}
	if v := raw["top_logprobs"]; v != nil {
		n := pyNumber(v)
		if n < 0 && n != -1 {
			return beforeValidatorError("`top_logprobs` must be a positive value or -1.", "top_logprobs", v)
		}
		if (n == -1 || n > 0) && !truthy(raw["logprobs"]) {
			return beforeValidatorError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs", nil)
		}
	}
	// check_generation_prompt reads the raw fields too: an absent
	// add_generation_prompt (default True) does not count.
	if truthy(raw["continue_final_message"]) && truthy(raw["add_generation_prompt"]) {
		return validationError("Value error, Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	return nil
}

// validate is pydantic's lax validation of v for the field: the value
// (nil for null), or pydantic's message.
func (f vllmField) validate(v any) (any, string) {
	if v == nil {
		if f.optional {
			return nil, ""
		}
		return nil, "Input should be a valid " + pydanticTypeName(f.typ) + ", got null"
	}
	switch f.typ {
	case pyInt:
		n, fits, msg := laxInt(v)
		switch {
		case msg != "":
			return nil, msg
		case f.int64 && !fits && isNegative(v):
			return nil, "Input should be greater than or equal to -9223372036854775808"
		case f.int64 && !fits:
			return nil, "Input should be less than or equal to 9223372036854775807"
		}
		return n, ""
	case pyFloat:
		x, msg := laxFloat(v)
		if msg != "" {
			return nil, msg
		}
		return x, ""
	case pyBool:
		b, msg := laxBool(v)
		if msg != "" {
			return nil, msg
		}
		return b, ""
	case pyDict:
		m, ok := v.(map[string]any)
		if !ok {
			return nil, "Input should be a valid dictionary"
		}
		return m, ""
	case pyStreamOptions:
		m, ok := v.(map[string]any)
		if !ok {
			return nil, "Input should be a valid dictionary or instance of StreamOptions"
		}
		opts := map[string]any{}
		for _, name := range []string{"include_usage", "continuous_usage_stats"} {
			if m[name] == nil {
				continue
			}
			b, msg := laxBool(m[name])
			if msg != "" {
				return nil, name + ": " + msg
			}
			opts[name] = b
		}
		return opts, ""
	case pyStop:
		return validateStop(v)
	}
	return nil, "unsupported field type"
}

// validateStop checks StopParam, a string or a list of strings.
func validateStop(v any) (any, string) {
	switch s := v.(type) {
	case string:
		return []string{s}, ""
	case []any:
		out := make([]string, len(s))
		for i, e := range s {
			str, ok := e.(string)
			if !ok {
				return nil, fmt.Sprintf("[%d]: Input should be a valid string", i)
			}
			out[i] = str
		}
		return out, ""
	}
	return nil, "Input should be a valid string or a valid list"
}

func pydanticTypeName(t pyType) string {
	switch t {
	case pyInt:
		return "integer"
	case pyFloat:
		return "number"
	case pyBool:
		return "boolean"
	case pyStop:
		return "string"
	}
	return "dictionary"
}

// resolveLimit is the max_tokens vLLM passes to SamplingParams:
// get_max_tokens (serve/utils/api_utils.py) takes the smaller of the
// request's limit and what the context leaves, which the simulator caps at
// maxMaxTokens. Chat reads max_completion_tokens, else max_tokens
// (chat_completion/serving.py); completions only max_tokens, 16 when absent
// or null (CompletionRequest.normalize_null_max_tokens), and echo with
// max_tokens 0 asks for the prompt alone (to_sampling_params: max_tokens 1).
func (v *vllmRequest) resolveLimit(a api) {
	v.limit = maxMaxTokens
	switch {
	case a == apiChat && v.set("max_completion_tokens"):
		v.limit = min(v.int("max_completion_tokens", 0), maxMaxTokens)
	case a == apiChat && v.set("max_tokens"):
		v.limit = min(v.int("max_tokens", 0), maxMaxTokens)
	case a == apiCompletions:
		v.limit = min(v.int("max_tokens", defaultMaxTokens), maxMaxTokens)
		if v.limit == 0 && v.bool("echo", false) {
			v.limit = 1
		}
	}
}

// verifySampling is SamplingParams' checks of the values from_optional
// makes of the request (None is the OpenAI default), in _verify_args'
// order, then _verify_greedy_sampling and _validate_logprobs.
func (v *vllmRequest) verifySampling(a api) error {
	n := v.int("n", 1)
	presence, frequency := v.float("presence_penalty", 0), v.float("frequency_penalty", 0)
	repetition := v.float("repetition_penalty", 1)
	temperature := v.float("temperature", 1)
	if 0 < temperature && temperature < maxTempFloor {
		temperature = maxTempFloor // __post_init__ raises it, with a warning
	}
	topP, topK, minP := v.float("top_p", 1), v.int("top_k", 0), v.float("min_p", 0)
	minTokens := v.int("min_tokens", 0)
	// Chat asks for top_logprobs when logprobs is true; completions'
	// logprobs is the count (to_sampling_params).
	logprobs, hasLogprobs := int64(0), false
	switch {
	case a == apiChat && v.bool("logprobs", false):
		logprobs, hasLogprobs = v.int("top_logprobs", 0), true
	case a == apiCompletions && v.set("logprobs"):
		logprobs, hasLogprobs = v.int("logprobs", 0), true
	}
	fail := func(msg, param string, value any) error { return vllmValidationError(msg, param, value) }
	switch {
	case n < 1:
		return fail(fmt.Sprintf("n must be at least 1, got %d.", n), "", nil)
	case n > vllmMaxN:
		return fail(fmt.Sprintf("n must be at most %d, got %d. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.", vllmMaxN, n), "", nil)
	case !between(presence, -2, 2):
		return fail("presence_penalty must be in [-2, 2], got "+pyRepr(presence)+".", "", nil)
	case !between(frequency, -2, 2):
		return fail("frequency_penalty must be in [-2, 2], got "+pyRepr(frequency)+".", "", nil)
	case !isFinite(repetition):
		return fail("repetition_penalty must be a finite number, got "+pyRepr(repetition)+".", "", nil)
	case repetition <= 0:
		return fail("repetition_penalty must be greater than zero, got "+pyRepr(repetition)+".", "", nil)
	case !isFinite(temperature):
		return fail("temperature must be a finite number, got "+pyRepr(temperature)+".", "temperature", temperature)
	case temperature < 0:
		return fail("temperature must be non-negative, got "+pyRepr(temperature)+".", "temperature", temperature)
	case temperature > 2:
		return fail("temperature must be in [0, 2], got "+pyRepr(temperature)+".", "temperature", temperature)
	case !(topP > 0 && topP <= 1):
		return fail("top_p must be in (0, 1], got "+pyRepr(topP)+".", "top_p", topP)
	case topK < -1:
		return fail(fmt.Sprintf("top_k must be 0 (disable), or at least 1, got %d.", topK), "", nil)
	case !between(minP, 0, 1):
		return fail("min_p must be in [0, 1], got "+pyRepr(minP)+".", "", nil)
	case v.limit < 1:
		return fail(fmt.Sprintf("max_tokens must be at least 1, got %d.", v.limit), "max_tokens", v.limit)
	case minTokens < 0:
		return fail(fmt.Sprintf("min_tokens must be greater than or equal to 0, got %d.", minTokens), "", nil)
	case minTokens > v.limit:
		return fail(fmt.Sprintf("min_tokens must be less than or equal to max_tokens=%d, got %d.", v.limit, minTokens), "", nil)
	case hasLogprobs && logprobs != -1 && logprobs < 0:
		return fail(fmt.Sprintf("logprobs must be non-negative or -1, got %d.", logprobs), "logprobs", logprobs)
	case stopHasEmpty(v.values["stop"]):
		return fail("stop cannot contain an empty string.", "", nil)
	case temperature < samplingEps && n > 1: // _verify_greedy_sampling
		return fail(fmt.Sprintf("n must be 1 when using greedy sampling, got %d.", n), "", nil)
	}
	// _validate_logprobs against max_logprobs; -1 asks for the vocabulary.
	for _, lp := range []struct {
		what, param string
		n           int64
		set         bool
	}{
		{"sample", "logprobs", logprobs, hasLogprobs},
		{"prompt", "prompt_logprobs", v.int("prompt_logprobs", 0), v.set("prompt_logprobs")},
	} {
		num := lp.n
		if num == -1 {
			num = simVocabSize
		}
		if lp.set && num > vllmMaxLogprobs {
			return fail(fmt.Sprintf("Requested %s logprobs of %d, which is greater than max allowed: %d", lp.what, num, vllmMaxLogprobs), lp.param, num)
		}
	}
	return nil
}

func between(x, lo, hi float64) bool { return x >= lo && x <= hi }

func isFinite(x float64) bool { return !math.IsInf(x, 0) && !math.IsNaN(x) }

func stopHasEmpty(v any) bool {
	stops, _ := v.([]string)
	return slices.Contains(stops, "")
}

// truthy is Python's truth value of a JSON value.
func truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case json.Number:
		f, err := strconv.ParseFloat(x.String(), 64)
		return err != nil || f != 0
	case string:
		return x != ""
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return true
}

// isPyNumber is isinstance(v, (int, float)) of a JSON value; bool is an
// int in Python.
func isPyNumber(v any) bool {
	switch v.(type) {
	case bool, json.Number:
		return true
	}
	return false
}

// pyNumber is a JSON number (or bool) as a float, for comparisons.
func pyNumber(v any) float64 {
	switch x := v.(type) {
	case bool:
		if x {
			return 1
		}
		return 0
	case json.Number:
		f, _ := strconv.ParseFloat(x.String(), 64)
		return f
	}
	return 0
}

var intString = regexp.MustCompile(`^[+-]?[0-9]+$`)

// laxInt is pydantic's lax int: an integer, a number without a fractional
// part, a bool, or a string of an integer. fits reports whether it fits an
// int64 (n is then clamped).
func laxInt(v any) (n int64, fits bool, msg string) {
	switch x := v.(type) {
	case bool:
		if x {
			return 1, true, ""
		}
		return 0, true, ""
	case json.Number:
		s := x.String()
		if intString.MatchString(s) {
			n, fits := clampInt(s)
			return n, fits, ""
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || f != math.Trunc(f) {
			return 0, false, "Input should be a valid integer, got a number with a fractional part"
		}
		bf := new(big.Float).SetFloat64(f)
		bi, _ := bf.Int(nil)
		n, fits := clampInt(bi.String())
		return n, fits, ""
	case string:
		s := strings.TrimSpace(x)
		if !intString.MatchString(s) {
			return 0, false, "Input should be a valid integer, unable to parse string as an integer"
		}
		n, fits := clampInt(s)
		return n, fits, ""
	}
	return 0, false, "Input should be a valid integer"
}

// clampInt parses a decimal integer, clamping it to int64.
func clampInt(s string) (int64, bool) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err == nil {
		return n, true
	}
	if strings.HasPrefix(s, "-") {
		return math.MinInt64, false
	}
	return math.MaxInt64, false
}

func isNegative(v any) bool {
	switch x := v.(type) {
	case json.Number:
		return strings.HasPrefix(x.String(), "-")
	case string:
		return strings.HasPrefix(strings.TrimSpace(x), "-")
	}
	return false
}

// laxFloat is pydantic's lax float: a number, a bool, or a string of a
// number (inf and nan included).
func laxFloat(v any) (float64, string) {
	switch x := v.(type) {
	case bool:
		return pyNumber(x), ""
	case json.Number:
		f, _ := strconv.ParseFloat(x.String(), 64)
		return f, ""
	case string:
		f, err := strconv.ParseFloat(strings.TrimSpace(x), 64)
		if err != nil && !strings.Contains(err.Error(), "range") {
			return 0, "Input should be a valid number, unable to parse string as a number"
		}
		return f, ""
	}
	return 0, "Input should be a valid number"
}

// laxBool is pydantic's lax bool: a bool, 0 or 1, or one of its words.
func laxBool(v any) (bool, string) {
	const unable = "Input should be a valid boolean, unable to interpret input"
	switch x := v.(type) {
	case bool:
		return x, ""
	case json.Number:
		switch pyNumber(x) {
		case 0:
			return false, ""
		case 1:
			return true, ""
		}
		return false, unable
	case string:
		switch strings.ToLower(x) {
		case "0", "off", "f", "false", "n", "no":
			return false, ""
		case "1", "on", "t", "true", "y", "yes":
			return true, ""
		}
		return false, unable
	}
	return false, "Input should be a valid boolean"
}

// pyStr is Python's str() of a value in a message.
func pyStr(v any) string {
	switch x := v.(type) {
	case float64:
		return pyRepr(x)
	case int64:
		return strconv.FormatInt(x, 10)
	case bool:
		if x {
			return "True"
		}
		return "False"
	case json.Number:
		return x.String()
	case string:
		return x
	}
	return fmt.Sprint(v)
}

// pyRepr is Python's repr of a float: the shortest digits, ".0" on an
// integral value, an exponent below 1e-4 and from 1e16.
func pyRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "nan"
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	}
	if a := math.Abs(f); a != 0 && (a < 1e-4 || a >= 1e16) {
		s := strconv.FormatFloat(f, 'e', -1, 64)
		// Go writes 1e-05 as Python does, and 1e+16 too.
		return s
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}
