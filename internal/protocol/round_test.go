package protocol

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// queued reports how many callers wait in b's queue.
func (b *batcher[Req, Res]) queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue)
}

// gatedBatcher returns a batcher whose rounds record their requests and, for the first
// round, wait until gate is closed. Each request's result is ten times the request.
func gatedBatcher(max int, gate <-chan struct{}, started chan<- struct{}) (*batcher[int, int], func() [][]int) {
	var mu sync.Mutex
	var rounds [][]int
	b := &batcher[int, int]{max: max}
	b.run = func(_ context.Context, leader *batchItem[int, int], take func(time.Duration) []*batchItem[int, int]) {
		items := append([]*batchItem[int, int]{leader}, take(0)...)
		mu.Lock()
		first := len(rounds) == 0
		var reqs []int
		for _, it := range items {
			reqs = append(reqs, it.req)
		}
		rounds = append(rounds, reqs)
		mu.Unlock()
		if first {
			started <- struct{}{}
			<-gate
		}
		for _, it := range items {
			it.res, it.err = it.req*10, nil
		}
	}
	return b, func() [][]int {
		mu.Lock()
		defer mu.Unlock()
		return rounds
	}
}

func TestBatcherQueuesBehindARunningRound(t *testing.T) {
	gate, started := make(chan struct{}), make(chan struct{}, 1)
	b, rounds := gatedBatcher(4, gate, started)
	ctx := context.Background()

	results := make([]int, 7)
	var wg sync.WaitGroup
	call := func(i int) {
		defer wg.Done()
		res, err := b.do(ctx, i)
		require.NoError(t, err)
		results[i] = res
	}
	wg.Add(1)
	go call(0)
	<-started // call 0 leads a round of its own and is held there
	for i := 1; i < 7; i++ {
		wg.Add(1)
		go call(i)
	}
	require.Eventually(t, func() bool { return b.queued() == 6 }, 10*time.Second, time.Millisecond)
	close(gate)
	wg.Wait()

	got := rounds()
	require.Len(t, got, 3, "six queued calls with max 4: a round of 4, then one of 2")
	require.Equal(t, []int{0}, got[0])
	require.Len(t, got[1], 4)
	require.Len(t, got[2], 2)
	seen := map[int]bool{}
	for _, r := range got {
		for _, req := range r {
			require.False(t, seen[req], "request %d ran in two rounds", req)
			seen[req] = true
		}
	}
	require.Len(t, seen, 7)
	for i, res := range results {
		require.Equal(t, i*10, res)
	}
	require.Zero(t, b.queued())
	require.Zero(t, b.running, "the last round handed nothing on and left the batcher idle")
}

// With rounds 2, a second caller leads a round of its own while the first runs; only a
// third queues, and the first round to end hands it the lead.
func TestBatcherRunsUpToRoundsAtOnce(t *testing.T) {
	release := make(chan struct{})
	var inFlight atomic.Int32
	var mu sync.Mutex
	var leaders []int
	b := &batcher[int, int]{max: 4, rounds: 2}
	b.run = func(_ context.Context, leader *batchItem[int, int], take func(time.Duration) []*batchItem[int, int]) {
		items := append([]*batchItem[int, int]{leader}, take(0)...)
		mu.Lock()
		leaders = append(leaders, leader.req)
		mu.Unlock()
		inFlight.Add(1)
		defer inFlight.Add(-1)
		if leader.req < 2 {
			<-release
		}
		for _, it := range items {
			it.res, it.err = it.req*10, nil
		}
	}
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Go(func() {
			res, err := b.do(context.Background(), i)
			require.NoError(t, err)
			require.Equal(t, i*10, res)
		})
		if i < 2 { // the first two lead rounds of their own, one after the other
			require.Eventually(t, func() bool { return inFlight.Load() == int32(i+1) }, 10*time.Second, time.Millisecond)
		}
	}
	require.Eventually(t, func() bool { return b.queued() == 1 }, 10*time.Second, time.Millisecond)
	require.EqualValues(t, 2, inFlight.Load(), "two rounds at once, and no third")
	close(release)
	wg.Wait()
	require.Equal(t, []int{0, 1, 2}, leaders, "the queued caller was handed the lead")
	require.Zero(t, b.running)
}

