package enginesim

import (
	"encoding/binary"
	"encoding/json"
	"strconv"
)

// The simulator's tokenizer packs the UTF-8 bytes of a text four to a token
// id (big-endian, the last id padded with zero bytes). It is deterministic
// and invertible, so that an engine handed token ids instead of text (a
// TensorRT-LLM generation server gets the context server's prompt_token_ids)
// can turn them back into the prompt and fingerprint it: a wrong id list
// then fingerprints as another prompt. A text ending in a NUL byte does not
// survive the round trip; prompts do not end in one.

const bytesPerToken = 4

// tokenize is the token ids of text; never nil, so that it marshals as [].
func tokenize(text string) []uint32 {
	ids := make([]uint32, 0, (len(text)+bytesPerToken-1)/bytesPerToken)
	for i := 0; i < len(text); i += bytesPerToken {
		var chunk [bytesPerToken]byte
		copy(chunk[:], text[i:])
		ids = append(ids, binary.BigEndian.Uint32(chunk[:]))
	}
	return ids
}

// detokenize is the text of token ids, the inverse of tokenize.
func detokenize(ids []uint32) string {
	b := make([]byte, 0, len(ids)*bytesPerToken)
	for _, id := range ids {
		b = binary.BigEndian.AppendUint32(b, id)
	}
	if len(ids) > 0 {
		last := len(b) - bytesPerToken
		for len(b) > last && b[len(b)-1] == 0 {
			b = b[:len(b)-1]
		}
	}
	return string(b)
}

// promptTokens is the number of prompt tokens of text (at least 1, as an
// engine counts at least a BOS token).
func promptTokens(text string) int {
	return max(1, (len(text)+bytesPerToken-1)/bytesPerToken)
}

// tokenIDs decodes a JSON array of token ids of the simulator's vocabulary
// (integers in [0, 2^32)) exactly. what names the field in errors.
func tokenIDs(raw json.RawMessage, what string) ([]uint32, error) {
	var elems []json.RawMessage
	if err := decodeJSON(raw, &elems); err != nil {
		return nil, badRequest("%s must be an array of token ids, got %s", what, raw)
	}
	ids := make([]uint32, len(elems))
	for i, e := range elems {
		num, ok := jsonNumber(e)
		if !ok {
			return nil, badRequest("%s[%d] must be a token id, got %s", what, i, e)
		}
		n, err := strconv.ParseUint(num, 10, 32)
		if err != nil {
			return nil, badRequest("%s[%d] = %s is not a token id of the simulator's vocabulary (integers in [0, 2^32))", what, i, num)
		}
		ids[i] = uint32(n)
	}
	return ids, nil
}
