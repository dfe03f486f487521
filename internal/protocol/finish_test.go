package protocol

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// A completion repeated after its reply was lost (a retry, or a fallback after a round timed
// out) finds its own completed row and succeeds, instead of reporting a lost lease.
func TestCompletionIsSafeToRepeat(t *testing.T) {
	c, _ := batchFixture(t)
	ctx := context.Background()
	items := reserveItems(t, c, "a", "b")
	c.runReserves(ctx, items)
	completes := func() []*batchItem[completeReq, struct{}] {
		var out []*batchItem[completeReq, struct{}]
		for _, it := range items {
			out = append(out, &batchItem[completeReq, struct{}]{req: completeReq{cl: it.req.cl, Owner: it.req.Owner,
				Status: store.StatusCompleted, Result: []byte(`"v"`)}})
		}
		return out
	}
	for round := range 2 { // a round of many, then the same writes again
		cs := completes()
		c.runCompletes(ctx, cs)
		for _, it := range cs {
			require.NoError(t, it.err, "round %d", round)
		}
	}
	cs := completes()[:1]
	c.runCompletes(ctx, cs) // a round of one
	require.NoError(t, cs[0].err)
	require.NoError(t, c.finish(ctx, items[0].req.cl, items[0].req.Owner, "complete", c.sql.Complete,
		store.StatusCompleted, store.JSONText([]byte(`"v"`)), nil, store.Micros(time.Hour)), "the single-key write too")
	require.ErrorIs(t, c.finish(ctx, items[0].req.cl, store.NewOwner(), "complete", c.sql.Complete,
		store.StatusCompleted, store.JSONText([]byte(`"v"`)), nil, store.Micros(time.Hour)), errFinishNoRow, "another owner still matches nothing")
}

// Releasing is safe to repeat (finish retries a write whose reply was lost): a kept
// (taken-over) reservation matches again and keeps its attempts, neither decremented again
// nor deleted.
func TestReleaseRepeatable(t *testing.T) {
	c, db := batchFixture(t)
	ctx := context.Background()
	cl, owner := heldTakenOver(t, c, db, "interval '1 minute'")
	for range 3 {
		require.NoError(t, c.finish(ctx, cl, owner, "release", c.sql.Release))
		var attempts int
		var ended, marked bool
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT attempts, lease_expires_at <= now(), lease_expires_at = updated_at
			FROM pgidem_record WHERE namespace = 'ns' AND key = 'k'`).Scan(&attempts, &ended, &marked))
		require.Equal(t, 2, attempts)
		require.True(t, ended)
		require.True(t, marked, "still marked released, so taking it over counts no attempt")
	}
	require.ErrorIs(t, c.finish(ctx, cl, store.NewOwner(), "release", c.sql.Release), errFinishNoRow,
		"another owner matches nothing")
}

// A release whose lease had already run out (the heartbeat lost the store for a whole
// lease, nobody took over) is marked released like any other: its holder gave up, it did
// not die, so taking the key over counts no attempt.
func TestReleaseAfterLeaseRanOutIsMarked(t *testing.T) {
	c, db := batchFixture(t)
	ctx := context.Background()
	cl, owner := heldTakenOver(t, c, db, "interval '-1 second'")
	require.NoError(t, c.finish(ctx, cl, owner, "release", c.sql.Release))
	var marked bool
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT lease_expires_at = updated_at FROM pgidem_record
		WHERE namespace = 'ns' AND key = 'k'`).Scan(&marked))
	require.True(t, marked)
}

// A release that the server refused (here: lock timeouts behind a transaction that takes
// the key over) applied nothing, so when a later attempt finds no row of its owner the
// reservation was taken over: errFinishNoRow, not a silent success.
func TestReleaseRetryAfterServerErrorReportsTakeover(t *testing.T) {
	db := testdb.New(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "50ms"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	c, err := newTestEngine(pool, Settings{MinTTL: 2 * time.Second, Lease: time.Second})
	require.NoError(t, err)
	cl, owner := heldTakenOver(t, c, db, "interval '1 minute'")
	taker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer taker.Rollback(ctx) //nolint:errcheck
	_, err = taker.Exec(ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = attempts + 1
		WHERE namespace = 'ns' AND key = 'k'`)
	require.NoError(t, err)
	committed := make(chan error, 1)
	go func() {
		time.Sleep(150 * time.Millisecond) // the release's first attempts time out meanwhile
		committed <- taker.Commit(ctx)
	}()
	require.ErrorIs(t, c.finish(ctx, cl, owner, "release", c.sql.Release), errFinishNoRow)
	require.NoError(t, <-committed)
}

// heldTakenOver stores an in-progress reservation of ns/k with attempts 2 (it took over a
// dead holder) whose lease ends leaseFromNow (an SQL interval) from now, and returns the
// call and the owner token that hold it.
func heldTakenOver(t *testing.T, c *Engine, db *testdb.DB, leaseFromNow string) (*Call, pgtype.UUID) {
	t.Helper()
	cl, err := c.newCall("ns", "k", time.Hour, nil)
	require.NoError(t, err)
	owner := store.NewOwner()
	_, err = db.Pool.Exec(context.Background(), `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, lease_expires_at, expires_at)
		VALUES ('ns', 'k', 'in_progress', $1, 2, now() + `+leaseFromNow+`, now() + interval '1 hour')`, owner)
	require.NoError(t, err)
	return cl, owner
}