// A round takes queued requests only while their bytes fit the budget; the rest wait for
// the next round, in order.
func TestBatcherByteBudget(t *testing.T) {
	gate, started := make(chan struct{}), make(chan struct{}, 1)
	b, rounds := gatedBatcher(10, gate, started)
	b.size, b.maxBytes = func(req int) int { return req }, 10 // a request weighs its value
	ctx := context.Background()

	var wg sync.WaitGroup
	call := func(i int) {
		defer wg.Done()
		res, err := b.do(ctx, i)
		require.NoError(t, err)
		require.Equal(t, i*10, res)
	}
	wg.Add(1)
	go call(1)
	<-started // call 1 leads a round of its own and is held there
	for _, i := range []int{4, 5, 2, 3, 20} {
		wg.Add(1)
		go call(i)
		require.Eventually(t, func() bool { // queued in this order
			b.mu.Lock()
			defer b.mu.Unlock()
			return len(b.queue) > 0 && b.queue[len(b.queue)-1].req == i
		}, 10*time.Second, time.Millisecond)
	}
	close(gate)
	wg.Wait()

	require.Equal(t, [][]int{{1}, {4, 5}, {2, 3}, {20}}, rounds(),
		"4 leads with 5 (9 bytes; 2 more would be 11); 2 leads with 3; 20 goes alone although over the budget")
}

func TestBatcherMaxOneRunsEveryCallAtOnce(t *testing.T) {
	gate, started := make(chan struct{}), make(chan struct{}, 1)
	b, rounds := gatedBatcher(1, gate, started)
	ctx := context.Background()
	done := make(chan int, 1)
	go func() {
		res, _ := b.do(ctx, 1)
		done <- res
	}()
	<-started
	// With batching off, a second call does not queue behind the held first one.
	res, err := b.do(ctx, 2)
	require.NoError(t, err)
	require.Equal(t, 20, res)
	close(gate)
	require.Equal(t, 10, <-done)
	require.Len(t, rounds(), 2)
}

func TestBatcherPanickingRoundReleasesWaiters(t *testing.T) {
	gate, started := make(chan struct{}), make(chan struct{}, 1)
	b := &batcher[int, int]{max: 8}
	b.run = func(_ context.Context, leader *batchItem[int, int], take func(time.Duration) []*batchItem[int, int]) {
		items := append([]*batchItem[int, int]{leader}, take(0)...)
		if items[0].req == 0 {
			started <- struct{}{}
			<-gate
			return
		}
		panic("boom")
	}
	ctx := context.Background()
	go func() { _, _ = b.do(ctx, 0) }()
	<-started

	errs := make(chan error, 3)
	for i := 2; i <= 4; i++ {
		go func() {
			defer func() {
				if recover() != nil {
					errs <- errors.New("led the panicking round")
				}
			}()
			_, err := b.do(ctx, i)
			errs <- err
		}()
	}
	require.Eventually(t, func() bool { return b.queued() == 3 }, 10*time.Second, time.Millisecond)
	close(gate)
	var fallbacks, led int
	for range 3 {
		if err := <-errs; errors.Is(err, errBatchFallback) {
			fallbacks++
		} else {
			led++
		}
	}
	require.Equal(t, 1, led, "the caller that led the round saw the panic")
	require.Equal(t, 2, fallbacks, "its companions were sent to run alone")
	require.Eventually(t, func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.running == 0
	}, 10*time.Second, time.Millisecond, "the batcher is free again")
}

