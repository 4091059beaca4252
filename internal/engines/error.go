package engines

import (
	"errors"
	"fmt"
	"strings"

	"github.com/pdx-router/pdx/internal/endpoint"
)

// Error reports an engine call that did not produce a usable answer.
type Error struct {
	Endpoint endpoint.Endpoint
	// Status is the engine's HTTP status, or 0 when none was received.
	Status int
	// Message describes what was wrong, e.g. the engine's error text.
	Message string
	Err     error
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "prefill engine %s", e.Endpoint.Address)
	if e.Status != 0 {
		fmt.Fprintf(&b, " answered %d", e.Status)
	}
	if e.Message != "" {
		b.WriteString(": ")
		b.WriteString(e.Message)
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *Error) Unwrap() error { return e.Err }

// ErrBadAnswer marks a prefill answer that does not follow the protocol, or
// names a KV source other than the engine pdx called.
var ErrBadAnswer = errors.New("invalid prefill answer")
