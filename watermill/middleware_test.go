package pgidemwatermill_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemwatermill "github.com/pgidem/pgidem/watermill"
)

// effectHandler writes a runs row for the message's key and produces one message; it
// returns the result of fail (nil: none) instead when fail is set.
func effectHandler(b *bundle, runs *atomic.Int32, fail func(n int32) error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		n := runs.Add(1)
		if fail != nil {
			if err := fail(n); err != nil {
				return nil, err
			}
		}
		_, key, _ := pgidem.KeyFromContext(msg.Context())
		if _, err := b.pool.Exec(msg.Context(), `INSERT INTO runs (key) VALUES ($1)`, key); err != nil {
			return nil, err
		}
		out := message.NewMessage("out-"+msg.UUID, []byte("invoice for "+string(msg.Payload)))
		out.Metadata.Set("source", msg.UUID)
		return []*message.Message{out}, nil
	}
}

func TestHandler(t *testing.T) {
	t.Parallel()

	t.Run("RunsOnceAndReplaysProducedMessages", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, nil).Handler(effectHandler(b, &runs, nil))
		for i := range 3 {
			msg := orderMessage("m-1", "order-9", "evt-9")
			out, err := h(msg)
			require.NoError(t, err, "delivery %d", i+1)
			require.Len(t, out, 1)
			require.Equal(t, "out-m-1", out[0].UUID)
			require.Equal(t, "m-1", out[0].Metadata.Get("source"))
			require.Equal(t, `invoice for {"order":"order-9"}`, string(out[0].Payload))
		}
		require.Equal(t, int32(1), runs.Load())
		require.Equal(t, 1, b.count(t, "runs", "key = $1", "evt-9"))
	})

	t.Run("KeyFromMetadataJoinsMessagesWithDifferentUUIDs", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, nil).Handler(effectHandler(b, &runs, nil))
		for _, uuid := range []string{"m-1", "m-2"} {
			_, err := h(orderMessage(uuid, "order-9", "evt-9"))
			require.NoError(t, err)
		}
		require.Equal(t, int32(1), runs.Load())
	})

	t.Run("UUIDIsTheKeyWithoutMetadata", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, nil).Handler(effectHandler(b, &runs, nil))
		for _, uuid := range []string{"m-1", "m-1", "m-2"} {
			_, err := h(message.NewMessage(uuid, []byte("{}")))
			require.NoError(t, err)
		}
		require.Equal(t, int32(2), runs.Load())
		require.Equal(t, 1, b.count(t, "runs", "key = $1", "m-1"))
		require.Equal(t, 1, b.count(t, "runs", "key = $1", "m-2"))
	})

	t.Run("HandlerErrorReleasesForTheRedelivery", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		errBoom := errors.New("smtp timeout")
		h := b.newMiddleware(t, nil).Handler(effectHandler(b, &runs, func(n int32) error {
			if n == 1 {
				return errBoom
			}
			return nil
		}))
		_, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.ErrorIs(t, err, errBoom)
		out, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err)
		require.Len(t, out, 1)
		require.Equal(t, int32(2), runs.Load())
		require.Equal(t, 1, b.count(t, "runs", "key = $1", "evt-9"))
	})

	t.Run("InvalidKeyNeverRunsTheHandler", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		cases := map[string]pgidemwatermill.KeyFunc{
			"Empty":      func(*message.Message) (string, error) { return "", nil },
			"NUL":        func(*message.Message) (string, error) { return "order\x009", nil },
			"TooLong":    func(*message.Message) (string, error) { return strings.Repeat("k", 300), nil },
			"KeyFuncErr": func(*message.Message) (string, error) { return "", errors.New("no order id") },
		}
		for name, key := range cases {
			var runs atomic.Int32
			h := b.newMiddleware(t, &pgidemwatermill.Config{Key: key}).Handler(effectHandler(b, &runs, nil))
			out, err := h(orderMessage("m-1", "order-9", "evt-9"))
			require.Error(t, err, name)
			require.Nil(t, out, name)
			if name != "KeyFuncErr" {
				require.ErrorIs(t, err, pgidem.ErrInvalidKey, name)
			}
			require.Zero(t, runs.Load(), name)
		}
		require.Zero(t, b.count(t, "runs", "true"))
	})

	t.Run("InProgressNacksWithoutRunning", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, &pgidemwatermill.Config{Namespace: "billing", InFlight: pgidem.InFlightRaise}).
			Handler(effectHandler(b, &runs, nil))
		held, release, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
		go func() {
			_, err := pgidem.Do(context.Background(), b.coord, "billing", "evt-9", time.Hour, nil,
				func(context.Context) ([]any, error) { close(held); <-release; return nil, nil })
			done <- err
		}()
		<-held
		out, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.ErrorIs(t, err, pgidem.ErrInProgress)
		var inProgress *pgidem.InProgressError
		require.ErrorAs(t, err, &inProgress)
		require.Nil(t, out)
		require.Zero(t, runs.Load())
		close(release)
		require.NoError(t, <-done)
		// The redelivery after the holder completed replays its (empty) outcome.
		out, err = h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err)
		require.Empty(t, out)
		require.Zero(t, runs.Load())
	})

	t.Run("InFlightWaitReplaysTheHoldersMessages", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		entered, proceed := make(chan struct{}), make(chan struct{})
		h := b.newMiddleware(t, &pgidemwatermill.Config{InFlight: pgidem.InFlightWait}).Handler(
			effectHandler(b, &runs, func(n int32) error {
				if n == 1 {
					close(entered)
					<-proceed
				}
				return nil
			}))
		first := make(chan error, 1)
		go func() {
			_, err := h(orderMessage("m-1", "order-9", "evt-9"))
			first <- err
		}()
		<-entered
		second := make(chan []*message.Message, 1)
		go func() {
			out, err := h(orderMessage("m-1", "order-9", "evt-9"))
			if err != nil {
				out = nil
			}
			second <- out
		}()
		close(proceed)
		require.NoError(t, <-first)
		out := <-second
		require.Len(t, out, 1)
		require.Equal(t, "out-m-1", out[0].UUID)
		require.Equal(t, int32(1), runs.Load())
	})

	t.Run("StoredFailure", func(t *testing.T) {
		t.Parallel()
		for name, policy := range map[string]pgidemwatermill.StoredFailurePolicy{
			"Ack": pgidemwatermill.StoredFailureAck, "Error": pgidemwatermill.StoredFailureError,
		} {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, nil)
				var runs atomic.Int32
				errDeclined := errors.New("card declined")
				h := b.newMiddleware(t, &pgidemwatermill.Config{StoredFailure: policy}).Handler(
					effectHandler(b, &runs, func(int32) error { return pgidem.Permanent(errDeclined) }))
				for i := range 2 {
					out, err := h(orderMessage("m-1", "order-9", "evt-9"))
					require.Nil(t, out)
					if policy == pgidemwatermill.StoredFailureAck {
						require.NoError(t, err, "delivery %d", i+1)
					} else {
						require.ErrorIs(t, err, pgidem.ErrPermanent, "delivery %d", i+1)
					}
				}
				require.Equal(t, int32(1), runs.Load())
			})
		}
	})

	t.Run("FingerprintMismatchNacks", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, &pgidemwatermill.Config{
			Fingerprint: func(msg *message.Message) []byte { return msg.Payload },
		}).Handler(effectHandler(b, &runs, nil))
		_, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err)
		_, err = h(orderMessage("m-2", "order-10", "evt-9"))
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		require.Equal(t, int32(1), runs.Load())
	})

	t.Run("MessagesTooLargeToStoreAreAckedOnceAndNotRerun", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &pgidem.Config{MaxValueBytes: 1024})
		var runs atomic.Int32
		h := b.newMiddleware(t, nil).Handler(func(msg *message.Message) ([]*message.Message, error) {
			runs.Add(1)
			return []*message.Message{message.NewMessage("out-1", make([]byte, 4096))}, nil
		})
		out, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err) // the effect ran: acked with its messages
		require.Len(t, out, 1)
		out, err = h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err) // the redelivery is acked without them, and the handler does not run again
		require.Nil(t, out)
		require.Equal(t, int32(1), runs.Load())
	})

	t.Run("HandlerSeesTheKeyAndTheContextIsRestored", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		type ctxKey struct{}
		parent := context.WithValue(context.Background(), ctxKey{}, "outer")
		msg := orderMessage("m-1", "order-9", "evt-9")
		msg.SetContext(parent)
		var namespace, key string
		var outer any
		h := b.newMiddleware(t, &pgidemwatermill.Config{Namespace: "billing"}).Handler(
			func(msg *message.Message) ([]*message.Message, error) {
				namespace, key, _ = pgidem.KeyFromContext(msg.Context())
				outer = msg.Context().Value(ctxKey{})
				return nil, nil
			})
		_, err := h(msg)
		require.NoError(t, err)
		require.Equal(t, "billing", namespace)
		require.Equal(t, "evt-9", key)
		require.Equal(t, "outer", outer)
		require.Equal(t, parent, msg.Context())
	})
}