func TestRoundReservesManyKeys(t *testing.T) {
	c, db := batchFixture(t)
	ctx := context.Background()
	_, err := doString(ctx, c, "ns", "done", time.Hour, nil, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	_, err = doString(ctx, c, "ns", "old", time.Hour, nil, func(context.Context) (string, error) { return "v", nil })
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "UPDATE pgidem_record SET expires_at = now() - interval '1 second' WHERE key = 'old'")
	require.NoError(t, err)

	items := reserveItems(t, c, "new-a", "done", "new-b", "new-a", "old")
	items[2].req.cl.fingerprint = []byte("fp-b")
	c.runReserves(ctx, items)

	newA, done, newB, dupA, old := items[0], items[1], items[2], items[3], items[4]
	require.NoError(t, newA.err)
	require.True(t, newA.res.Inserted)
	require.Equal(t, newA.req.Owner, newA.res.Owner, "the row carries the caller's owner token")
	require.Equal(t, store.StatusInProgress, newA.res.Status)
	require.Equal(t, 1, newA.res.Attempts)
	require.False(t, newA.res.DBNow.IsZero())

	require.NoError(t, done.err)
	require.False(t, done.res.Inserted)
	require.Equal(t, store.StatusCompleted, done.res.Status)
	require.JSONEq(t, `"v"`, string(done.res.Result))

	require.NoError(t, newB.err)
	require.True(t, newB.res.Inserted)
	require.Equal(t, []byte("fp-b"), newB.res.Fingerprint)

	require.ErrorIs(t, dupA.err, pgx.ErrNoRows, "a key twice in one round: the second reads again")

	require.NoError(t, old.err)
	require.False(t, old.res.Inserted)
	require.True(t, old.res.Expired, "an expired row is reported for takeover, not overwritten")

	rec, err := c.Lookup(ctx, c.pool, "ns", "new-a")
	require.NoError(t, err)
	require.Equal(t, store.StatusInProgress, rec.Status)
	require.Nil(t, rec.Fingerprint)
	require.WithinDuration(t, rec.CreatedAt.Add(time.Second), rec.LeaseExpiresAt, 100*time.Millisecond, "lease from the call")
	require.WithinDuration(t, rec.CreatedAt.Add(time.Second+time.Hour), rec.ExpiresAt, 100*time.Millisecond, "a TTL after the call's lease")
}

func TestRoundCompletesManyKeys(t *testing.T) {
	c, _ := batchFixture(t)
	ctx := context.Background()
	items := reserveItems(t, c, "a", "b", "c")
	c.runReserves(ctx, items)
	for _, it := range items {
		require.NoError(t, it.err)
		require.True(t, it.res.Inserted)
	}

	failure, err := json.Marshal(store.StoredFailure{Message: "card declined"})
	require.NoError(t, err)
	completes := []*batchItem[completeReq, struct{}]{
		{req: completeReq{cl: items[0].req.cl, Owner: items[0].req.Owner, Status: store.StatusCompleted, Result: []byte(`{"id":"em_1"}`)}},
		{req: completeReq{cl: items[1].req.cl, Owner: items[1].req.Owner, Status: store.StatusFailed, Failure: failure}},
		{req: completeReq{cl: items[2].req.cl, Owner: store.NewOwner(), Status: store.StatusCompleted, Result: []byte(`1`)}},
	}
	c.runCompletes(ctx, completes)
	require.NoError(t, completes[0].err)
	require.NoError(t, completes[1].err)
	require.ErrorIs(t, completes[2].err, errFinishNoRow, "another owner's reservation is not completed")

	a, err := c.Lookup(ctx, c.pool, "ns", "a")
	require.NoError(t, err)
	require.Equal(t, store.StatusCompleted, a.Status)
	require.JSONEq(t, `{"id":"em_1"}`, string(a.Result))
	require.Nil(t, a.Error)
	require.True(t, a.LeaseExpiresAt.IsZero())
	require.WithinDuration(t, a.CompletedAt.Add(time.Hour), a.ExpiresAt, 100*time.Millisecond, "TTL from completion")

	b, err := c.Lookup(ctx, c.pool, "ns", "b")
	require.NoError(t, err)
	require.Equal(t, store.StatusFailed, b.Status)
	require.JSONEq(t, string(failure), string(b.Error))
	require.Nil(t, b.Result)

	cRec, err := c.Lookup(ctx, c.pool, "ns", "c")
	require.NoError(t, err)
	require.Equal(t, store.StatusInProgress, cRec.Status)
}

func TestRoundRefusedByServerRollsBackAndFallsBack(t *testing.T) {
	c, _ := batchFixture(t)
	ctx := context.Background()
	items := reserveItems(t, c, "ok", "bad")
	c.runReserves(ctx, items)
	completes := []*batchItem[completeReq, struct{}]{
		{req: completeReq{cl: items[0].req.cl, Owner: items[0].req.Owner, Status: store.StatusCompleted, Result: []byte(`"fine"`)}},
		// An unpaired surrogate: valid to encoding/json, refused by jsonb.
		{req: completeReq{cl: items[1].req.cl, Owner: items[1].req.Owner, Status: store.StatusCompleted, Result: []byte(`"\ud800"`)}},
	}
	c.runCompletes(ctx, completes)
	require.ErrorIs(t, completes[0].err, errBatchFallback)
	require.ErrorIs(t, completes[1].err, errBatchFallback)
	rec, err := c.Lookup(ctx, c.pool, "ns", "ok")
	require.NoError(t, err)
	require.Equal(t, store.StatusInProgress, rec.Status, "the refused round wrote nothing")
}

