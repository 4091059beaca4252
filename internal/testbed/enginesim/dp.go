package enginesim

import (
	"net/http"
	"strconv"
	"strings"
)

// HeaderDPRank is the header in which vLLM's OpenAI server takes the DP rank
// that is to serve a request (serving.py, _get_data_parallel_rank).
const HeaderDPRank = "X-data-parallel-rank"

// dpSize is how many DP ranks the engine serves: Config.DPSize, at least 1.
func (s *Server) dpSize() int { return max(s.cfg.DPSize, 1) }

// engineID is the engine id of DP rank rank. vLLM suffixes each DP engine
// core's kv_transfer_config.engine_id with "_dp<rank>" when the engine is
// data parallel (EngineCoreProc.run_engine_core), so that NIXL peers name
// one rank's KV; a single engine keeps the id as configured.
func (s *Server) engineID(rank int) string {
	if s.cfg.DPSize <= 1 {
		return s.cfg.EngineID
	}
	return s.cfg.EngineID + "_dp" + strconv.Itoa(rank)
}

// engineIDs names the engine ids of the engine's ranks, for messages.
func (s *Server) engineIDs() string {
	if s.cfg.DPSize <= 1 {
		return strconv.Quote(s.cfg.EngineID)
	}
	return strconv.Quote(s.engineID(0)) + " to " + strconv.Quote(s.engineID(s.cfg.DPSize-1))
}

// rankOfEngineID returns the DP rank whose engine id is id, false if no
// rank of the engine has it.
func (s *Server) rankOfEngineID(id string) (int, bool) {
	if s.cfg.DPSize <= 1 {
		return 0, id == s.cfg.EngineID
	}
	n, ok := strings.CutPrefix(id, s.cfg.EngineID+"_dp")
	if !ok {
		return 0, false
	}
	r, err := strconv.Atoi(n)
	if err != nil || r < 0 || r >= s.cfg.DPSize || strconv.Itoa(r) != n {
		return 0, false
	}
	return r, true
}

// servingRank decides the DP rank that serves a request: the one the router
// named (named true), as the engine family reads it, or else one the engine
// picks itself (round robin; real engines balance on their queues). A rank
// out of range is refused with 400, as the engines refuse it.
func (s *Server) servingRank(r *http.Request, req *inferenceRequest) (rank int, named bool, err error) {
	asked, named, err := s.askedRank(r, req)
	if err != nil || named {
		return asked, named, err
	}
	if s.cfg.DPSize <= 1 {
		return 0, false, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nextRank = (s.nextRank + 1) % s.cfg.DPSize
	return s.nextRank, false, nil
}

// askedRank reads the rank the router named, if any.
func (s *Server) askedRank(r *http.Request, req *inferenceRequest) (int, bool, error) {
	switch dialectOf(s.cfg.Connector) {
	case dialectVLLM:
		// A value that is not an integer is ignored (int() fails, None).
		v := r.Header.Get(HeaderDPRank)
		if v == "" {
			return 0, false, nil
		}
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return 0, false, nil
		}
		// InputProcessor.process_inputs raises VLLMValidationError, which
		// the OpenAI server answers with 400.
		if n < 0 || n >= s.dpSize() {
			return 0, false, badRequest("data_parallel_rank %d is out of range [0, %d).", n, s.dpSize())
		}
		return n, true, nil
	case dialectSGLang:
		// data_parallel_rank is routed_dp_rank's deprecated name.
		name := "routed_dp_rank"
		if !req.has(name) || string(req.fields[name]) == "null" {
			name = "data_parallel_rank"
		}
		if !req.has(name) || string(req.fields[name]) == "null" {
			return 0, false, nil
		}
		n, err := req.intField(name)
		if err != nil {
			return 0, false, err
		}
		// TokenizerManager: rank 0 of an engine without DP is ignored;
		// any other out-of-range rank is a ValueError, answered with 400.
		if s.cfg.DPSize <= 1 && n == 0 {
			return 0, false, nil
		}
		if n < 0 || n >= int64(s.dpSize()) {
			return 0, false, badRequest("routed_dp_rank=%d out of range [0, %d)", n, s.dpSize())
		}
		return int(n), true, nil
	}
	return 0, false, nil // TensorRT-LLM takes no rank per request
}

// prefillRank reads an SGLang decode's disagg_prefill_dp_rank: the prefill
// DP rank whose bootstrap it takes the KV from; false when absent (the
// decode then asks the prefill's bootstrap server which rank has the room).
func prefillRank(req *inferenceRequest) (int, bool, error) {
	const name = "disagg_prefill_dp_rank"
	if !req.has(name) || string(req.fields[name]) == "null" {
		return 0, false, nil
	}
	n, err := req.intField(name)
	if err != nil {
		return 0, false, err
	}
	if n < 0 {
		return 0, false, badRequest("%s must not be negative, got %d", name, n)
	}
	return int(n), true, nil
}

// rankedKey is the key of a hand-off's KV on a prefill, by rank: each DP
// rank keeps its own (an SGLang room's bootstrap registration, a Mooncake
// transfer on the rank's engine). An engine without DP ranks keys by the
// hand-off's own key alone.
func (s *Server) rankedKey(key string, rank int) string {
	if s.cfg.DPSize <= 1 && rank == 0 {
		return key
	}
	return key + "@dp" + strconv.Itoa(rank)
}
