package enginesim

import (
	"context"
	"time"
)

// State is what an engine holds right now and how what it held was freed,
// as GET /sim/state reports it. A router that strands KV or decode slots
// shows up here, where a real engine would only run short of memory.
type State struct {
	// HeldKV counts KV this engine holds for a decode that has not taken
	// it: a NIXL prefill's blocks until a decode pulls them, a decode's
	// notification releases them or KVTTL passes; an SGLang, Mooncake or
	// TensorRT-LLM prefill's KV not yet taken; P2P NCCL KV received and
	// not yet taken by its decode.
	HeldKV int `json:"held_kv"`
	// HeldSlots counts decode requests holding pre-allocated KV while they
	// wait for a prefill's (an SGLang decode on its bootstrap room, until
	// the KV comes, it is aborted or KVWaitTimeout passes).
	HeldSlots int `json:"held_slots"`
	// Waiting counts NIXL decodes in vLLM's waiting queue, not yet
	// scheduled (Config.DecodeQueueLatency).
	Waiting int `json:"waiting"`
	// KVPulled, KVReleased and KVExpired count held KV that a decode took,
	// that was freed without being taken (a vLLM decode's notification, an
	// SGLang /abort_request), and that was freed when KVTTL passed.
	KVPulled   int `json:"kv_pulled"`
	KVReleased int `json:"kv_released"`
	KVExpired  int `json:"kv_expired"`
	// Aborted counts requests aborted by SGLang's /abort_request.
	Aborted int `json:"aborted"`
	// BootstrapQueries counts GET /query calls to a Mooncake (vllm)
	// bootstrap server, except those of simulated decode engines (which,
	// like upstream's, ask once per bootstrap server and cache the answer):
	// the router's.
	BootstrapQueries int `json:"bootstrap_queries"`
	// LongPrefills counts vLLM prefill legs that generated more than one
	// token, and StreamedPrefills those answered as a stream: vLLM serves
	// both, so a router bug that sends them shows up here (and, for a
	// streamed NIXL prefill, as KV that expires unpulled).
	LongPrefills     int `json:"long_prefills"`
	StreamedPrefills int `json:"streamed_prefills"`
}

// stateReporter is a protocol that holds KV or counts events of its own.
type stateReporter interface {
	report(st *State, now time.Time)
}

// State returns what the engine holds and has freed.
func (s *Server) State() State {
	now := time.Now()
	var st State
	held, freed := s.kv.stats(now)
	st.HeldKV = held
	st.addFreed(freed)
	s.mu.Lock()
	st.HeldSlots, st.Waiting = s.slots, s.waiting
	st.LongPrefills, st.StreamedPrefills = s.longPrefills, s.streamedPrefills
	s.mu.Unlock()
	if r, ok := s.proto.(stateReporter); ok {
		r.report(&st, now)
	}
	return st
}

func (st *State) addFreed(f kvFreed) {
	st.KVPulled += f.pulled
	st.KVReleased += f.released
	st.KVExpired += f.expired
}

// addHandoffs counts the KV of h.
func (st *State) addHandoffs(h *handoffs, now time.Time) {
	held, freed := h.stats(now)
	st.HeldKV += held
	st.addFreed(freed)
}

// HeldKV is the number of KV entries this engine holds for a decode that
// has not taken them (see State.HeldKV): what a real prefill engine keeps
// pinned in GPU memory.
func (s *Server) HeldKV() int { return s.State().HeldKV }

// HeldSlots is the number of decode requests holding pre-allocated KV while
// they wait for a prefill's, as an SGLang decode does on its bootstrap room.
func (s *Server) HeldSlots() int { return s.State().HeldSlots }

// Released is the number of KV entries freed without a decode taking them:
// by a vLLM decode's notification after it was aborted before its pull
// (nixl_connector.py request_finished), or by SGLang's /abort_request.
func (s *Server) Released() int { return s.State().KVReleased }

// BootstrapQueries is the number of GET /query calls the engine's Mooncake
// (vllm) bootstrap server answered for callers other than simulated decode
// engines: upstream's proxy asks once per prefill engine, not per request.
func (s *Server) BootstrapQueries() int { return s.State().BootstrapQueries }

// holdSlot counts a decode as holding pre-allocated KV until the returned
// function is called.
func (s *Server) holdSlot() func() {
	s.mu.Lock()
	s.slots++
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		s.slots--
		s.mu.Unlock()
	}
}

// detached is ctx without its cancellation, for work the engine finishes
// whether or not the client stays (a scheduled KV read, a notification to a
// peer); it still ends when Close gives up on in-flight requests.
func (s *Server) detached(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(s.base, cancel)
	return ctx, func() {
		stop()
		cancel()
	}
}
