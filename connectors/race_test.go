//go:build race

package connectors

// raceEnabled reports a -race build, whose instrumentation changes escape
// analysis and with it allocation counts.
const raceEnabled = true
