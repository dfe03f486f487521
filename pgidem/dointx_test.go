package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// DoInTx commits the failed record of a Permanent error (fn's writes are undone): the next
// call replays it as a *StoredFailureError without running fn.
func TestDoInTxPermanentFailureIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) {
		runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('charge')`); err != nil {
			return "", err
		}
		return "", pgidem.Permanent(errors.New("card declined"))
	}
	_, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	var permanent *pgidem.PermanentError
	require.ErrorAs(t, err, &permanent, "the first call returns fn's own error")
	rec := b.lookup(t, "charge", "order-1")
	require.Equal(t, pgidem.StatusFailed, rec.Status, "the failure was committed")
	require.Zero(t, b.ledgerRows(t, "charge"), "fn's writes were undone")

	_, err = pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	var stored *pgidem.StoredFailureError
	require.ErrorAs(t, err, &stored, "the second call replays the stored permanent failure")
	require.Equal(t, "card declined", stored.Error())
	require.EqualValues(t, 1, runs.Load(), "a permanent failure is not retried")
	require.Zero(t, b.ledgerRows(t, "charge"))
}

// DoInTxResult reports how the value was obtained: run, then replayed.
func TestDoInTxResult(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, replayed := range []bool{false, true} {
		res, err := pgidem.DoInTxResult(b.ctx, b.coord, "ledger", "order-2", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (int, error) { return 42, nil })
		require.NoError(t, err)
		require.Equal(t, 42, res.Value, "call %d", i)
		require.Equal(t, replayed, res.Replayed, "call %d", i)
		require.Equal(t, 1, res.Attempts, "call %d", i)
	}
}

// An ordinary error from fn still rolls DoInTx's transaction back: nothing is recorded and
// the next call runs fn again.
func TestDoInTxOrdinaryErrorIsNotStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) {
		if runs.Add(1) == 1 {
			return "", errors.New("timeout")
		}
		return "ok", nil
	}
	_, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.EqualError(t, err, "timeout")
	require.Zero(t, b.count(t))
	v, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, "ok", v)
}
