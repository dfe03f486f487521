package pgidemwatermill_test

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kfake"
)

func TestKafka(t *testing.T) {
	t.Parallel()
	for name, mode := range labModes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			const topic = "orders"
			// Kafka is real: an in-process kfake cluster speaks the Kafka protocol to
			// watermill-kafka's Sarama clients.
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
			require.NoError(t, err)
			defer cluster.Close()
			brokers := cluster.ListenAddrs()

			pub, err := kafka.NewPublisher(kafka.PublisherConfig{
				Brokers: brokers, Marshaler: kafka.DefaultMarshaler{},
			}, watermill.NopLogger{})
			require.NoError(t, err)
			defer pub.Close()
			saramaConfig := kafka.DefaultSaramaSubscriberConfig()
			saramaConfig.Consumer.Offsets.Initial = sarama.OffsetOldest
			sub, err := kafka.NewSubscriber(kafka.SubscriberConfig{
				Brokers: brokers, Unmarshaler: kafka.DefaultMarshaler{},
				ConsumerGroup: "billing", OverwriteSaramaConfig: saramaConfig,
			}, watermill.NopLogger{})
			require.NoError(t, err)
			defer sub.Close()
			requireLabCounts(t, mode, runLab(t, b, mode, pub, sub, topic))
		})
	}
}
