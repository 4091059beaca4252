package connectors

// The generation APIs pdx routes with a prefill: the paths whose bodies
// connectors know how to split into a prefill and a decode. Other paths
// are a pool's pass-through, or refused.
const (
	ChatCompletionsPath = "/v1/chat/completions"
	CompletionsPath     = "/v1/completions"
	// ResponsesPath is OpenAI's Responses API, MessagesPath Anthropic's
	// Messages API; vLLM serves both (vllm/entrypoints/openai/responses,
	// vllm/entrypoints/anthropic) and takes kv_transfer_params in both.
	ResponsesPath = "/v1/responses"
	MessagesPath  = "/v1/messages"
)

// API is a generation API pdx routes with a prefill; a set of them is
// their union (Traits.NotDisaggregated).
type API uint8

const (
	APIChat API = 1 << iota
	APICompletions
	APIResponses
	APIMessages
)

// apis are the APIs, in the order pdx lists them.
func apis() [4]API { return [...]API{APIChat, APICompletions, APIResponses, APIMessages} }

// APIOf returns the API served at path, 0 for a path pdx does not route
// with a prefill.
func APIOf(path string) API {
	for _, a := range apis() {
		if a.Path() == path {
			return a
		}
	}
	return 0
}

// Path is the path of a single API, "" for a set.
func (a API) Path() string {
	switch a {
	case APIChat:
		return ChatCompletionsPath
	case APICompletions:
		return CompletionsPath
	case APIResponses:
		return ResponsesPath
	case APIMessages:
		return MessagesPath
	}
	return ""
}

// Has reports whether the set a holds api.
func (a API) Has(api API) bool { return api != 0 && a&api == api }

// Anthropic reports whether the API answers in Anthropic's shapes (its
// errors among them).
func (a API) Anthropic() bool { return a == APIMessages }

// RoutedPaths lists the paths pdx routes with a prefill.
func RoutedPaths() []string {
	var paths []string
	for _, a := range apis() {
		paths = append(paths, a.Path())
	}
	return paths
}

// Routed reports whether pdx routes path with a prefill.
func Routed(path string) bool { return APIOf(path) != 0 }

// Paths every pool passes through to its decode endpoints unless it lists
// them itself: companions of the generation APIs that read a body like
// theirs and need no prefill. vLLM serves them
// (vllm/entrypoints/anthropic/api_router.py count_tokens,
// vllm/entrypoints/serve/tokenize/api_router.py).
const (
	CountTokensPath = "/v1/messages/count_tokens"
	TokenizePath    = "/tokenize"
	DetokenizePath  = "/detokenize"
)

// DefaultPassThrough lists the paths every pool passes through.
func DefaultPassThrough() []string {
	return []string{CountTokensPath, TokenizePath, DetokenizePath}
}

// AnthropicPath reports whether the client at path speaks Anthropic's API
// and expects its error shape: the Messages API and its token count.
func AnthropicPath(path string) bool { return path == MessagesPath || path == CountTokensPath }
