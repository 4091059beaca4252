package enginesim

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestPromptTokensDetails: like vLLM 0.32 with
// --enable-prompt-tokens-details, usage reports cached_tokens whenever the
// flag is on, 0 included: the KV a decode pulled is not among them (the
// real-engine tier saw it; SGLang's decodes: TestUsage in e2e).
func TestPromptTokensDetails(t *testing.T) {
	type details struct {
		Usage struct {
			PromptTokens        int `json:"prompt_tokens"`
			PromptTokensDetails *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	for _, tt := range []struct {
		name       string
		enabled    bool
		wantDecode bool // the decode's usage has the details
	}{{"enabled", true, true}, {"off by default", false, false}} {
		t.Run(tt.name, func(t *testing.T) {
			p := startSim(t, Config{Role: RolePrefill, PromptTokensDetails: tt.enabled})
			d := startSim(t, Config{Role: RoleDecode, PromptTokensDetails: tt.enabled})
			b := chatBody("a prompt of some tokens for the cache")
			pr := post(t, p, pathFor(b), "req-u", b.asPrefill())
			var pu details
			require.NoError(t, json.Unmarshal(pr.body, &pu), string(pr.body))
			if tt.enabled {
				require.NotNil(t, pu.Usage.PromptTokensDetails, string(pr.body))
				require.Zero(t, pu.Usage.PromptTokensDetails.CachedTokens, "the prefill computed its whole prompt")
			} else {
				require.Nil(t, pu.Usage.PromptTokensDetails)
			}
			presp := pr.decode(t)
			var kv map[string]any
			require.NoError(t, json.Unmarshal(presp.KVTransferParams, &kv))

			dr := post(t, d, pathFor(b), "req-u", b.with("max_tokens", 2, "kv_transfer_params", kv))
			var du details
			require.NoError(t, json.Unmarshal(dr.body, &du), string(dr.body))
			if !tt.wantDecode {
				require.Nil(t, du.Usage.PromptTokensDetails)
				return
			}
			require.NotNil(t, du.Usage.PromptTokensDetails, string(dr.body))
			require.Zero(t, du.Usage.PromptTokensDetails.CachedTokens, "pulled KV is not cached tokens")

			plain := startSim(t, Config{Role: RoleBoth, PromptTokensDetails: true})
			var pl details
			pb := post(t, plain, pathFor(b), "req-v", b.with("max_tokens", 2))
			require.NoError(t, json.Unmarshal(pb.body, &pl), string(pb.body))
			require.NotNil(t, pl.Usage.PromptTokensDetails, string(pb.body))
			require.Zero(t, pl.Usage.PromptTokensDetails.CachedTokens, "a request the engine computed itself has no cached tokens")
		})
	}
}
