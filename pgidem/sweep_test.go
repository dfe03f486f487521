package pgidem_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestSweep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, lease_expires_at, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, NULL::timestamptz, now() - interval '1 minute'
		FROM generate_series(1, 25) i
		UNION ALL
		SELECT 'sweep', 'live-' || i, 'completed', gen_random_uuid(), 'null', NULL, now() + interval '1 hour'
		FROM generate_series(1, 5) i
		UNION ALL
		SELECT 'sweep', 'held', 'in_progress', gen_random_uuid(), NULL::jsonb, now() + interval '1 minute', now() - interval '1 minute'`)
	require.NoError(t, err)

	var swept atomic.Int64
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventSwept {
			swept.Add(e.Count)
		}
	})})
	res, err := coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 10, MaxBatches: 2})
	require.NoError(t, err)
	require.EqualValues(t, 20, res.Records, "bounded by MaxBatches")
	res, err = coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 10})
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Records)
	require.EqualValues(t, 25, swept.Load())
	require.Equal(t, 6, b.count(t), "live records and the held reservation stay")
}

// Concurrent sweeps on a pool whose sessions default to REPEATABLE READ split the rows as
// under READ COMMITTED: a row another sweep deleted after a statement's snapshot does not
// fail the statement, and no sweep returns a store error.
func TestSweepConcurrentUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	})
	coord := b.newCoordOn(t, pool, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, now() - interval '1 minute'
		FROM generate_series(1, 10000) i`)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var total atomic.Int64
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			res, err := coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 50})
			errs[i] = err
			total.Add(res.Records)
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, 10000, total.Load())
	require.Zero(t, b.count(t))
}

// A sweep whose context ends mid-statement returns the context's error, and it is not a
// store error: nothing is logged at error or counted (as for a River sweep job cut short
// by its timeout). The cut batch rolls back.
func TestSweepCancelledMidStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, now() - interval '1 minute'
		FROM generate_series(1, 5) i;
	CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM pg_sleep(0.5); RETURN OLD; END$$;
	CREATE TRIGGER slow_delete BEFORE DELETE ON pgidem_record FOR EACH ROW EXECUTE FUNCTION slow_delete()`)
	require.NoError(t, err)
	coord, storeErrors := b.countStoreErrors(t, nil)
	ctx, cancel := context.WithTimeout(b.ctx, 300*time.Millisecond) // the batch takes 2.5 s
	defer cancel()
	res, err := coord.Sweep(ctx, nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.Zero(t, res.Records)
	require.Zero(t, storeErrors.Load())
	require.Equal(t, 5, b.count(t), "the cut batch rolled back")
}

func TestSweepStoreErrorReported(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, "DROP TABLE pgidem_inbox")
	require.NoError(t, err)
	var events []pgidem.Event
	var mu sync.Mutex
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	})})
	_, err = coord.Sweep(b.ctx, nil)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	_, err = coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "a missing record is not a store error")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []pgidem.Event{{Kind: pgidem.EventStoreError, Namespace: "", Count: 1}}, events)
}

// Sweep vs a concurrent takeover of the same expired row, in both lock orders.
func TestSweepVsTakeover(t *testing.T) {
	t.Parallel()

	t.Run("SweepFirst", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		insertRecord(t, b, "k", "completed", "NULL", "now() - interval '1 second'", nil)
		// A sweep that has locked the row and not yet committed its DELETE.
		tx := b.begin(t)
		tag, err := tx.Exec(b.ctx, `DELETE FROM pgidem_record WHERE expires_at <= now()`)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())

		done := make(chan pgidem.Result[string], 1)
		go func() {
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
				return "fresh", nil
			})
			assertNoErr(t, err)
			done <- res
		}()
		waitLockBlocked(t, b, 1) // the takeover waits for the sweep's lock
		require.NoError(t, tx.Commit(b.ctx))
		res := <-done
		require.False(t, res.Replayed)
		require.Equal(t, "fresh", res.Value)
		require.Equal(t, 1, res.Attempts)
		require.JSONEq(t, `"fresh"`, string(b.lookup(t, "mail", "k").Result))
	})

	t.Run("TakeoverFirst", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		insertRecord(t, b, "k", "completed", "NULL", "now() - interval '1 second'", nil)
		// A takeover that has updated the row and not yet committed.
		tx := b.begin(t)
		_, err := tx.Exec(b.ctx, `UPDATE pgidem_record SET status = 'in_progress', result = NULL,
			lease_expires_at = now() + interval '1 minute', expires_at = now() + interval '1 hour'`)
		require.NoError(t, err)

		res, err := b.coord.Sweep(b.ctx, nil) // SKIP LOCKED: neither blocks nor deletes
		require.NoError(t, err)
		require.Zero(t, res.Records)
		require.NoError(t, tx.Commit(b.ctx))
		res, err = b.coord.Sweep(b.ctx, nil) // the committed takeover is no longer expired
		require.NoError(t, err)
		require.Zero(t, res.Records)
		require.Equal(t, 1, b.count(t))
	})
}

// Negative sweep options: a negative BatchSize is refused with an error that is not
// ErrStoreUnavailable, and a negative MaxBatches either errs or sweeps.
func TestSweepRejectsNegativeOpts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	insertRecord(t, b, "old", "completed", "NULL", "now() - interval '1 second'", nil)
	_, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: -1})
	require.Error(t, err)
	require.False(t, errors.Is(err, pgidem.ErrStoreUnavailable), "a bad option is not an unreachable store: %v", err)
	res, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{MaxBatches: -1})
	require.True(t, err != nil || res.Records == 1, "MaxBatches -1 neither errs nor sweeps")
}
