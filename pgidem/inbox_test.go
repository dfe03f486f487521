package pgidem_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func (b *testBundle) inboxRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_inbox`).Scan(&n))
	return n
}

// ledgerHandler is an inbox handler that writes one ledger row.
func ledgerHandler(ref string, runs *atomic.Int32) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ($1)`, ref)
		return err
	}
}

func TestInboxHandleOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	opts := &pgidem.InboxOpts{Payload: []byte(`{"order":"order-9"}`)}

	handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", opts, ledgerHandler("order-9", &runs))
	require.NoError(t, err)
	require.True(t, handled)
	handled, err = b.coord.InboxHandle(b.ctx, "billing", "evt-1", opts, ledgerHandler("order-9", &runs))
	require.NoError(t, err)
	require.False(t, handled, "a redelivery is skipped")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, b.ledgerRows(t, "order-9"))

	handled, err = b.coord.InboxHandle(b.ctx, "audit", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.True(t, handled, "another consumer has its own inbox")

	var payload string
	var retention time.Duration
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `
SELECT payload::text, extract(epoch FROM expires_at - received_at)::bigint * 1000000000
FROM pgidem_inbox WHERE consumer = 'billing' AND message_id = 'evt-1'`).Scan(&payload, &retention))
	require.JSONEq(t, `{"order":"order-9"}`, payload)
	require.Equal(t, pgidem.InboxRetentionDefault, retention)
}

func TestInboxConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32

	const n = 16
	handled := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			handled[i], errs[i] = b.coord.InboxHandle(b.ctx, "billing", "evt-16", nil, ledgerHandler("order-16", &runs))
		})
	}
	wg.Wait()
	ran := 0
	for i := range n {
		require.NoError(t, errs[i], "delivery %d", i)
		if handled[i] {
			ran++
		}
	}
	require.Equal(t, 1, ran, "one delivery handled the message")
	require.EqualValues(t, 1, runs.Load(), "the handler ran once; the others skipped")
	require.Equal(t, 1, b.ledgerRows(t, "order-16"))
	require.Equal(t, 1, b.inboxRows(t))
}

func TestInboxRollbackThenDuplicateRuns(t *testing.T) {
	t.Parallel()

	t.Run("Sequential", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.createLedger(t)
		var runs atomic.Int32
		tx := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "evt-1", nil)
		require.NoError(t, err)
		require.True(t, isNew)
		require.NoError(t, ledgerHandler("order-1", &runs)(b.ctx, tx))
		require.NoError(t, tx.Rollback(b.ctx))
		require.Zero(t, b.inboxRows(t))

		handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
		require.NoError(t, err)
		require.True(t, handled)
		require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.createLedger(t)
		var runs atomic.Int32
		first := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, first, "billing", "evt-1", nil)
		require.NoError(t, err)
		require.True(t, isNew)

		type outcome struct {
			handled bool
			err     error
		}
		dup := make(chan outcome, 1)
		go func() {
			handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
			dup <- outcome{handled, err}
		}()
		b.waitForBlocked(t, "transactionid", 1) // the duplicate waits for the first delivery
		require.NoError(t, first.Rollback(b.ctx))
		out := <-dup
		require.NoError(t, out.err)
		require.True(t, out.handled, "the first delivery rolled back, so the duplicate runs")
		require.EqualValues(t, 1, runs.Load())
		require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	})
}

func TestInboxHandlerErrorRecordsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	errHandler := errors.New("downstream unavailable")
	handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('order-1')`)
		require.NoError(t, err)
		return errHandler
	})
	require.ErrorIs(t, err, errHandler)
	require.False(t, handled)
	require.Zero(t, b.inboxRows(t))
	require.Zero(t, b.ledgerRows(t, "order-1"))

	require.PanicsWithValue(t, "handler bug", func() {
		_, _ = b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error {
			panic("handler bug")
		})
	})
	require.Zero(t, b.inboxRows(t))

	var runs atomic.Int32
	handled, err = b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
	require.NoError(t, err)
	require.True(t, handled, "the redelivery runs the handler")
	require.Equal(t, 1, b.ledgerRows(t, "order-1"))
}

func TestInboxDuplicateKeepsTxUsable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	handled, err := b.coord.InboxHandle(b.ctx, "billing", "committed", nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.True(t, handled)

	tx := b.begin(t)
	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "committed", nil)
	require.NoError(t, err)
	require.False(t, isNew, "a committed duplicate")
	requireUsable(t, b.ctx, tx)

	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "in-this-tx", nil)
	require.NoError(t, err)
	require.True(t, isNew)
	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "in-this-tx", nil)
	require.NoError(t, err)
	require.False(t, isNew, "a duplicate within the same transaction")
	requireUsable(t, b.ctx, tx)
	_, err = tx.Exec(b.ctx, `INSERT INTO ledger (ref) VALUES ('after')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, 1, b.ledgerRows(t, "after"))
	require.Equal(t, 2, b.inboxRows(t))
}

func TestInboxInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	tests := []struct {
		name      string
		consumer  string
		messageID string
		opts      *pgidem.InboxOpts
		want      error
	}{
		{"EmptyConsumer", "", "m", nil, pgidem.ErrInvalidKey},
		{"EmptyMessageID", "c", "", nil, pgidem.ErrInvalidKey},
		{"ControlCharacter", "c", "m\n", nil, pgidem.ErrInvalidKey},
		{"LongMessageID", "c", strings.Repeat("m", pgidem.MaxKeyBytesDefault+1), nil, pgidem.ErrInvalidKey},
		{"LongConsumer", strings.Repeat("c", pgidem.MaxNamespaceBytesDefault+1), "m", nil, pgidem.ErrInvalidKey},
		{"ShortRetention", "c", "m", &pgidem.InboxOpts{Retention: time.Second}, pgidem.ErrInvalidTTL},
		{"PayloadNotJSON", "c", "m", &pgidem.InboxOpts{Payload: []byte("{")}, pgidem.ErrInvalidPayload},
		{"PayloadNulEscape", "c", "m", &pgidem.InboxOpts{Payload: []byte(`"\u0000"`)}, pgidem.ErrInvalidPayload},
		// Over Config.MaxValueBytes. Such a payload (17 M array elements) used to reach
		// jsonb, fail with an internal error, and abort the caller's transaction.
		{"PayloadTooLarge", "c", "m", &pgidem.InboxOpts{Payload: []byte(`"` + strings.Repeat("x", pgidem.MaxValueBytesDefault) + `"`)}, pgidem.ErrInvalidPayload},
		{"NilFn", "c", "m", nil, pgidem.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var ran atomic.Bool
			fn := func(ctx context.Context, tx pgx.Tx) error { ran.Store(true); return nil }
			if tt.want == pgidem.ErrInvalidArgument {
				fn = nil
			}
			handled, err := b.coord.InboxHandle(b.ctx, tt.consumer, tt.messageID, tt.opts, fn)
			require.Error(t, err)
			if tt.want != nil {
				require.ErrorIs(t, err, tt.want)
			}
			require.False(t, handled)
			require.False(t, ran.Load())

			if fn == nil {
				return // InboxRecordTx takes no fn
			}
			tx := b.begin(t)
			_, err = b.coord.InboxRecordTx(b.ctx, tx, tt.consumer, tt.messageID, tt.opts)
			require.ErrorIs(t, err, tt.want)
			requireUsable(t, b.ctx, tx)
		})
	}
}

func TestInboxRetention(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, id := range []string{"old-1", "old-2", "live"} {
		handled, err := b.coord.InboxHandle(b.ctx, "billing", id, nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
		require.NoError(t, err)
		require.True(t, handled)
	}
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_inbox SET expires_at = now() - interval '1 second' WHERE message_id LIKE 'old-%'`)
	require.NoError(t, err)

	// A row past its retention counts as absent before any sweep.
	tx := b.begin(t)
	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "old-1", nil)
	require.NoError(t, err)
	require.True(t, isNew, "an expired row behaves like no row")
	require.NoError(t, tx.Rollback(b.ctx))

	res, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 1})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Inbox, "expired rows are swept")
	require.Zero(t, res.Records)
	require.Equal(t, 1, b.inboxRows(t), "the live row is kept")

	tx = b.begin(t)
	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "live", nil)
	require.NoError(t, err)
	require.False(t, isNew)
}
