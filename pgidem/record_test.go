package pgidem_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Expiry is judged by the database clock at the statement, not at the transaction's start.
// A transaction opened before a record and an inbox row expired (so now() in it predates
// their expiry) still sees them as expired: LookupTx says so, DoTx runs fn instead of
// replaying, and InboxRecordTx records the message anew.
func TestExpiryJudgedByStatementClock(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx := b.begin(t)
	var txStart time.Time
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT now()`).Scan(&txStart))

	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
		VALUES ('ledger', 'k', 'completed', gen_random_uuid(), '"old"', now() + interval '300 milliseconds', now())`)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ('billing', 'm1', now(), now() + interval '300 milliseconds')`)
	require.NoError(t, err)
	time.Sleep(600 * time.Millisecond)

	rec, err := b.coord.LookupTx(b.ctx, tx, "ledger", "k")
	require.NoError(t, err)
	require.True(t, rec.Expired, "the record expired after the transaction started")
	require.True(t, rec.ExpiresAt.After(txStart), "precondition: expiry after the transaction's now()")

	var runs atomic.Int32
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		runs.Add(1)
		return "new", nil
	})
	require.NoError(t, err)
	require.False(t, res.Replayed, "an expired record replayed")
	require.Equal(t, "new", res.Value)
	require.EqualValues(t, 1, runs.Load())

	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m1", nil)
	require.NoError(t, err)
	require.True(t, isNew, "an inbox row past its retention counted as a duplicate")
	require.NoError(t, tx.Commit(b.ctx))
	require.JSONEq(t, `"new"`, string(b.lookup(t, "ledger", "k").Result))
}

func TestExpiredRecordIsAbsent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, status := range []string{"completed", "failed", "in_progress"} {
		key := "k-" + status
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
			(namespace, key, status, owner, attempts, fingerprint, result, error, lease_expires_at, expires_at)
			VALUES ('mail', $1, $2, gen_random_uuid(), 3, '\xaa', '"old"',
				CASE WHEN $2 = 'failed' THEN '{"message":"old"}'::jsonb END,
				CASE WHEN $2 = 'in_progress' THEN now() + interval '1 hour' END,
				now() - interval '1 second')`, key, status)
		require.NoError(t, err, status)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", key, testTTL,
			&pgidem.DoOpts{Fingerprint: []byte{0xbb}}, func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err, status)
		require.False(t, res.Replayed, status)
		require.False(t, res.TookOver, "an expired record is not a takeover")
		require.Equal(t, 1, res.Attempts, status)
		rec := b.lookup(t, "mail", key)
		require.Equal(t, []byte{0xbb}, rec.Fingerprint, "the new fingerprint binds")
		require.False(t, rec.Expired)
	}
}

// Forget on a pool whose sessions default to REPEATABLE READ, blocked behind a concurrent
// write to the record that then commits, reads the record again and deletes it: the
// server's serialization failure on the first statement is not returned as a store error.
func TestForgetUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	})
	coord := b.newCoordOn(t, pool, nil)
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	tx := b.begin(t)
	_, err = tx.Exec(b.ctx, `UPDATE pgidem_record SET updated_at = now() WHERE namespace = 'mail' AND key = 'k'`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := coord.Forget(b.ctx, "mail", "k", nil)
		done <- err
	}()
	waitLockBlocked(t, b, 1)
	require.NoError(t, tx.Commit(b.ctx))
	require.NoError(t, <-done)
	_, err = coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound)
}

// Forget deletes a record so the next call runs the effect again; it refuses a record in
// progress under a live lease unless forced, and deletes one whose holder died.
func TestForget(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	runs := 0
	fn := func(context.Context) (int, error) { runs++; return runs, nil }
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "done", testTTL, nil, fn)
	require.NoError(t, err)

	rec, err := b.coord.Forget(b.ctx, "mail", "done", nil)
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, "1", string(rec.Result))
	_, err = b.coord.Forget(b.ctx, "mail", "done", nil)
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "done", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, 2, v, "forgotten: the effect ran again")

	// A live holder is refused, then forced.
	h := b.hold(b.coord, "mail", "live", nil, "held")
	_, err = b.coord.Forget(b.ctx, "mail", "live", nil)
	var inProgress *pgidem.InProgressError
	require.ErrorAs(t, err, &inProgress)
	require.Positive(t, inProgress.RetryAfter)
	require.Equal(t, pgidem.StatusInProgress, b.lookup(t, "mail", "live").Status, "refused: still there")
	rec, err = b.coord.Forget(b.ctx, "mail", "live", &pgidem.ForgetOpts{Force: true})
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusInProgress, rec.Status)
	h.unblock()
	require.ErrorIs(t, <-h.done, pgidem.ErrLeaseLost, "the forced-out holder's completion finds no row")

	// A holder that died (its lease ran out) needs no force.
	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
		VALUES ('mail', 'dead', 'in_progress', gen_random_uuid(), now() - interval '1 second', now() + interval '1 hour')`)
	require.NoError(t, err)
	_, err = b.coord.Forget(b.ctx, "mail", "dead", nil)
	require.NoError(t, err)

	_, err = b.coord.Forget(b.ctx, "mail", "", nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)
}