func TestInboxHandler(t *testing.T) {
	t.Parallel()

	// ledgerHandler writes the ledger row in the inbox's transaction and sends the mail
	// through pgidem.Do keyed by the effect.
	ledgerHandler := func(b *bundle, runs *atomic.Int32, fail func(n int32) error) pgidemwatermill.TxHandlerFunc {
		return func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error) {
			n := runs.Add(1)
			order := msg.Metadata.Get("order")
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (order_id, message_uuid) VALUES ($1, $2)`, order, msg.UUID); err != nil {
				return nil, err
			}
			if err := b.sendInvoice(ctx, order); err != nil {
				return nil, err
			}
			if fail != nil {
				if err := fail(n); err != nil {
					return nil, err
				}
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
		}
	}

	t.Run("OneRowAndOneMailForThreeDeliveries", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, &pgidemwatermill.Config{Namespace: "billing"}).InboxHandler(ledgerHandler(b, &runs, nil))
		out, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err)
		require.Len(t, out, 1)
		for range 2 {
			out, err := h(orderMessage("m-1", "order-9", "evt-9"))
			require.NoError(t, err)
			require.Nil(t, out)
		}
		require.Equal(t, int32(1), runs.Load())
		require.Equal(t, 1, b.count(t, "ledger", "order_id = $1", "order-9"))
		require.Equal(t, 1, b.count(t, "mails", "key = $1", "order-9.invoice"))
	})

	t.Run("ErrorRollsBackAndTheRedeliveryRuns", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		errCrash := errors.New("died before the commit")
		h := b.newMiddleware(t, nil).InboxHandler(ledgerHandler(b, &runs, func(n int32) error {
			if n == 1 {
				return errCrash
			}
			return nil
		}))
		_, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.ErrorIs(t, err, errCrash)
		require.Zero(t, b.count(t, "ledger", "true"))
		_, err = h(orderMessage("m-1", "order-9", "evt-9"))
		require.NoError(t, err)
		require.Equal(t, int32(2), runs.Load())
		require.Equal(t, 1, b.count(t, "ledger", "true"))
		// The mail went out before the first rollback; its key replayed it on the rerun.
		require.Equal(t, 1, b.count(t, "mails", "true"))
	})

	t.Run("InvalidKeyNeverRunsTheHandler", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		h := b.newMiddleware(t, &pgidemwatermill.Config{
			Key: func(*message.Message) (string, error) { return "", nil },
		}).InboxHandler(ledgerHandler(b, &runs, nil))
		_, err := h(orderMessage("m-1", "order-9", "evt-9"))
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
		require.Zero(t, runs.Load())

		_, err = b.newMiddleware(t, nil).InboxHandler(nil)(orderMessage("m-1", "order-9", "evt-9"))
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	})
}
