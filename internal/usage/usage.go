// Package usage reads the token counts an engine reports in its answer,
// from the response body as it streams past, without copying it, in the
// shape of each API pdx routes: a JSON answer's top-level "usage", or, in a
// server-sent event stream, the last event that carries one (chat and
// completions send it in the final chunk when the client asked for
// stream_options.include_usage; Anthropic's Messages in message_delta;
// OpenAI's Responses under "response" in response.completed). It also
// tells when a stream's output began: Responses streams announce the
// response (response.created, response.in_progress) before its first
// token.
package usage

import (
	"encoding/json"
	"strings"
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

	// The current event's "event:" field, when it is one of the
	// preamble's (eventName holds its first bytes while it is read).
	eventLine bool
	eventName [48]byte
	eventLen  int
	preamble  bool
	// started: output began (see Started).
	started bool

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
		if len(p) > 0 {
			r.started = true
		}
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
			r.lineStart, r.field, r.eventLine = false, 0, false
		}
		switch {
		case r.eventLine:
			r.eventByte(c)
		case r.field < 0:
			// Not a data line (id:, a comment): skipped.
		case r.field < len("data:"):
			if c != "data:"[r.field] {
				if r.field == 0 && c == 'e' {
					// Maybe "event:", read as such from its second byte.
					r.eventLine, r.field, r.eventLen = true, -1, 0
					r.eventByte(c)
					continue
				}
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
			if !r.preamble {
				r.started = true
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

// eventByte takes a byte of an "event:" line: its field name, then its
// value, of which the first bytes are kept.
func (r *Reader) eventByte(c byte) {
	if r.eventLen < len(r.eventName) {
		r.eventName[r.eventLen] = c
	}
	r.eventLen++
}

// preamble reports whether an event is one a stream sends besides its
// output: Responses' announcements of the response, and Anthropic's
// keep-alive.
func preamble(name string) bool {
	switch name {
	case "response.created", "response.in_progress", "response.queued", "ping":
		return true
	}
	return false
}

// endEventLine ends an "event:" line: the event is a preamble's when its
// value names one.
func (r *Reader) endEventLine() {
	n := min(r.eventLen, len(r.eventName))
	line := string(r.eventName[:n])
	name, ok := strings.CutPrefix(line, "event:")
	if !ok || r.eventLen > len(r.eventName) {
		return // another field, or a name longer than any preamble's
	}
	name = strings.TrimSuffix(strings.TrimPrefix(name, " "), "\r")
	r.preamble = preamble(name)
}

// endLine ends a line; an empty one ends an event.
func (r *Reader) endLine() {
	if r.lineStart {
		r.endEvent()
		return
	}
	if r.eventLine {
		r.endEventLine()
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
	r.preamble = false
}

// Started reports whether the body's output has begun: any byte of a JSON
// body, the data of an SSE event that is not a preamble's (announcing the
// response, keeping the connection alive). Its first time is a stream's
// first token.
func (r *Reader) Started() bool { return r.started }

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
// value of its "usage" member, which it keeps: the top-level one, or the
// one of its top-level "response" object (a Responses stream event's).
type scanner struct {
	depth    int  // nesting: 1 inside the top-level object
	inString bool // inside a string
	escaped  bool // after a backslash in a string
	broken   bool // not a JSON object: nothing to find

	// level is 1 inside the value of the top-level "response", 0 outside:
	// keys are read at depth level+1. At that depth: expectKey before a
	// member's key; readingKey while reading one into key (its first
	// bytes; keyLen counts them all); afterKey is what the key was;
	// descend after "response": until its value begins; capture while
	// reading the value of "usage".
	level              int
	started, expectKey bool
	readingKey         bool
	key                [len(responseKey)]byte
	keyLen             int
	keyEscaped         bool
	afterKey           member
	descend            bool
	capture            bool
	value              []byte
	tooLong            bool // the value passed maxValue: dropped
	done               bool // the usage value is complete
}

// member is a key the scanner looks for.
type member int

const (
	otherMember member = iota
	usageMember
	responseMember
)

const (
	usageKey    = "usage"
	responseKey = "response"
)

// member is what the key just read is, at the current level.
func (s *scanner) member() member {
	if s.keyEscaped || s.keyLen > len(s.key) {
		return otherMember // an escaped key is never the plain one
	}
	switch k := string(s.key[:s.keyLen]); {
	case k == usageKey:
		return usageMember
	case k == responseKey && s.level == 0:
		return responseMember
	}
	return otherMember
}

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
			case c == '\\':
				s.escaped = true
				if s.readingKey {
					s.keyEscaped = true
				}
			case c == '"':
				s.inString = false
				if s.readingKey {
					s.readingKey, s.expectKey = false, false
					s.afterKey = s.member()
				}
			default:
				if s.readingKey {
					if s.keyLen < len(s.key) {
						s.key[s.keyLen] = c
					}
					s.keyLen++
				}
			}
			continue
		}
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		if s.descend {
			// The value of the top-level "response": its keys are read
			// when it is an object.
			s.descend = false
			if c == '{' {
				s.depth++
				s.level, s.expectKey = 1, true
				continue
			}
		}
		keys := s.level + 1 // the depth keys are read at
		switch c {
		case '"':
			s.inString = true
			if s.depth == keys && s.expectKey {
				s.readingKey, s.keyLen, s.keyEscaped = true, 0, false
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
			switch {
			case s.depth == keys && s.capture:
				// Closing a nested value; captured below.
			case s.depth == s.level && s.capture:
				// The object holding "usage" closed.
				s.keep(p[start:i])
				s.capture, s.done = false, true
				return
			case s.depth == 0:
				return
			case s.depth < 0:
				s.broken = true
				return
			case s.depth == s.level && s.level > 0:
				// "response" closed without a "usage".
				s.level = 0
			}
		case ':':
			if s.depth == keys {
				switch s.afterKey {
				case usageMember:
					s.capture, start = true, i+1
				case responseMember:
					s.descend = true
				}
				s.afterKey = otherMember
			}
		case ',':
			if s.depth == keys {
				if s.capture {
					s.keep(p[start:i])
					s.capture, s.done = false, true
					return
				}
				s.expectKey, s.afterKey = true, otherMember
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

// usage parses the captured value, in any of the APIs' shapes: chat's and
// completions' prompt_tokens, completion_tokens and
// prompt_tokens_details.cached_tokens; Responses' input_tokens,
// output_tokens and input_tokens_details.cached_tokens (with
// total_tokens); Anthropic's input_tokens, which do not count the cached
// ones, cache_read_input_tokens, cache_creation_input_tokens and
// output_tokens.
func (s *scanner) usage() (Counts, bool) {
	if !s.done || s.tooLong || len(s.value) == 0 {
		return Counts{}, false
	}
	type details struct {
		CachedTokens int64 `json:"cached_tokens"`
	}
	var u struct {
		PromptTokens        *int64   `json:"prompt_tokens"`
		CompletionTokens    *int64   `json:"completion_tokens"`
		PromptTokensDetails *details `json:"prompt_tokens_details"`
		InputTokens         *int64   `json:"input_tokens"`
		OutputTokens        *int64   `json:"output_tokens"`
		InputTokensDetails  *details `json:"input_tokens_details"`
		TotalTokens         *int64   `json:"total_tokens"`
		CacheRead           *int64   `json:"cache_read_input_tokens"`
		CacheCreation       *int64   `json:"cache_creation_input_tokens"`
	}
	if err := json.Unmarshal(s.value, &u); err != nil {
		return Counts{}, false // not a usage
	}
	var c Counts
	value := func(p *int64) int64 {
		if p == nil {
			return 0
		}
		return *p
	}
	switch {
	case u.PromptTokens != nil:
		c = Counts{Prompt: *u.PromptTokens, Completion: value(u.CompletionTokens)}
		if d := u.PromptTokensDetails; d != nil {
			c.Cached = d.CachedTokens
		}
	case u.InputTokens != nil && (u.InputTokensDetails != nil || u.TotalTokens != nil):
		c = Counts{Prompt: *u.InputTokens, Completion: value(u.OutputTokens)}
		if d := u.InputTokensDetails; d != nil {
			c.Cached = d.CachedTokens
		}
	case u.InputTokens != nil:
		c = Counts{Prompt: *u.InputTokens + value(u.CacheRead) + value(u.CacheCreation), Cached: value(u.CacheRead), Completion: value(u.OutputTokens)}
		if value(u.CacheRead) < 0 || value(u.CacheCreation) < 0 {
			return Counts{}, false
		}
	default:
		return Counts{}, false // null, or not a usage
	}
	if c.Prompt < 0 || c.Completion < 0 || c.Cached < 0 || c.Cached > c.Prompt {
		return Counts{}, false
	}
	return c, true
}
