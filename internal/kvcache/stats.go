package kvcache

import (
	"maps"
	"slices"
	"strings"
)

// counters are the Index's running counts (Stats), under its lock.
type counters struct {
	batches, events, stored, removed           uint64
	orphans, orphansDropped, joined            uint64
	malformed, unknownRemovals, ignoredGroups  uint64
	ignoredMedia, blockSize, conflicts, noSlot uint64
	overflows                                  uint64
	resets                                     map[string]uint64
}

// Stats is a snapshot of an Index, for metrics.
type Stats struct {
	// Batches and Events are those applied.
	Batches, Events uint64
	// StoredBlocks and RemovedBlocks are the engine blocks of the
	// BlockStored and BlockRemoved events applied.
	StoredBlocks, RemovedBlocks uint64
	// Orphans are stored blocks whose parent was unknown (stored before
	// the subscription, or dropped by a reset): kept apart, unmatched,
	// until they join (orphans.go). OrphansDropped are those of them not
	// kept, beyond an engine's bound; Joined the orphans that joined the
	// index when the block they waited for was stored under a known
	// prefix.
	Orphans, OrphansDropped, Joined uint64
	// Malformed are events that contradict themselves (token ids other
	// than block size × blocks, an unknown kind).
	Malformed uint64
	// UnknownRemovals are removed blocks the index did not have.
	UnknownRemovals uint64
	// IgnoredGroups are events of cache groups that do not count as
	// prefix hits: not full attention, or not the engine's lead group.
	IgnoredGroups uint64
	// IgnoredMedia are events of tiers other than GPU and CPU.
	IgnoredMedia uint64
	// BlockSizeMismatches are stored events whose block size is not a
	// multiple of Config.BlockSize (or changed within a rank's tier).
	BlockSizeMismatches uint64
	// Conflicts are engine hashes stored again with other content.
	Conflicts uint64
	// NoSlot are events of engines beyond MaxEngines, dropped.
	NoSlot uint64
	// Overflows are engines reset for holding more than MaxEntries.
	Overflows uint64
	// Resets are the Reset calls by reason.
	Resets map[string]uint64
	// Blocks are the distinct pdx blocks some engine holds, on each tier
	// (a block on both counts twice); LoRANames the adapter names seen.
	Blocks, LoRANames int
	// Engines by address.
	Engines []EngineStats
}

// EngineStats is one engine's part of Stats.
type EngineStats struct {
	Address string
	// Slot is the handle of its slot (Register).
	Slot int32
	// GPUBlocks and CPUBlocks are the distinct pdx blocks it holds on the
	// tier, over its ranks.
	GPUBlocks, CPUBlocks int
	// Entries are the engine block hashes tracked (MaxEntries bounds them),
	// Orphans the engine blocks it holds as orphans (among the Entries).
	Entries, Orphans int
	Events           uint64
}

// Stats returns a snapshot of x's counts.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	c := &x.stats
	st := Stats{
		Batches: c.batches, Events: c.events,
		StoredBlocks: c.stored, RemovedBlocks: c.removed,
		Orphans: c.orphans, OrphansDropped: c.orphansDropped, Joined: c.joined, Malformed: c.malformed,
		UnknownRemovals: c.unknownRemovals, IgnoredGroups: c.ignoredGroups,
		IgnoredMedia: c.ignoredMedia, BlockSizeMismatches: c.blockSize,
		Conflicts: c.conflicts, NoSlot: c.noSlot, Overflows: c.overflows,
		Resets: maps.Clone(c.resets),
		Blocks: x.blocks[tierGPU] + x.blocks[tierCPU], LoRANames: len(x.loras),
		Engines: make([]EngineStats, 0, len(x.engines)),
	}
	for _, e := range x.engines {
		st.Engines = append(st.Engines, EngineStats{
			Address: e.addr, Slot: x.handle(e.slot),
			GPUBlocks: e.blocks[tierGPU], CPUBlocks: e.blocks[tierCPU],
			Entries: e.entries, Orphans: e.orphans, Events: e.events,
		})
	}
	slices.SortFunc(st.Engines, func(a, b EngineStats) int { return strings.Compare(a.Address, b.Address) })
	return st
}
