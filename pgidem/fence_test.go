package pgidem_test

import (
	"context"
	"testing"

	"github.com/pgidem/pgidem/pgidem"
	"github.com/stretchr/testify/require"
)

// Inside Do's fn the fence carries the attempt and the owner token; after a takeover the
// stale holder's write made conditional on the fence is refused, while the new holder's
// is applied.
func TestFenceRefusesStaleHolder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE account (id int PRIMARY KEY, balance int, fence int NOT NULL DEFAULT 0);
		INSERT INTO account VALUES (1, 0, 0)`)
	require.NoError(t, err)
	// write is the effect's own conditional write: applied unless a later holder wrote.
	write := func(ctx context.Context, amount int) (bool, error) {
		f, ok := pgidem.FenceFromContext(ctx)
		require.True(t, ok)
		tag, err := b.db.Pool.Exec(ctx, `UPDATE account SET balance = balance + $1, fence = $2 WHERE id = 1 AND fence <= $2`, amount, f.Attempt)
		return tag.RowsAffected() == 1, err
	}

	_, ok := pgidem.FenceFromContext(b.ctx)
	require.False(t, ok, "a fence outside fn")

	started, resume := make(chan pgidem.Fence, 1), make(chan struct{})
	staleApplied, staleDone := make(chan bool, 1), make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "pay", "k", testTTL, nil, func(ctx context.Context) (int, error) {
			f, _ := pgidem.FenceFromContext(ctx)
			started <- f
			<-resume
			applied, err := write(context.WithoutCancel(ctx), 100)
			require.NoError(t, err)
			staleApplied <- applied
			return 0, nil
		})
		staleDone <- err
	}()
	first := <-started
	require.Equal(t, 1, first.Attempt)
	require.Len(t, first.Owner, 36)

	// The holder stalls past its lease: the next call takes the key over.
	_, err = b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second' WHERE namespace = 'pay' AND key = 'k'`)
	require.NoError(t, err)
	res, err := pgidem.DoResult(b.ctx, b.coord, "pay", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		f, _ := pgidem.FenceFromContext(ctx)
		require.Equal(t, 2, f.Attempt)
		require.NotEqual(t, first.Owner, f.Owner)
		applied, err := write(ctx, 100)
		require.True(t, applied)
		return 1, err
	})
	require.NoError(t, err)
	require.True(t, res.TookOver)

	close(resume)
	require.False(t, <-staleApplied, "the stale holder's fenced write was applied")
	require.ErrorIs(t, <-staleDone, pgidem.ErrLeaseLost)
	var balance int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT balance FROM account WHERE id = 1`).Scan(&balance))
	require.Equal(t, 100, balance)
}
