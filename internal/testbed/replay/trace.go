package replay

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
)

// TraceBlockTokens is the size of a Mooncake hash_ids block, in real tokens.
const TraceBlockTokens = 512

// bytesPerToken is the simulator tokenizer's: four bytes a token.
const bytesPerToken = 4

// TraceRequest is one line of a Mooncake FAST'25 trace.
type TraceRequest struct {
	Timestamp    int64   `json:"timestamp"` // arrival, ms from the trace's start
	InputLength  int     `json:"input_length"`
	OutputLength int     `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"` // 512-token prefix blocks; equal ids, equal prefix
}

// ReadTrace reads up to limit requests (all when limit <= 0) from a
// JSON-lines trace file.
func ReadTrace(path string, limit int) ([]TraceRequest, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	reqs, err := ParseTrace(f, limit)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return reqs, nil
}

// ParseTrace parses JSON lines; blank lines are skipped and a line that is
// not a well-formed request is an error naming it.
func ParseTrace(r io.Reader, limit int) ([]TraceRequest, error) {
	var out []TraceRequest
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 16<<20)
	for line := 1; sc.Scan(); line++ {
		if limit > 0 && len(out) == limit {
			break
		}
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		var tr TraceRequest
		if err := json.Unmarshal([]byte(text), &tr); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		if err := tr.check(); err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		out = append(out, tr)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no requests")
	}
	return out, nil
}

func (tr TraceRequest) check() error {
	switch {
	case tr.Timestamp < 0:
		return fmt.Errorf("negative timestamp %d", tr.Timestamp)
	case tr.InputLength <= 0:
		return fmt.Errorf("input_length %d must be positive", tr.InputLength)
	case tr.OutputLength < 0:
		return fmt.Errorf("negative output_length %d", tr.OutputLength)
	case len(tr.HashIDs) == 0:
		return fmt.Errorf("no hash_ids")
	case len(tr.HashIDs)*TraceBlockTokens < tr.InputLength:
		return fmt.Errorf("%d hash_ids cover %d tokens, fewer than input_length %d",
			len(tr.HashIDs), len(tr.HashIDs)*TraceBlockTokens, tr.InputLength)
	}
	return nil
}

// Scale maps real tokens to simulated ones: a simulated token stands for
// TokenScale real tokens, so a 512-token block becomes 512/TokenScale
// simulated tokens (4 bytes each). Prompts keep their shape (which blocks
// they share) at a fraction of the bytes, which a 2-core machine can move.
type Scale struct {
	TokenScale int
}

// check refuses scales under which a block is not a whole number of bytes
// or too short to hold its id.
func (s Scale) check() error {
	if s.TokenScale <= 0 || (TraceBlockTokens*bytesPerToken)%s.TokenScale != 0 {
		return fmt.Errorf("token scale %d must divide %d", s.TokenScale, TraceBlockTokens*bytesPerToken)
	}
	if s.BlockBytes() < minBlockBytes {
		return fmt.Errorf("token scale %d leaves %d-byte blocks, fewer than %d", s.TokenScale, s.BlockBytes(), minBlockBytes)
	}
	return nil
}

// minBlockBytes leaves room for a block's id header.
const minBlockBytes = 16

// BlockBytes is the prompt bytes of one hash_ids block.
func (s Scale) BlockBytes() int { return TraceBlockTokens * bytesPerToken / s.TokenScale }

// Tokens is the simulated token count of n real tokens, rounded up and at
// least 1 (the simulator generates exactly max_tokens, never 0).
func (s Scale) Tokens(n int) int { return max(1, (n+s.TokenScale-1)/s.TokenScale) }

// Prompt synthesizes a request's prompt: one distinct deterministic text
// block per hash id, concatenated and cut to the scaled input length. Equal
// ids give equal text, so requests sharing leading ids share a prefix.
func (s Scale) Prompt(tr TraceRequest) string {
	n := s.Tokens(tr.InputLength) * bytesPerToken
	var b strings.Builder
	b.Grow(len(tr.HashIDs) * s.BlockBytes())
	for _, id := range tr.HashIDs {
		if b.Len() >= n {
			break
		}
		b.WriteString(blockText(id, s.BlockBytes()))
	}
	return b.String()[:n]
}

// blockText is block id's text: its id, then pseudo-random lowercase words
// seeded by the id (printable ASCII, so never the simulator's EOS marker or
// a NUL byte).
func blockText(id int64, size int) string {
	var b strings.Builder
	b.Grow(size)
	b.WriteString("<" + strconv.FormatInt(id, 10) + ">")
	x := uint64(id)*0x9e3779b97f4a7c15 + 1
	for b.Len() < size {
		x = splitmix(x)
		c := byte('a' + x%27)
		if c == 'a'+26 {
			c = ' '
		}
		b.WriteByte(c)
	}
	return b.String()[:size]
}

// splitmix is one step of SplitMix64, a small deterministic generator.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	z := x
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// Request is a trace request ready to send: its prompt, its output length
// and its place in the native timeline.
type Request struct {
	Index     int
	Prompt    string
	MaxTokens int
	// At is the arrival offset in the trace, before compression.
	At time.Duration
	// Objective and Flow, when set, go in the request's flow-control
	// headers (x-llm-d-inference-objective, x-llm-d-inference-fairness-id).
	Objective, Flow string
}

// Requests scales a trace window; arrival offsets start at the window's
// first request.
func (s Scale) Requests(trace []TraceRequest) ([]Request, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	out := make([]Request, len(trace))
	for i, tr := range trace {
		out[i] = Request{
			Index:     i,
			Prompt:    s.Prompt(tr),
			MaxTokens: s.Tokens(tr.OutputLength),
			At:        time.Duration(tr.Timestamp-trace[0].Timestamp) * time.Millisecond,
		}
	}
	return out, nil
}

// Schedule is the send offset of each request when the window's native
// timeline is compressed to rate requests a second on average. Every policy
// at a load point gets the same schedule.
func Schedule(reqs []Request, rate float64) []time.Duration {
	out := make([]time.Duration, len(reqs))
	span := reqs[len(reqs)-1].At
	if len(reqs) < 2 || span <= 0 || rate <= 0 {
		return out // all at once
	}
	native := float64(len(reqs)-1) / span.Seconds()
	for i, r := range reqs {
		out[i] = time.Duration(float64(r.At) * native / rate)
	}
	return out
}
