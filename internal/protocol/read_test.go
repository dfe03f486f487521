package protocol

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// runReads runs one round of first reads for calls (the first leads), as leadReads with
// the members given, and returns the items.
func runReads(c *Engine, calls ...*Call) []*batchItem[*Call, readRes] {
	items := make([]*batchItem[*Call, readRes], len(calls))
	for i, cl := range calls {
		items[i] = &batchItem[*Call, readRes]{req: cl, err: errBatchFallback}
	}
	c.leadReads(context.Background(), items[0], func(time.Duration) []*batchItem[*Call, readRes] { return items[1:] })
	return items
}

// readCalls returns a call of namespace "ns" for each key.
func readCalls(t *testing.T, c *Engine, keys ...string) []*Call {
	t.Helper()
	calls := make([]*Call, len(keys))
	for i, k := range keys {
		cl, err := c.newCall("ns", k, time.Hour, nil)
		require.NoError(t, err)
		calls[i] = cl
	}
	return calls
}

// A round of reads answers each call with what a read of its own would: a finished record
// to replay, a record that is not finished (read again in full), or none.
func TestReadRoundReadsManyKeys(t *testing.T) {
	c, db := batchFixture(t)
	var mu sync.Mutex
	var rounds []int
	c.config.Round = func(_ context.Context, kind RoundKind, size int, _ time.Duration, err error) {
		require.NoError(t, err)
		if kind == RoundRead {
			mu.Lock()
			rounds = append(rounds, size)
			mu.Unlock()
		}
	}
	ctx := context.Background()
	_, err := doString(ctx, c, "ns", "done", time.Hour, nil, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	_, err = doString(ctx, c, "ns", "failed", time.Hour, nil, func(context.Context) (string, error) { return "", Permanent(fmt.Errorf("declined")) })
	require.Error(t, err)
	_, err = doString(ctx, c, "ns", "old", time.Hour, nil, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "UPDATE pgidem_record SET expires_at = now() - interval '1 second' WHERE key = 'old'")
	require.NoError(t, err)
	held := reserveItems(t, c, "held")
	c.runReserves(ctx, held)
	require.NoError(t, held[0].err)

	mu.Lock()
	rounds = nil
	mu.Unlock()
	items := runReads(c, readCalls(t, c, "done", "none", "failed", "held", "old", "done")...)
	done, none, failed, inProgress, old, again := items[0], items[1], items[2], items[3], items[4], items[5]
	require.NoError(t, done.err)
	require.True(t, done.res.finished)
	require.Equal(t, store.StatusCompleted, done.res.row.Status)
	require.JSONEq(t, `"v"`, string(done.res.row.Result))
	require.Equal(t, 1, done.res.row.Attempts)
	require.True(t, done.res.row.CompletedAt.Valid)
	require.Equal(t, done.res, again.res, "a key twice in one round: both read it")

	require.ErrorIs(t, none.err, pgx.ErrNoRows)

	require.NoError(t, failed.err)
	require.True(t, failed.res.finished)
	require.Equal(t, store.StatusFailed, failed.res.row.Status)
	require.Contains(t, string(failed.res.row.Failure), "declined")

	require.NoError(t, inProgress.err)
	require.False(t, inProgress.res.finished, "in progress: read again in full")
	require.NoError(t, old.err)
	require.False(t, old.res.finished, "expired: read again in full")

	require.Equal(t, []int{6}, rounds, "one round carried every read")
}

// A round the server refuses sends each of its calls to a read of its own, which probe
// then makes: every call still gets its record, or none.
func TestReadRoundRefusedFallsBack(t *testing.T) {
	_, db := batchFixture(t)
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{})
	require.NoError(t, err)
	ctx := context.Background()
	_, err = doString(ctx, c, "ns", "done", time.Hour, &Opts{ReserveFirst: true}, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	sql := *c.sql
	sql.ProbeMany = strings.Replace(sql.ProbeMany, "unnest(", "no_such_function(", 1)
	c.sql = &sql
	var mu sync.Mutex
	var refused []int
	c.config.Round = func(_ context.Context, kind RoundKind, size int, _ time.Duration, err error) {
		mu.Lock()
		defer mu.Unlock()
		if kind == RoundRead && err != nil {
			refused = append(refused, size)
		}
	}

	conn, err := pool.Acquire(ctx) // the leaders wait for this connection
	require.NoError(t, err)
	calls := readCalls(t, c, "done", "none", "done", "none", "done")
	results := make([]store.Row, len(calls))
	errs := make([]error, len(calls))
	var wg sync.WaitGroup
	for i, cl := range calls {
		wg.Go(func() { results[i], errs[i] = c.probe(ctx, cl) })
	}
	require.Eventually(t, func() bool { return c.reads.queued() == len(calls)-2 }, 5*time.Second, time.Millisecond)
	conn.Release()
	wg.Wait()
	for i, cl := range calls {
		if cl.key == "done" {
			require.NoError(t, errs[i])
			require.JSONEq(t, `"v"`, string(results[i].Result))
		} else {
			require.ErrorIs(t, errs[i], pgx.ErrNoRows)
		}
	}
	require.Equal(t, []int{len(calls) - 1}, refused, "one round of the leader and those queued, refused")
}

// Reads that arrive while the rounds in flight wait for a connection share the next round.
// Two rounds run at once: two reads lead, and the one that gets the connection first
// carries those queued behind them.
func TestProbesShareARound(t *testing.T) {
	_, db := batchFixture(t)
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{})
	require.NoError(t, err)
	require.Equal(t, 2, c.reads.rounds)
	var mu sync.Mutex
	var rounds []int
	c.config.Round = func(_ context.Context, kind RoundKind, size int, _ time.Duration, _ error) {
		mu.Lock()
		defer mu.Unlock()
		if kind == RoundRead {
			rounds = append(rounds, size)
		}
	}
	ctx := context.Background()
	const n = 8
	for i := range n {
		_, err := doString(ctx, c, "ns", fmt.Sprint("k", i), time.Hour, &Opts{ReserveFirst: true},
			func(context.Context) (string, error) { return fmt.Sprint("v", i), nil })
		require.NoError(t, err)
	}
	conn, err := pool.Acquire(ctx) // the leaders wait for this connection
	require.NoError(t, err)
	calls := readCalls(t, c, "k0", "k1", "k2", "k3", "k4", "k5", "k6", "k7")
	results := make([]store.Row, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, cl := range calls {
		wg.Go(func() { results[i], errs[i] = c.probe(ctx, cl) })
	}
	require.Eventually(t, func() bool { return c.reads.queued() == n-2 }, 5*time.Second, time.Millisecond)
	conn.Release()
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		require.JSONEq(t, fmt.Sprintf(`"v%d"`, i), string(results[i].Result))
	}
	slices.Sort(rounds)
	require.Equal(t, []int{1, n - 1}, rounds)
}

