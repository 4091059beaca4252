// Package logbuf holds the logs of processes and servers a test or the demo
// starts, to show them only when something failed.
package logbuf

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer that many goroutines may write and read.
type Buffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Len is how many bytes were written so far.
func (b *Buffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Len()
}

// From is what was written from offset on.
func (b *Buffer) From(offset int) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	if offset > b.buf.Len() {
		return ""
	}
	return string(b.buf.Bytes()[offset:])
}
