package picker

import (
	"slices"
	"sync/atomic"
)

// LoRA adapters. A request for an adapter (Request.Adapter) prefers, on
// either leg, the usable candidates that have the adapter loaded, then
// those with a free adapter slot, then the rest: the Set narrows the usable
// candidates to the best of these tiers before the policy chooses, so that
// health, saturation, group and subset rules hold as for any pick, and
// saturation (not the policy) is what moves an adapter's traffic off the
// engines that have it.
//
// What an engine has loaded is read from two signals:
//   - its fresh Load (vLLM's vllm:lora_requests_info): the adapters its
//     running and waiting requests use, and max_lora;
//   - what this pdx sent it (Options.Adapters only): vLLM keeps max_lora
//     adapters on the GPU and evicts the least recently used, so the
//     max_lora adapters pdx sent an engine most recently are taken to be
//     loaded there, whether or not a request of theirs runs now. Its
//     max_lora is the latest the engine reported, fresh or not (it is the
//     engine's configuration); 1 when it never reported one.
//
// A candidate has a free slot when pdx has sent it fewer distinct adapters
// than max_lora and, by its fresh Load, fewer distinct adapters run in its
// batch than max_lora (more would make vLLM hold the request back).

// AdapterLoad is what an engine says of its LoRA adapters (part of Load).
type AdapterLoad struct {
	// Running and Waiting are the adapters of its running and waiting
	// requests; MaxLoRA how many distinct adapters a batch may use, 0 when
	// the engine does not say.
	Running, Waiting []string
	MaxLoRA          int
}

// LoRAOutcome is how a pick for an adapter went.
type LoRAOutcome uint8

const (
	// LoRANone: the request is for no adapter.
	LoRANone LoRAOutcome = iota
	// LoRALoaded: the pick went to an endpoint with the adapter loaded.
	LoRALoaded
	// LoRAFreeSlot: to one with a free adapter slot.
	LoRAFreeSlot
	// LoRABlind: no usable endpoint had either; the policy chose as for
	// any request.
	LoRABlind
)

func (o LoRAOutcome) String() string {
	switch o {
	case LoRALoaded:
		return "loaded"
	case LoRAFreeSlot:
		return "free_slot"
	case LoRABlind:
		return "blind"
	}
	return "none"
}

// adapterTable numbers a Set's Options.Adapters, for endpoints to keep
// what was sent them in slices; a Set that inherits one with the same
// adapters shares it, and with it what its endpoints were sent.
type adapterTable struct {
	names []string
	// tick orders the sends: a later send has a greater tick.
	tick atomic.Int64
}

// index is name's number, -1 when t does not list it (or t is nil).
func (t *adapterTable) index(name string) int {
	if t == nil {
		return -1
	}
	return slices.Index(t.names, name)
}

// adapterMemory is what pdx sent one endpoint: for each adapter of table,
// the tick of its latest send, 0 for never.
type adapterMemory struct {
	table *adapterTable
	last  []atomic.Int64
}

// newAdapterTable is the table of adapters, prev's when it lists the same.
func newAdapterTable(adapters []string, prev *adapterTable) *adapterTable {
	if len(adapters) == 0 {
		return nil
	}
	if prev != nil && slices.Equal(prev.names, adapters) {
		return prev
	}
	return &adapterTable{names: slices.Clone(adapters)}
}

// remember gives h a memory of s's adapters, unless it has one already
// (a health shared with the Set s inherits, with the same table).
func (s *Set) remember(h *health) {
	if s.adapters == nil {
		return
	}
	if m := h.sent.Load(); m == nil || m.table != s.adapters {
		h.sent.Store(&adapterMemory{table: s.adapters, last: make([]atomic.Int64, len(s.adapters.names))})
	}
}

// sentAdapter notes that a request of adapter number i goes to h.
func (s *Set) sentAdapter(h *health, i int) {
	if i < 0 || h == nil {
		return
	}
	if m := h.sent.Load(); m != nil && m.table == s.adapters {
		m.last[i].Store(s.adapters.tick.Add(1))
	}
}

// Adapter tiers, best first.
const (
	tierLoaded uint8 = iota
	tierFree
	tierRest
)

// preferAdapter narrows c's usable candidates to those of the best tier
// for the request's adapter (see the top of this file) and says which
// tier that is. It reads every candidate, and changes nothing when no
// usable candidate is better than the rest.
func (c *Candidates) preferAdapter(adapter string) LoRAOutcome {
	if adapter == "" {
		return LoRANone
	}
	idx := c.now.set.adapters.index(adapter)
	gs := c.all()
	c.tiers = slices.Grow(c.tiers[:0], c.n)[:c.n]
	best := tierRest
	for k := range gs {
		// A saturated engine is no better a tier: the preference comes
		// before the policy, which would not weigh its queue against
		// the adapter (see queueWeigher).
		if !gs[k].usable || gs[k].saturated {
			c.tiers[k] = tierRest
			continue
		}
		t := c.tier(k, &gs[k], adapter, idx)
		c.tiers[k] = t
		best = min(best, t)
	}
	if best == tierRest {
		return LoRABlind
	}
	for k := range gs {
		if gs[k].usable && c.tiers[k] > best {
			gs[k].usable = false
		}
	}
	if best == tierLoaded {
		return LoRALoaded
	}
	return LoRAFreeSlot
}

// tier is candidate k's tier for adapter, number idx in the Set's table
// (-1: not listed there).
func (c *Candidates) tier(k int, g *signal, adapter string, idx int) uint8 {
	h := c.health(k)
	maxLoRA, running := 1, -1
	if l := h.load.Load(); l != nil && l.lora.MaxLoRA > 0 {
		maxLoRA = l.lora.MaxLoRA
		if g.fresh {
			if slices.Contains(l.lora.Running, adapter) || slices.Contains(l.lora.Waiting, adapter) {
				return tierLoaded
			}
			running = len(l.lora.Running)
		}
	}
	sent := 0
	if m := h.sent.Load(); m != nil && m.table == c.now.set.adapters {
		at, newer := int64(0), 0
		if idx >= 0 {
			at = m.last[idx].Load()
		}
		for j := range m.last {
			switch v := m.last[j].Load(); {
			case v == 0:
			case v > at && at > 0:
				newer++
				sent++
			default:
				sent++
			}
		}
		if at > 0 && newer < maxLoRA {
			return tierLoaded
		}
	}
	if sent < maxLoRA && running < maxLoRA {
		return tierFree
	}
	return tierRest
}
