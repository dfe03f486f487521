package pgidemwatermill_test

import (
	"context"
	"fmt"
	"log"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemwatermill "github.com/pgidem/pgidem/watermill"
)

// A router's handler sends an invoice mail per order.created event. The publisher sends the
// event twice (it retried after a lost confirmation); the middleware runs the handler for
// the first copy and replays its outcome to the second. Watermill's GoChannel stands in for
// the broker here; the package's tests run the same on RabbitMQ and Kafka.
func ExampleMiddleware_Handler() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // in your program: a pool on a database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	mw, err := pgidemwatermill.NewMiddleware(coord, nil)
	if err != nil {
		log.Fatal(err)
	}

	// Publish blocks until the handler acked the message, so the example prints in order.
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		log.Fatal(err)
	}
	router.AddMiddleware(mw.Handler)
	var mails atomic.Int32
	router.AddConsumerHandler("billing", "orders", pubSub, func(msg *message.Message) error {
		_, key, _ := pgidem.KeyFromContext(msg.Context())
		mails.Add(1) // a real mailer gets key as its own idempotency key
		fmt.Println("mail sent under key", key)
		return nil
	})
	go func() {
		if err := router.Run(ctx); err != nil {
			log.Print(err)
		}
	}()
	<-router.Running()

	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":"order-9"}`))
	msg.Metadata.Set(pgidemwatermill.KeyMetadataDefault, "order-9.invoice") // the effect
	for range 2 {
		if err := pubSub.Publish("orders", msg.Copy()); err != nil {
			log.Fatal(err)
		}
	}
	if err := router.Close(); err != nil {
		log.Fatal(err)
	}
	if err := pubSub.Close(); err != nil {
		log.Fatal(err)
	}
	fmt.Println("deliveries: 2, mails sent:", mails.Load())
	// Output:
	// mail sent under key order-9.invoice
	// deliveries: 2, mails sent: 1
}
