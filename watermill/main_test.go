package pgidemwatermill_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Sarama (under watermill-kafka) meters through go-metrics, whose meters share one
	// process-wide ticker goroutine that is started once and never stopped by design.
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"))
}
