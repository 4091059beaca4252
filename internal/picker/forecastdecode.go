package picker

// forecastDecode is Forecast on a decode leg: among the usable
// candidates, first those whose KV has room for the sequence now
// (kvRoom), then the one holding the most of its prompt, then the one
// with the fewest requests (requests); ties go round.
//
// Room comes first because a decode that finds none waits, first come
// first served, until sequences before it finish: on the cache-bound rig
// with the decode engines' KV cut to 180 blocks, an oracle placing by the
// engines' true state did as well by room first as by its own pick, and
// lost 9 points of goodput by the fewest requests alone
// (docs/placement.md, "The decode leg under KV pressure"). The held
// prefix comes next, before the batch (the two orders were within the
// runs' spread there), because the blocks an engine holds are not pulled
// again and are shared with the sequences that hold them: they take none
// of its free KV.
//
// No engine's KV is tracked by pdx between the engine's samples: an
// engine without a fresh sample, or whose sample does not say its KV's
// size (a vLLM without cache_config_info), counts as having room, as a
// stale load does not make an endpoint saturated.
func forecastDecode(c *Candidates) int {
	gs := c.all()
	mean, usable := meanInFlight(gs, c.tokens)
	if !usable {
		return -1
	}
	var d depths
	prefix := c.hasPrompt()
	if prefix {
		d = c.depths()
	}
	n := len(gs)
	best, bestRoom, bestHeld, bestReqs := -1, false, 0, 0
	// k goes round from start without a division a candidate.
	for j, k := 0, c.Start(); j < n; j, k = j+1, k+1 {
		if k == n {
			k = 0
		}
		g := &gs[k]
		if !g.usable {
			continue
		}
		held := 0
		if prefix {
			held = d.cachedTokens(k)
		}
		room := kvRoom(g, mean, c.tokens-held)
		reqs := g.requests()
		switch {
		case best < 0,
			room && !bestRoom,
			room == bestRoom && held > bestHeld,
			room == bestRoom && held == bestHeld && reqs < bestReqs:
			best, bestRoom, bestHeld, bestReqs = k, room, held, reqs
		}
	}
	return best
}

// kvRoom reports whether the engine of g would admit a sequence
// needing need more tokens of KV now, by its fresh sample: none of its
// requests waits (vLLM admits first come first served, so a new one
// waits behind any queued), and its free KV less mean tokens for each
// request pdx detached there since the sample (they arrive first) holds
// need. need is the prompt less what the engine holds of it: vLLM
// admits a sequence on its prompt's blocks and grows it as it decodes.
func kvRoom(g *signal, mean, need int) bool {
	if !g.fresh {
		return true
	}
	if g.waiting > 0 {
		return false
	}
	if g.kvTokens <= 0 || g.kvUsage < 0 {
		return true
	}
	free := (1-g.kvUsage)*float64(g.kvTokens) - float64(g.pending*mean)
	return free >= float64(need)
}
