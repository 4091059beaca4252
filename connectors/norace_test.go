//go:build !race

package connectors

const raceEnabled = false
