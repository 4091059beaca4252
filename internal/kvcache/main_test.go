package kvcache

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(publisherEnv) != "" {
		os.Exit(runIngestPublisher())
	}
	// zmq4 v0.17.0's PUB socket starts a writer goroutine (newPubMWriter)
	// that its Close never stops: one per simulator publishing KV events.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
