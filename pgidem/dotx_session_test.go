package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Tests of DoTx against the caller's session: its timeouts, its cancellation, and fn
// calling back into pgidem.

// fn returns a Permanent error as the caller's context ends: the failure cannot be stored
// on that context, and fn's writes must still be undone. The savepoint used to count as
// closed before its ROLLBACK TO ran; the statement was refused on the cancelled context,
// fn's writes stayed in tx, and a caller that committed kept the effect with no record, so
// the next delivery ran fn again.
func TestDoTxPermanentAfterCancelUndoesWrites(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := func(cancel context.CancelFunc) func(ctx context.Context, tx pgx.Tx) (string, error) {
		return func(ctx context.Context, tx pgx.Tx) (string, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('charge')`); err != nil {
				return "", err
			}
			cancel() // the caller's deadline passes as fn returns
			return "", pgidem.Permanent(errors.New("card declined"))
		}
	}
	tx := b.begin(t)
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	_, err := pgidem.DoTx(ctx, b.coord, tx, "charge", "order-1", testTTL, nil, fn(cancel))
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.ErrorContains(t, err, "the failure was not stored")
	_, top := err.(*pgidem.FailureNotStoredError)
	require.True(t, top, "pgidem's verdict is the top-level error: %T", err)
	requireUsable(t, b.ctx, tx)
	var inTx int
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT count(*) FROM ledger WHERE ref = 'charge'`).Scan(&inTx))
	require.Zero(t, inTx, "fn's writes are undone")
	require.NoError(t, tx.Commit(b.ctx))

	_, err = pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn(func() {}))
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.Zero(t, b.ledgerRows(t, "charge"), "a permanent failure never commits its writes")
}

// fn calling DoTx (or Do) on its own key is refused at once. Nested DoTx in the same
// transaction used to find its own record, run fn eleven times and fail with a store
// error; Do inside Do's fn waited for itself until the wait timeout.
func TestCallForHeldKeyFromFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var outer, inner atomic.Int32
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			outer.Add(1)
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "k", testTTL, nil, ledgerInsert("r", &inner))
		})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.EqualValues(t, 1, outer.Load())
	require.Zero(t, inner.Load())
	require.Zero(t, b.ledgerRows(t, "r"))

	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	// Through another key (A's fn calls B, B's fn calls A): refused too. DoTx used to see
	// only the innermost key, and A's fn ran again inside B's, without end.
	outer.Store(0)
	var middle atomic.Int32
	var fnA func(ctx context.Context, tx pgx.Tx) (int64, error)
	fnA = func(ctx context.Context, tx pgx.Tx) (int64, error) {
		if outer.Add(1) > 3 {
			return 0, errors.New("A ran again inside itself")
		}
		return pgidem.DoTx(ctx, b.coord, tx, "ledger", "B", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			middle.Add(1)
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "A", testTTL, nil, fnA)
		})
	}
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "A", testTTL, nil, fnA)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.EqualValues(t, 1, outer.Load())
	require.EqualValues(t, 1, middle.Load())
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "A", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, b.coord, "mail", "B", testTTL, nil, func(ctx context.Context) (int, error) {
			return pgidem.Do(ctx, b.coord, "mail", "A", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		})
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	// Another key from within fn is fine.
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "outer", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "inner", testTTL, nil, ledgerInsert("inner", &inner))
		})
	require.NoError(t, err)
	require.Equal(t, 1, b.ledgerRows(t, "inner"))
}

// DoTx waiting for a Do holder leaves tx idle between its reads; each sleep stays inside
// the session's idle_in_transaction_session_timeout, which would otherwise end the
// caller's transaction (a sleep could reach 1.5 × PollIntervalMax, 1.5 s by default).
func TestDoTxWaitForDoKeepsTxAlive(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.hold(b.coord, "mail", "k", nil, "from-do")
	tx := b.begin(t)
	_, err := tx.Exec(b.ctx, `SET LOCAL idle_in_transaction_session_timeout = '1s'`)
	require.NoError(t, err)
	go func() {
		time.Sleep(4 * time.Second) // several of the waiter's longest sleeps
		h.unblock()
	}()
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL,
		&pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 30 * time.Second},
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
	require.NoError(t, <-h.done)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, "from-do", res.Value)
	requireUsable(t, b.ctx, tx)
}

// InboxHandle for a message from within the fn handling that message is refused at once;
// it used to wait for its own uncommitted inbox row until ctx ended (for ever without a
// deadline). So is InboxRecordTx for that message: on the handler's own tx it reported a
// duplicate (a helper doing so would skip the handler's writes), on another tx it waited
// like the nested InboxHandle. Another message, and a Do inside fn, are fine;
// KeyFromContext inside the handler still reports only record keys.
func TestInboxHandleNestedSameMessage(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute) // failure cap for the old hang
	defer cancel()
	inner := 0
	handled, err := b.coord.InboxHandle(ctx, "billing", "m1", nil, func(ctx context.Context, tx pgx.Tx) error {
		_, _, ok := pgidem.KeyFromContext(ctx)
		require.False(t, ok, "an inbox message is not a record key")
		_, err := b.coord.InboxHandle(ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { inner++; return nil })
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		isNew, err := b.coord.InboxRecordTx(ctx, tx, "billing", "m1", nil)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "not a duplicate: the handler's own message")
		require.False(t, isNew)
		requireUsable(t, ctx, tx)
		other, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = other.Rollback(b.ctx) }()
		_, err = b.coord.InboxRecordTx(ctx, other, "billing", "m1", nil)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		isNew, err = b.coord.InboxRecordTx(ctx, other, "billing", "m3", nil)
		require.NoError(t, err)
		require.True(t, isNew, "another message is recorded")
		ok2, err := b.coord.InboxHandle(ctx, "billing", "m2", nil, func(context.Context, pgx.Tx) error { inner++; return nil })
		require.NoError(t, err)
		require.True(t, ok2)
		return nil
	})
	require.NoError(t, err)
	require.True(t, handled)
	require.Equal(t, 1, inner)
}

// Coordinators on two different named schemas hold different records: a call for the
// same namespace and key on the other's coordinator from within fn is allowed (the guard
// used to compare namespace and key only). The default schema ("", the search_path's) may
// be any named one, so "" beside "public" is still refused: that nesting waits for itself.
func TestHeldKeyGuardIsPerSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE SCHEMA tenant2;
		CREATE TABLE tenant2.pgidem_record (LIKE public.pgidem_record INCLUDING ALL)`)
	require.NoError(t, err)
	public := b.newCoord(t, &pgidem.Config{Schema: "public"})
	tenant2 := b.newCoord(t, &pgidem.Config{Schema: "tenant2"})
	v, err := pgidem.Do(b.ctx, public, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, tenant2, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 7, nil })
	})
	require.NoError(t, err)
	require.Equal(t, 7, v)

	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k2", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, public, "mail", "k2", testTTL, nil, func(context.Context) (int, error) { return 7, nil })
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = b.coord.InboxHandle(b.ctx, "c", "m", nil, func(ctx context.Context, _ pgx.Tx) error {
		_, err := public.InboxHandle(ctx, "c", "m", nil, func(context.Context, pgx.Tx) error { return nil })
		return err
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
}
