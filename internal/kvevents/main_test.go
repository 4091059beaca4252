package kvevents

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// zmq4 v0.17.0's PUB socket starts a writer goroutine (newPubMWriter)
	// that its Close never stops: one per publisher of the tests (the
	// engine simulators' and their own), not ours to end.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