// poolOfOne returns a pool of one connection on db, closed at cleanup.
func poolOfOne(t *testing.T, db *testdb.DB) *pgxpool.Pool {
	t.Helper()
	poolConfig, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	poolConfig.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), poolConfig)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// reserveInBackground runs a Do with ReserveFirst for key on c in a goroutine and returns
// where its error arrives.
func reserveInBackground(ctx context.Context, c *Engine, key string) chan error {
	done := make(chan error, 1)
	go func() {
		_, err := doString(ctx, c, "ns", key, time.Hour, &Opts{ReserveFirst: true},
			func(context.Context) (string, error) { return "1", nil })
		done <- err
	}()
	return done
}

// A round takes its members only once it has a connection. A leader whose context ends
// while it waits for one gets its context's error and takes no one: the callers queued
// behind it stay queued, the next of them leads on its own context, and one whose context
// ends meanwhile leaves the queue at once with its context's error, nothing sent (a
// queued caller never waits on the leader's context or FinishTimeout).
func TestRoundLeaderGivesUpWaitingForAConnection(t *testing.T) {
	_, db := batchFixture(t)
	ctx := context.Background()
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{})
	require.NoError(t, err)
	held, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer held.Release()

	leaderCtx, cancelLeader := context.WithCancel(ctx)
	leader := reserveInBackground(leaderCtx, c, "leader")
	require.Eventually(t, func() bool { // leading: the batcher is busy, its round waits for the pool
		c.reserves.mu.Lock()
		defer c.reserves.mu.Unlock()
		return c.reserves.running > 0
	}, 10*time.Second, time.Millisecond)
	leavingCtx, cancelLeaving := context.WithCancel(ctx)
	leaving := reserveInBackground(leavingCtx, c, "leaving")
	next := reserveInBackground(ctx, c, "next")
	require.Eventually(t, func() bool { return c.reserves.queued() == 2 }, 10*time.Second, time.Millisecond)

	cancelLeaving()
	select {
	case err = <-leaving:
	case <-time.After(30 * time.Second): // failure cap, not a timing assertion
		cancelLeader()
		t.Fatal("a queued caller whose context ended still waited for the round's leader")
	}
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, store.ErrUnavailable)
	cancelLeader()
	require.ErrorIs(t, <-leader, context.Canceled)
	held.Release() // the next caller, leading now on its own context, gets the connection
	require.NoError(t, <-next)
	for _, key := range []string{"leader", "leaving"} {
		rec, err := c.Lookup(ctx, c.pool, "ns", key)
		require.ErrorIs(t, err, ErrNotFound, "%s: %+v", key, rec)
	}
}

// A leader whose wait for a connection outlasts FinishTimeout fails, with a store error,
// only the callers queued behind it for FinishTimeout or longer; one that queued late
// stays queued, leads next on its own time, and gets the connection once one is free.
func TestRoundTimeoutFailsOnlyMembersThatWaitedAsLong(t *testing.T) {
	_, db := batchFixture(t)
	ctx := context.Background()
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{FinishTimeout: time.Second})
	require.NoError(t, err)
	held, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer held.Release()

	leader := reserveInBackground(ctx, c, "leader")
	require.Eventually(t, func() bool {
		c.reserves.mu.Lock()
		defer c.reserves.mu.Unlock()
		return c.reserves.running > 0
	}, 10*time.Second, time.Millisecond)
	time.Sleep(700 * time.Millisecond) // the late caller queues in the leader's last 300 ms
	late := reserveInBackground(ctx, c, "late")
	require.ErrorIs(t, <-leader, store.ErrUnavailable, "the leader waited FinishTimeout")
	held.Release()
	require.NoError(t, <-late, "the late caller had not waited as long: it leads next")
}

