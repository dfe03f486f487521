package pgidemwatermill_test

import (
	"cmp"
	"net"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/stretchr/testify/require"
)

// amqpURL is the RabbitMQ server the tests use: AMQP_URL, or the local server with
// RabbitMQ's default guest account.
func amqpURL(t *testing.T) string {
	t.Helper()
	raw := cmp.Or(os.Getenv("AMQP_URL"), "amqp://guest:guest@127.0.0.1:5672/")
	u, err := url.Parse(raw)
	require.NoError(t, err)
	// A missing broker fails the test: it is part of the suite, never skipped.
	conn, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatalf("RabbitMQ does not answer at %s (%v): start it (bash .ci/run installs and starts "+
			"Debian's rabbitmq-server), or set AMQP_URL", u.Host, err)
	}
	require.NoError(t, conn.Close())
	return raw
}

func TestRabbitMQ(t *testing.T) {
	t.Parallel()
	for name, mode := range labModes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			config := amqp.NewNonDurableQueueConfig(amqpURL(t))
			config.Queue.AutoDelete = true // the queue goes with the test's subscriber
			pub, err := amqp.NewPublisher(config, watermill.NopLogger{})
			require.NoError(t, err)
			defer pub.Close()
			sub, err := amqp.NewSubscriber(config, watermill.NopLogger{})
			require.NoError(t, err)
			defer sub.Close()
			topic := "pgidem_test_orders_" + watermill.NewShortUUID()
			requireLabCounts(t, mode, runLab(t, b, mode, pub, sub, topic))
		})
	}
}
