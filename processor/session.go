package processor

import (
	"github.com/pdx-router/pdx/internal/picker"
	"github.com/pdx-router/pdx/internal/routing"
)

// sessionIn reads the key of the request's session in pool
// (picker.Request.Session) from its headers, and lets the headers go: the
// hash of the value of the pool's session header, 0 when the pool keeps
// no sessions or the request names none. The pool is known only from the
// body, so requestHeaders keeps the headers until here; a request waiting
// for room (placement) holds them no longer. The header itself reaches the
// engines unchanged: it is the client's.
func (r *request) sessionIn(pool *routing.Pool) uint64 {
	h := r.headers
	r.headers = nil
	if pool.SessionHeader == "" {
		return 0
	}
	for _, hv := range h.GetHeaders().GetHeaders() {
		if hv.GetKey() != pool.SessionHeader {
			continue
		}
		if raw := hv.GetRawValue(); raw != nil {
			return picker.SessionKey(raw)
		}
		return picker.SessionKey([]byte(hv.GetValue()))
	}
	return 0
}
