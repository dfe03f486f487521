package protocol

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
)

// TestReservationExpiresATTLAfterItsLease: every statement that writes an in-progress
// record (the reserving insert alone and in a round, the takeover) sets its expiry a TTL
// after its lease, as the heartbeat does, so a holder that dies before its first heartbeat
// is taken over (attempts + 1, TookOver) before its record can count as expired.
func TestReservationExpiresATTLAfterItsLease(t *testing.T) {
	c, db := batchFixture(t) // lease 1 s
	ctx := context.Background()
	check := func(name string, r store.Row) {
		t.Helper()
		require.True(t, r.LeaseExpires.Valid, name)
		require.Equal(t, time.Hour, r.ExpiresAt.Sub(r.LeaseExpires.Time), name)
	}

	cl, err := c.newCall("ns", "single", time.Hour, nil)
	require.NoError(t, err)
	r, err := c.reserveOne(ctx, c.pool, c.sql.Reserve, cl, store.NewOwner())
	require.NoError(t, err)
	check("reserve", r)

	items := reserveItems(t, c, "round-a", "round-b")
	c.runReserves(ctx, items)
	for _, it := range items {
		require.NoError(t, it.err)
		check("reserve round", it.res)
	}

	_, err = db.Pool.Exec(ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second' WHERE key = 'single'`)
	require.NoError(t, err)
	r, err = c.reserveOne(ctx, c.pool, c.sql.Takeover, cl, store.NewOwner())
	require.NoError(t, err)
	require.True(t, r.TookOver)
	check("takeover", r)
}