// A member of a round whose context ended while the round ran gets its context's error,
// and the reservation the round made for it is released on the round's connection before
// the round gives it back; the other members keep theirs. When the first release breaks
// that connection (here on a pool of one), it is given back and the releases go on on the
// pool instead of waiting for the connection the round held.
func TestRoundReleasesMembersWhoseContextEnded(t *testing.T) {
	for _, broke := range []bool{false, true} {
		t.Run(map[bool]string{false: "Released", true: "ConnectionBroke"}[broke], func(t *testing.T) {
			_, db := batchFixture(t)
			ctx := context.Background()
			var armed atomic.Bool
			armed.Store(broke)
			cfg, err := pgxpool.ParseConfig(db.URL)
			require.NoError(t, err)
			cfg.MaxConns = 1
			cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec // the statement's text on the wire
			cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
				conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
				return &breakOnceConn{Conn: conn, armed: &armed, marker: []byte("WITH deleted AS")}, err
			}
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			c, err := newTestEngine(pool, Settings{FinishTimeout: 10 * time.Second})
			require.NoError(t, err)

			items := reserveItems(t, c, "kept", "ended-1", "ended-2")
			ended, cancel := context.WithCancel(ctx)
			cancel()
			items[1].req.ctx, items[2].req.ctx = ended, ended
			c.runReserves(ctx, items)
			require.NoError(t, items[0].err)
			require.True(t, items[0].res.Inserted)
			require.False(t, armed.Load(), "the first release broke its connection")
			rec, err := c.Lookup(ctx, c.pool, "ns", "kept")
			require.NoError(t, err)
			require.Equal(t, store.StatusInProgress, rec.Status)
			for _, it := range items[1:] {
				require.ErrorIs(t, it.err, context.Canceled)
				require.ErrorIs(t, callerEnded(it.err), context.Canceled)
				rec, err = c.Lookup(ctx, c.pool, "ns", it.req.cl.key)
				require.ErrorIs(t, err, ErrNotFound, "released: a first reservation is deleted (%+v)", rec)
			}
		})
	}
}

// breakOnceConn closes its connection instead of sending the first message holding marker
// while armed (once, across the connections sharing armed): nothing of it is applied.
type breakOnceConn struct {
	net.Conn
	armed  *atomic.Bool
	marker []byte
}

func (c *breakOnceConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, c.marker) && c.armed.CompareAndSwap(true, false) {
		_ = c.Conn.Close()
		return 0, net.ErrClosed
	}
	return c.Conn.Write(p)
}