// A read whose context ends while it is queued leaves the queue with its context's error;
// nothing was sent for it.
func TestProbeLeavesTheQueue(t *testing.T) {
	_, db := batchFixture(t)
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{})
	require.NoError(t, err)
	conn, err := pool.Acquire(context.Background()) // the leaders wait for this connection
	require.NoError(t, err)
	calls := readCalls(t, c, "leader-1", "leader-2", "member")
	var leaders sync.WaitGroup
	for _, cl := range calls[:2] {
		leaders.Go(func() { _, _ = c.probe(context.Background(), cl) })
	}
	require.Eventually(t, func() bool {
		c.reads.mu.Lock()
		defer c.reads.mu.Unlock()
		return c.reads.running == c.reads.rounds
	}, 5*time.Second, time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := c.probe(ctx, calls[2])
		errc <- err
	}()
	require.Eventually(t, func() bool { return c.reads.queued() == 1 }, 5*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	require.Zero(t, c.reads.queued())
	conn.Release()
	leaders.Wait()
}

// The round's statement stays prepared, so Postgres may run it from a generic plan made for
// no particular keys. That plan must look keys up in the primary key from the same table
// size on as the single-key read's does: the round is never the one left scanning a table
// that grew since its plan was made.
func TestReadRoundPlansLikeTheSingleRead(t *testing.T) {
	db := testdb.New(t)
	ctx := context.Background()
	conn, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	sql := store.New("")
	_, err = conn.Exec(ctx, "SET plan_cache_mode = force_generic_plan")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "PREPARE single(text, text) AS "+sql.Probe)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "PREPARE many(text[], text[], bigint, bigint) AS "+sql.ProbeMany)
	require.NoError(t, err)
	usesKey := func(explain string) bool {
		rows, err := conn.Query(ctx, "EXPLAIN (COSTS OFF) "+explain)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		plan := strings.Join(lines, "\n")
		return strings.Contains(plan, "pgidem_record_pkey") && !strings.Contains(plan, "Seq Scan")
	}
	total := 0
	for _, size := range []int{20, 300, 3000, 30000} {
		_, err = conn.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
			SELECT 'ns', 'k' || g, 'completed', gen_random_uuid(), '1', now() + interval '1 hour', now()
			FROM generate_series($1::int, $2::int - 1) g`, total, size)
		require.NoError(t, err)
		total = size
		_, err = conn.Exec(ctx, "ANALYZE pgidem_record") // invalidates the prepared plans
		require.NoError(t, err)
		single := usesKey("EXECUTE single('ns', 'k1')")
		many := usesKey("EXECUTE many('{ns,ns}', '{k1,k2}', 1, 2)")
		require.Equal(t, single, many, "%d records: the single read looks keys up: %v; the round: %v", size, single, many)
		if size >= 3000 {
			require.True(t, many, "%d records: the round looks keys up", size)
		}
	}
}

// MaxBatch 1 turns batching off: each read is a statement of its own, reported as no round.
func TestProbeWithoutBatching(t *testing.T) {
	_, db := batchFixture(t)
	c, err := newTestEngine(db.Pool, Settings{MaxBatch: 1})
	require.NoError(t, err)
	c.config.Round = func(_ context.Context, kind RoundKind, _ int, _ time.Duration, _ error) {
		require.NotEqual(t, RoundRead, kind)
	}
	ctx := context.Background()
	_, err = doString(ctx, c, "ns", "done", time.Hour, &Opts{ReserveFirst: true}, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	r, err := c.probe(ctx, readCalls(t, c, "done")[0])
	require.NoError(t, err)
	require.JSONEq(t, `"v"`, string(r.Result))
	_, err = c.probe(ctx, readCalls(t, c, "none")[0])
	require.ErrorIs(t, err, pgx.ErrNoRows)
}
