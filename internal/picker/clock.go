package picker

// elapsed is the time since s.base in nanoseconds, never negative (a fake
// clock may go back before base).
func (s *Set) elapsed() int64 {
	return max(int64(s.now().Sub(s.base)), 0)
}

// clock returns a reading of s's clock for one pick.
func (s *Set) clock() instant { return instant{set: s, ns: -1} }

// instant is one reading of a Set's clock, taken the first time a pick
// meets an ejected endpoint or a load, so that the common case, all
// admitted and no engine metrics, never reads the clock.
type instant struct {
	set *Set
	ns  int64 // negative: not read yet
}

// admits reports whether h is not ejected at t.
func (t *instant) admits(h *health) bool {
	u := h.until.Load()
	if u == 0 {
		return true
	}
	return t.read() >= u
}

// read returns the reading, taking it the first time.
func (t *instant) read() int64 {
	if t.ns < 0 {
		t.ns = t.set.elapsed()
	}
	return t.ns
}
