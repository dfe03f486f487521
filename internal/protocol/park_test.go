package protocol

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
)

// The park statement matches only the dead holder's row it was given, at the cap: in
// progress within its TTL, its lease run out without a release, attempts at the cap or
// more. Every other row is left as it is (the caller reads it again).
func TestParkStatementMatchesOnlyADeadHolderAtTheCap(t *testing.T) {
	t.Parallel()
	c, db := batchFixture(t)
	ctx := context.Background()
	insert := func(key string, attempts int, lease, expires, updated string) store.Row {
		t.Helper()
		var r store.Row
		require.NoError(t, db.Pool.QueryRow(ctx, `INSERT INTO pgidem_record
			(namespace, key, status, owner, attempts, lease_expires_at, expires_at, updated_at)
			VALUES ('ns', $1, 'in_progress', gen_random_uuid(), $2, now() + $3::interval, now() + $4::interval, now() + $5::interval)
			RETURNING owner`, key, attempts, lease, expires, updated).Scan(&r.Owner))
		return r
	}
	park := func(key string, r store.Row, maxAttempts int) bool {
		t.Helper()
		cl, err := c.newCall("ns", key, time.Hour, &Opts{MaxAttempts: maxAttempts})
		require.NoError(t, err)
		parked, err := c.park(ctx, c.pool, cl, &r)
		require.NoError(t, err)
		return parked
	}

	dead := insert("dead", 3, "-1 second", "1 hour", "-1 minute")
	require.False(t, park("dead", dead, 4), "below the cap")
	require.False(t, park("dead", store.Row{Owner: store.NewOwner()}, 3), "another holder's token")
	live := insert("live", 3, "1 minute", "1 hour", "0")
	require.False(t, park("live", live, 3), "a live lease")
	expired := insert("expired", 3, "-1 second", "-1 second", "-1 minute")
	require.False(t, park("expired", expired, 3), "an expired record is absent, not parked")
	released := insert("released", 3, "0", "1 hour", "0")
	require.False(t, park("released", released, 3), "a released record is retried")

	require.True(t, park("dead", dead, 3))
	rec, err := c.Lookup(ctx, c.pool, "ns", "dead")
	require.NoError(t, err)
	require.Equal(t, store.StatusParked, rec.Status)
	require.Equal(t, 3, rec.Attempts)
	require.True(t, rec.LeaseExpiresAt.IsZero())
	var failure store.StoredFailure
	require.NoError(t, json.Unmarshal(rec.Error, &failure))
	require.Contains(t, failure.Message, "parked after 3 attempts (the cap is 3)")
	require.False(t, park("dead", dead, 3), "a parked record is not parked again")

	for _, key := range []string{"live", "expired", "released"} {
		rec, err := c.Lookup(ctx, c.pool, "ns", key)
		require.NoError(t, err)
		require.Equal(t, store.StatusInProgress, rec.Status, key)
	}
}

// The takeover statement refuses a dead holder's row at the call's cap, judged on the row
// it locks: a record that reached the cap after the caller's read is never taken over
// past it. Below the cap, without a cap, and for a released row it takes over.
func TestTakeoverRefusesARecordAtTheCap(t *testing.T) {
	t.Parallel()
	c, db := batchFixture(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at, updated_at)
		VALUES ('ns', 'dead', 'in_progress', gen_random_uuid(), 2, now() - interval '1 second', now() + interval '1 hour', now() - interval '1 minute'),
		       ('ns', 'released', 'in_progress', gen_random_uuid(), 2, now() - interval '1 second', now() + interval '1 hour', now() - interval '1 second')`)
	require.NoError(t, err)
	takeover := func(key string, maxAttempts int) (store.Row, error) {
		cl, err := c.newCall("ns", key, time.Hour, &Opts{MaxAttempts: maxAttempts})
		require.NoError(t, err)
		return c.reserveOne(ctx, c.pool, c.sql.Takeover, cl, store.NewOwner())
	}

	_, err = takeover("dead", 2)
	require.ErrorIs(t, err, pgx.ErrNoRows)
	r, err := takeover("released", 2)
	require.NoError(t, err)
	require.Equal(t, 2, r.Attempts, "a released record counts no attempt")
	require.False(t, r.TookOver)

	r, err = takeover("dead", 3)
	require.NoError(t, err)
	require.True(t, r.TookOver)
	require.Equal(t, 3, r.Attempts)
	_, err = db.Pool.Exec(ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second', updated_at = now() - interval '1 minute' WHERE key = 'dead'`)
	require.NoError(t, err)
	r, err = takeover("dead", 0)
	require.NoError(t, err)
	require.Equal(t, 4, r.Attempts, "no cap: always taken over")
}