func TestRoundDoesNotWaitBehindAnOpenTransaction(t *testing.T) {
	_, db := batchFixture(t)
	ctx := context.Background()
	// The coordinator gets a pool of one connection, so the last check reads the setting
	// on the very connection the rounds used.
	pool := poolOfOne(t, db)
	c, err := newTestEngine(pool, Settings{MinTTL: 2 * time.Second, Lease: time.Second})
	require.NoError(t, err)

	// Another transaction holds an uncommitted record for "held", as an open DoTx does.
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
		VALUES ('ns', 'held', 'in_progress', gen_random_uuid(), now() + interval '1 minute', now() + interval '1 hour')`)
	require.NoError(t, err)

	for _, keys := range [][]string{{"held"}, {"free", "held"}} {
		items := reserveItems(t, c, keys...)
		c.runReserves(ctx, items) // returns after the lock timeout, not when tx ends
		for _, it := range items {
			require.ErrorIs(t, it.err, errBatchFallback, "keys %v", keys)
		}
	}
	_, err = c.Lookup(ctx, c.pool, "ns", "free")
	require.ErrorIs(t, err, ErrNotFound, "the refused round reserved nothing")

	// A completion blocked behind a row lock falls back the same way.
	items := reserveItems(t, c, "mine")
	c.runReserves(ctx, items)
	require.NoError(t, items[0].err)
	_, err = tx.Exec(ctx, "SELECT 1 FROM pgidem_record WHERE key = 'mine' FOR UPDATE")
	require.NoError(t, err)
	completes := []*batchItem[completeReq, struct{}]{
		{req: completeReq{cl: items[0].req.cl, Owner: items[0].req.Owner, Status: store.StatusCompleted, Result: []byte(`1`)}},
	}
	c.runCompletes(ctx, completes)
	require.ErrorIs(t, completes[0].err, errBatchFallback)

	var lockTimeout string
	require.NoError(t, pool.QueryRow(ctx, "SHOW lock_timeout").Scan(&lockTimeout))
	require.Equal(t, "0", lockTimeout, "the guard's setting ended with its statement")
}

// TestRoundsDoNotScanAGrownTable runs rounds while the table is small — long enough for
// Postgres to settle on a generic plan for a statement pgx keeps prepared — then lets the
// table grow without an analyze (as in the first minutes after a migration) and counts the
// rows the later rounds read by sequential scan. A completion round planned once for the
// small table hashes a scan of the whole table; each key must be looked up instead. The
// reserve round looks existing keys up in the primary key (a replay of a completed key,
// here) and must not scan either. The rounds must also succeed under each pool setting
// (not fall back to single-key statements). TestPlanEachExecution covers the choice of
// mode.
func TestRoundsDoNotScanAGrownTable(t *testing.T) {
	for _, tc := range []struct {
		name   string
		config func(*pgxpool.Config)
	}{
		{"CacheStatement", func(*pgxpool.Config) {}},
		{"NoDescriptionCacheFromBeforeConnect", func(cfg *pgxpool.Config) {
			cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
				cc.DescriptionCacheCapacity = 0
				return nil
			}
		}},
		{"SimpleProtocol", func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			db := testdb.New(t)
			_, err := db.Pool.Exec(ctx, "ALTER TABLE pgidem_record SET (autovacuum_enabled = false)")
			require.NoError(t, err)
			cfg, err := pgxpool.ParseConfig(db.URL)
			require.NoError(t, err)
			cfg.MaxConns = 1 // one connection: one statement cache, one backend
			tc.config(cfg)
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			defer pool.Close()
			c, err := newTestEngine(pool, Settings{})
			require.NoError(t, err)
			roundsOnGrowingTable(t, c, db, pool)
		})
	}
}

func roundsOnGrowingTable(t *testing.T, c *Engine, db *testdb.DB, pool *pgxpool.Pool) {
	ctx := context.Background()
	round := func(keys ...string) {
		items := reserveItems(t, c, keys...)
		c.runReserves(ctx, items)
		var completes []*batchItem[completeReq, struct{}]
		for _, it := range items {
			require.NoError(t, it.err)
			if it.res.Inserted { // a grown key replays its completed record
				completes = append(completes, &batchItem[completeReq, struct{}]{req: completeReq{cl: it.req.cl, Owner: it.req.Owner, Status: store.StatusCompleted, Result: []byte(`1`)}})
			}
		}
		c.runCompletes(ctx, completes)
		for _, it := range completes {
			require.NoError(t, it.err)
		}
	}
	for i := range 8 { // past the five custom plans Postgres makes before a generic one
		round(fmt.Sprintf("small-%d-a", i), fmt.Sprintf("small-%d-b", i))
	}
	const grown = 30000
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
		SELECT 'ns', 'grown-' || g, 'completed', gen_random_uuid(), '1', now() + interval '1 hour', now()
		FROM generate_series(1, $1::int) g`, grown)
	require.NoError(t, err)
	for i := range 3 {
		round(fmt.Sprintf("late-%d-a", i), fmt.Sprintf("late-%d-b", i), fmt.Sprintf("grown-%d", i+1))
	}

	// A backend reports its table statistics when it exits; wait for the updates to show.
	pool.Close()
	var seqRead, updated int64
	require.Eventually(t, func() bool {
		err := db.Pool.QueryRow(ctx, `SELECT coalesce(seq_tup_read, 0), n_tup_upd FROM pg_stat_user_tables
			WHERE relname = 'pgidem_record'`).Scan(&seqRead, &updated)
		return err == nil && updated >= 8*2+3*2
	}, 10*time.Second, 20*time.Millisecond, "the closed backend's statistics")
	require.Less(t, seqRead, int64(grown), "rounds on the grown table read it by sequential scan")
}

// TestPlanEachExecution: only pgx's default mode, which prepares named statements and so
// reaches generic plans, gets a mode planned per execution; a pool set to another mode
// (a proxy may need the simple protocol) keeps its own.
func TestPlanEachExecution(t *testing.T) {
	for mode, want := range map[pgx.QueryExecMode][]any{
		pgx.QueryExecModeCacheStatement: {pgx.QueryExecModeExec},
		pgx.QueryExecModeCacheDescribe:  nil,
		pgx.QueryExecModeDescribeExec:   nil,
		pgx.QueryExecModeExec:           nil,
		pgx.QueryExecModeSimpleProtocol: nil,
	} {
		cc, err := pgx.ParseConfig("postgres://localhost/db")
		require.NoError(t, err)
		cc.DefaultQueryExecMode = mode
		require.Equal(t, want, planEachExecution(cc), "pool mode %s", mode)
	}
}
