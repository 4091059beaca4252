// Package usage reads the token counts an OpenAI-style engine reports in
// its answer (`usage`), from the response body as it streams past, without
// copying it: a JSON answer's top-level "usage", or, in a server-sent event
// stream, the last event that carries one (engines send it in the final
// chunk when the client asked for stream_options.include_usage).
package usage

import (
	"encoding/json"
)

// Counts are one answer's token counts.
type Counts struct {
	Prompt, Cached, Completion int64
}

// maxValue bounds the bytes of a "usage" value kept: real ones are a few
// hundred bytes; a bigger one is not a usage and is dropped.
const maxValue = 4 << 10

// Reader finds the usage in a response body fed to it chunk by chunk, in
// order. It keeps a few bytes of state and at most maxValue bytes of the
// usage value, whatever the body's size, and never holds on to a chunk.
// The zero value reads a JSON body; NewReader(true) an SSE stream. A
// Reader is used by one goroutine.
type Reader struct {
	sse bool

	// SSE line state: where in a line the reader is.
	lineStart bool // at the start of a line
	field     int  // bytes of "data:" matched at the line's start; -1: not a data line
	skipSpace bool // after "data:", where one space may follow

	scan   scanner
	counts Counts
	found  bool
}

// NewReader returns a Reader for a body that is an SSE stream (sse) or a
// JSON document.
func NewReader(sse bool) *Reader {
	return &Reader{sse: sse, lineStart: true}
}

// Write feeds the next chunk of the body; it never fails.
func (r *Reader) Write(p []byte) (int, error) {
	if !r.sse {
		r.scan.feed(p)
		return len(p), nil
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c == '\n' {
			r.endLine()
			continue
		}
		if r.lineStart {
			r.lineStart, r.field = false, 0
		}
		switch {
		case r.field < 0:
			// Not a data line (event:, id:, a comment): skipped.
		case r.field < len("data:"):
			if c != "data:"[r.field] {
				r.field = -1
				continue
			}
			r.field++
			r.skipSpace = r.field == len("data:")
		default:
			if r.skipSpace {
				r.skipSpace = false
				if c == ' ' {
					continue
				}
			}
			// The data runs to the line's end; find its extent and feed
			// it whole.
			j := i
			for j < len(p) && p[j] != '\n' {
				j++
			}
			r.scan.feed(p[i:j]) // a \r before the \n is JSON whitespace
			i = j - 1
		}
	}
	return len(p), nil
}

// endLine ends a line; an empty one ends an event.
func (r *Reader) endLine() {
	if r.lineStart {
		r.endEvent()
		return
	}
	if r.field == len("data:") {
		// Lines of one event's data join with a newline: JSON whitespace.
		r.scan.feed([]byte{'\n'})
	}
	r.lineStart = true
}

func (r *Reader) endEvent() {
	if c, ok := r.scan.usage(); ok {
		r.counts, r.found = c, true
	}
	r.scan = scanner{}
}

// Usage returns the counts read so far and whether the body had any. For a
// JSON body it is the final answer once the whole body is in; for SSE, the
// last complete event's.
func (r *Reader) Usage() (Counts, bool) {
	if !r.sse {
		return r.scan.usage()
	}
	return r.counts, r.found
}

// scanner follows one JSON document's syntax just far enough to find the
// value of its top-level "usage" member, which it keeps.
type scanner struct {
	depth    int  // nesting: 1 inside the top-level object
	inString bool // inside a string
	escaped  bool // after a backslash in a string
	broken   bool // not a JSON object: nothing to find

	// At depth 1: expectKey before a member's key; key* while reading one;
	// capture while reading the value of "usage".
	started, expectKey bool
	keyMatch           int // bytes of `usage` matched; -1: another key
	afterUsageKey      bool
	capture            bool
	value              []byte
	tooLong            bool // the value passed maxValue: dropped
	done               bool // the usage value is complete
}

const usageKey = "usage"

func (s *scanner) feed(p []byte) {
	if s.broken || s.done {
		return
	}
	start := -1 // where the value's bytes in p begin, while capturing
	if s.capture {
		start = 0
	}
	for i, c := range p {
		if s.inString {
			switch {
			case s.escaped:
				s.escaped = false
				if s.depth == 1 && s.keyMatch >= 0 && !s.capture && s.expectKey {
					s.keyMatch = -1 // an escaped key is never the plain "usage"
				}
			case c == '\\':
				s.escaped = true
			case c == '"':
				s.inString = false
				if s.depth == 1 && s.expectKey {
					s.expectKey = false
					s.afterUsageKey = s.keyMatch == len(usageKey)
				}
			default:
				if s.depth == 1 && s.expectKey && s.keyMatch >= 0 {
					if s.keyMatch < len(usageKey) && c == usageKey[s.keyMatch] {
						s.keyMatch++
					} else {
						s.keyMatch = -1
					}
				}
			}
			continue
		}
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		case '"':
			s.inString = true
			if s.depth == 1 && s.expectKey {
				s.keyMatch = 0
			}
		case '{', '[':
			if !s.started {
				if c != '{' {
					s.broken = true
					return
				}
				s.started, s.expectKey = true, true
			}
			s.depth++
		case '}', ']':
			s.depth--
			if s.depth == 1 && s.capture {
				// Closing a nested value; captured below.
			} else if s.depth == 0 {
				if s.capture {
					s.keep(p[start:i])
					s.capture, s.done = false, true
				}
				return
			} else if s.depth < 0 {
				s.broken = true
				return
			}
		case ':':
			if s.depth == 1 && s.afterUsageKey {
				s.afterUsageKey, s.capture, start = false, true, i+1
			}
		case ',':
			if s.depth == 1 {
				if s.capture {
					s.keep(p[start:i])
					s.capture, s.done = false, true
					return
				}
				s.expectKey, s.afterUsageKey = true, false
			}
		default:
			if !s.started {
				s.broken = true
				return
			}
		}
	}
	if s.capture && start >= 0 {
		s.keep(p[start:])
	}
}

// keep adds p to the captured value, which is dropped once it is longer
// than maxValue.
func (s *scanner) keep(p []byte) {
	if s.tooLong {
		return
	}
	if len(s.value)+len(p) > maxValue {
		s.tooLong, s.value = true, nil
		return
	}
	s.value = append(s.value, p...)
}

// usage parses the captured value.
func (s *scanner) usage() (Counts, bool) {
	if !s.done || s.tooLong || len(s.value) == 0 {
		return Counts{}, false
	}
	var u struct {
		PromptTokens        *int64 `json:"prompt_tokens"`
		CompletionTokens    *int64 `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int64 `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	}
	if err := json.Unmarshal(s.value, &u); err != nil || u.PromptTokens == nil {
		return Counts{}, false // null, or not a usage
	}
	c := Counts{Prompt: *u.PromptTokens}
	if u.CompletionTokens != nil {
		c.Completion = *u.CompletionTokens
	}
	if d := u.PromptTokensDetails; d != nil {
		c.Cached = d.CachedTokens
	}
	if c.Prompt < 0 || c.Completion < 0 || c.Cached < 0 || c.Cached > c.Prompt {
		return Counts{}, false
	}
	return c, true
}
