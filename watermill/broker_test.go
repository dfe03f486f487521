package pgidemwatermill_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// errCrash stands for the consumer dying after the handler's effect and before the ack:
// the router nacks, and the broker delivers the message again.
var errCrash = errors.New("consumer died after the effect, before the ack")

// labMode is how the lab's handler is protected.
type labMode int

const (
	labHandler labMode = iota // Middleware.Handler: the handler runs under the message's key
	labInbox                  // Middleware.InboxHandler: the ledger row commits with the inbox row
	labNone                   // no pgidem: the control, which shows the duplicates the lab provokes
)

// labCounts are what one run of the lab counted.
type labCounts struct {
	deliveries, ledgerRows, mails int
}

// runLab is the lab's redelivery scene on a real broker: one order.created event reaches
// the handler three times — the publisher sends it twice (its first send's confirmation was
// lost, so it retries with the same UUID), and the first delivery's consumer dies after the
// effect and before the ack, so the broker redelivers it. The handler writes one ledger
// row and sends one invoice mail (pgidem.Do keyed "order-9.invoice"). It returns when the
// broker delivered the event three times and the last two were acked, and counts the
// effects in Postgres.
func runLab(t *testing.T, b *bundle, mode labMode, pub message.Publisher, sub message.Subscriber, topic string) labCounts {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitCap)
	defer cancel()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)

	var deliveries, acks atomic.Int32
	var crashed atomic.Bool
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			deliveries.Add(1)
			out, err := h(msg)
			if err == nil && crashed.CompareAndSwap(false, true) {
				return nil, errCrash
			}
			if err == nil {
				acks.Add(1)
			}
			return out, err
		}
	})
	mw := b.newMiddleware(t, nil)
	switch mode {
	case labHandler:
		router.AddMiddleware(mw.Handler)
		router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
			order := msg.Metadata.Get("order")
			if _, err := b.pool.Exec(msg.Context(), `INSERT INTO ledger (order_id, message_uuid) VALUES ($1, $2)`, order, msg.UUID); err != nil {
				return err
			}
			return b.sendInvoice(msg.Context(), order)
		})
	case labInbox:
		handle := mw.InboxHandler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error) {
			order := msg.Metadata.Get("order")
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (order_id, message_uuid) VALUES ($1, $2)`, order, msg.UUID); err != nil {
				return nil, err
			}
			return nil, b.sendInvoice(ctx, order)
		})
		router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
			_, err := handle(msg)
			return err
		})
	case labNone:
		router.AddConsumerHandler("billing", topic, sub, func(msg *message.Message) error {
			order := msg.Metadata.Get("order")
			if _, err := b.pool.Exec(msg.Context(), `INSERT INTO ledger (order_id, message_uuid) VALUES ($1, $2)`, order, msg.UUID); err != nil {
				return err
			}
			_, err := b.pool.Exec(msg.Context(), `INSERT INTO mails (key) VALUES ($1)`, order+".invoice")
			return err
		})
	}

	ran := make(chan error, 1)
	go func() { ran <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-ran:
		t.Fatalf("router stopped before it ran: %v", err)
	}
	// The publisher's retry: the same message, sent twice.
	for range 2 {
		require.NoError(t, pub.Publish(topic, orderMessage("m-9", "order-9", "evt-9")))
	}
	for deliveries.Load() < 3 || acks.Load() < 2 {
		select {
		case <-ctx.Done():
			t.Fatalf("after %s: %d deliveries, %d acks; want 3 deliveries, 2 acks", waitCap, deliveries.Load(), acks.Load())
		case err := <-ran:
			t.Fatalf("router stopped: %v", err)
		case <-time.After(pollInterval):
		}
	}
	require.NoError(t, router.Close())
	require.NoError(t, <-ran)
	return labCounts{
		deliveries: int(deliveries.Load()),
		ledgerRows: b.count(t, "ledger", "order_id = $1", "order-9"),
		mails:      b.count(t, "mails", "key = $1", "order-9.invoice"),
	}
}

// labModes are the lab's protections, by subtest name.
var labModes = map[string]labMode{"Handler": labHandler, "Inbox": labInbox, "WithoutPgidem": labNone}

// requireLabCounts asserts the lab's counts: three deliveries, one ledger row and one mail
// under pgidem; without it (the control), three of each.
func requireLabCounts(t *testing.T, mode labMode, c labCounts) {
	t.Helper()
	want := labCounts{deliveries: 3, ledgerRows: 1, mails: 1}
	if mode == labNone {
		want = labCounts{deliveries: 3, ledgerRows: 3, mails: 3}
	}
	require.Equal(t, want, c)
}
