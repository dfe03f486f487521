package pgidem_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

func TestStoreUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Nothing listens on port 1.
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	t.Run("ClosedPort", func(t *testing.T) {
		coord, err := pgidem.NewCoordinator(pool, nil)
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		var se *pgidem.StoreError
		require.ErrorAs(t, err, &se)
		require.Equal(t, "reserve", se.Op)
		require.False(t, ran)
	})

	t.Run("FailOpen", func(t *testing.T) {
		var logs bytes.Buffer
		var mu sync.Mutex
		var events []pgidem.EventKind
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{
			FailOpen: true,
			Logger:   slog.New(slog.NewTextHandler(&syncWriter{w: &logs, mu: &mu}, nil)),
			Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
				mu.Lock()
				events = append(events, e.Kind)
				mu.Unlock()
			}),
		})
		require.NoError(t, err)
		res, err := pgidem.DoResult(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 42, nil })
		require.NoError(t, err)
		require.Equal(t, 42, res.Value)
		require.True(t, res.FailedOpen)
		mu.Lock()
		defer mu.Unlock()
		require.Contains(t, logs.String(), "level=WARN")
		require.Contains(t, logs.String(), "unprotected")
		require.Contains(t, events, pgidem.EventFailOpen)
	})

	t.Run("ServerErrorNeverFailsOpen", func(t *testing.T) {
		// The server answers, but pgidem's table is missing: a misconfiguration, not an
		// outage, so FailOpen must not quietly turn deduplication off.
		db := testdb.NewUnmigrated(t)
		coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{FailOpen: true})
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
		require.ErrorContains(t, err, "migrations")
		require.False(t, ran)

		// A schema that does not exist, and a sweep: the same.
		coord, err = pgidem.NewCoordinator(db.Pool, &pgidem.Config{Schema: "nosuch"})
		require.NoError(t, err)
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
		require.False(t, ran)
		_, err = coord.Sweep(ctx, nil)
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
	})

	t.Run("InvalidKeyNeverFailsOpen", func(t *testing.T) {
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: true})
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "bad\x00key", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
		require.False(t, ran)
	})
}

func TestBackendTerminatedBeforeFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// A pool of one connection whose backend an admin (or a failover) has terminated.
	pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	var pid int
	require.NoError(t, pool.QueryRow(b.ctx, "SELECT pg_backend_pid()").Scan(&pid))
	var terminated bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT pg_terminate_backend($1, 5000)", pid).Scan(&terminated))
	require.True(t, terminated)

	// Read first: the read fails on the dead connection. (A reserving insert that starts a
	// call instead counts the failure as a lost reply and runs again on a new connection.)
	coord := b.newCoordOn(t, pool, &pgidem.Config{Order: pgidem.OrderReadFirst})
	ran := false
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.False(t, ran, "fn must not run when the reservation could not be made")

	// The pool replaces the dead connection; the next delivery reserves and runs.
	v, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 2, nil })
	require.NoError(t, err)
	require.Equal(t, 2, v)
}

// With every connection of the pool in use, a call whose context ends before it gets one
// returns the context's error at once, with nothing sent and no store error, whichever
// statement it starts with.
func TestPoolExhaustedBeforeFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		name         string
		maxBatch     int
		reserveFirst bool
	}{
		{"Read", 0, false},
		{"ReserveFirst", 0, true},
		{"ReserveFirstUnbatched", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancelCause(b.ctx)
			defer cancel(nil)
			var armed, waited atomic.Bool
			tracer := &acquireSignal{onAcquire: func(actx context.Context) {
				// The call is waiting for the pool's only connection: its caller leaves.
				if armed.Load() && actx.Value(testCallKey{}) != nil {
					waited.Store(true)
					time.AfterFunc(20*time.Millisecond, func() { cancel(nil) }) // let it block in the pool first
				}
			}}
			pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1; c.ConnConfig.Tracer = tracer })
			coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: tc.maxBatch, FinishTimeout: time.Minute})
			held, err := pool.Acquire(b.ctx)
			require.NoError(t, err)
			defer held.Release() // before the pool's cleanup closes it, should a check fail
			armed.Store(true)

			ran := false
			_, err = pgidem.Do(context.WithValue(ctx, testCallKey{}, true), coord, "mail", tc.name, testTTL, &pgidem.DoOpts{ReserveFirst: tc.reserveFirst},
				func(context.Context) (int, error) { ran = true; return 1, nil })
			require.True(t, waited.Load(), "the call waited for a connection")
			require.ErrorIs(t, err, context.Canceled)
			require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, "the caller's cancellation, not the store's failure")
			require.False(t, ran)
			held.Release()

			rec, err := coord.Lookup(b.ctx, "mail", tc.name)
			require.ErrorIs(t, err, pgidem.ErrNotFound, "nothing was sent: no reservation is left behind (%+v)", rec)
			v, err := pgidem.Do(b.ctx, coord, "mail", tc.name, testTTL, &pgidem.DoOpts{ReserveFirst: tc.reserveFirst},
				func(context.Context) (int, error) { return 2, nil })
			require.NoError(t, err)
			require.Equal(t, 2, v)
		})
	}
}

// With every connection of the pool in use and a caller whose context has no deadline (a
// consumer loop), a call fails after FinishTimeout instead of waiting for ever, whichever
// statement it starts with (the indexed read included), and its error says the pool had no
// connection to spare: the usual cause is handlers holding connections while they call Do
// (InboxHandle), not the server.
func TestPoolExhaustedFailsAfterFinishTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, reserveFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("ReserveFirst=%v", reserveFirst), func(t *testing.T) {
			t.Parallel()
			pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 2 })
			coord := b.newCoordOn(t, pool, &pgidem.Config{FinishTimeout: 300 * time.Millisecond})
			for range 2 {
				held, err := pool.Acquire(b.ctx)
				require.NoError(t, err)
				defer held.Release()
			}
			done := make(chan error, 1)
			ran := false
			go func() {
				_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: reserveFirst},
					func(context.Context) (int, error) { ran = true; return 1, nil })
				done <- err
			}()
			select {
			case err := <-done:
				require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
				require.ErrorIs(t, err, context.DeadlineExceeded)
				require.Contains(t, err.Error(), "none of the pool's 2 became free in time")
				require.False(t, ran)
			case <-time.After(20 * time.Second):
				t.Fatal("the call still waits for a connection")
			}
		})
	}
}

// A statement that got its connection and then waited on the server (a table lock held by
// a migration, say) times out after FinishTimeout without the pool hint: resizing the
// pool would not help.
func TestServerWaitIsNotBlamedOnThePool(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	locker := b.begin(t)
	_, err := locker.Exec(b.ctx, `LOCK TABLE pgidem_record IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	// Without ReserveFirst the call reads first.
	coord := b.newCoordOn(t, pool, &pgidem.Config{FinishTimeout: 300 * time.Millisecond, Order: pgidem.OrderReadFirst})
	for _, reserveFirst := range []bool{false, true} {
		_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: reserveFirst},
			func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.NotContains(t, err.Error(), "became free", "ReserveFirst=%v", reserveFirst)
	}
	require.NoError(t, locker.Rollback(b.ctx))

	// A server that accepts connections and never answers: the pool has connections to
	// spare, and the wait is for one being dialled.
	blackhole, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer blackhole.Close()
	go func() {
		for {
			conn, err := blackhole.Accept()
			if err != nil {
				return
			}
			defer conn.Close() // held open, never answered, until the listener closes
		}
	}()
	silent := b.newPool(t, func(c *pgxpool.Config) {
		c.MaxConns = 4
		c.ConnConfig.ConnectTimeout = 2 * time.Second
		c.ConnConfig.DialFunc = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", blackhole.Addr().String())
		}
	})
	coord = b.newCoordOn(t, silent, &pgidem.Config{FinishTimeout: 300 * time.Millisecond})
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.NotContains(t, err.Error(), "became free", "a connection being dialled is the server's wait")
}

func TestBackendTerminatedDuringFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
		// Kill every connection the pool holds, as a failover or an admin would.
		_, err := b.db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`)
		if err != nil {
			return "", err
		}
		return "sent", nil
	})
	require.NoError(t, err, "the finishing write retries on a fresh connection")
	require.Equal(t, "sent", v)
	require.JSONEq(t, `"sent"`, string(b.lookup(t, "mail", "k").Result))
}

// A statement cut off by the caller's own deadline (River's JobTimeout, an HTTP request's)
// is not a store outage: the call returns an error matching context.DeadlineExceeded and
// not ErrStoreUnavailable, and nothing is logged at error or counted as EventStoreError.
// This holds for DoTx waiting for another transaction's lock and for Lookup blocked
// behind a table lock too.
func TestCallerDeadlineIsNotStoreError(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	check := func(name string, err error) {
		t.Helper()
		require.ErrorIs(t, err, context.DeadlineExceeded, name)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, name)
		require.Zero(t, storeErrors.Load(), name)
	}

	// Another transaction holds the key's DoTx lock.
	other, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer other.Rollback(b.ctx) //nolint:errcheck
	_, err = pgidem.DoTx(b.ctx, coord, other, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err = pgidem.DoInTx(ctx, coord, "ledger", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: time.Minute},
		func(context.Context, pgx.Tx) (int, error) { return 2, nil })
	check("DoTx lock wait", err)

	// A table lock blocks every read of pgidem_record.
	_, err = other.Exec(b.ctx, "LOCK TABLE pgidem_record IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	ctx, cancel = context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err = coord.Lookup(ctx, "mail", "k")
	check("Lookup", err)
}

// A finishing write that runs out of Config.FinishTimeout (the row locked by another
// session) is a store error, logged and counted, although the deadline that passed is a
// context's: the write's own, not the caller's.
func TestFinishTimeoutIsStoreError(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 0} {
		t.Run(fmt.Sprintf("MaxBatch=%d", maxBatch), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			coord, storeErrors := b.countStoreErrors(t, &pgidem.Config{FinishTimeout: 200 * time.Millisecond, MaxBatch: maxBatch})
			locker, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer locker.Rollback(b.ctx) //nolint:errcheck
			_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
				_, err := locker.Exec(ctx, "SELECT 1 FROM pgidem_record WHERE namespace = 'mail' AND key = 'k' FOR UPDATE")
				return 1, err
			})
			require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Positive(t, storeErrors.Load())
		})
	}
}

// A reserving write blocked behind an open DoTx ends at Config.FinishTimeout, a bound of
// its own: a store error for op "reserve", logged and counted, even when the caller's
// deadline passed meanwhile.
func TestDetachedReserveTimeoutUnderCallerDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, &pgidem.Config{FinishTimeout: 1500 * time.Millisecond})
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, coord, tx, "mail", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)
	// The caller's deadline passes while the reserving write waits on the row lock, which
	// it does until FinishTimeout.
	ctx, cancel := context.WithTimeout(b.ctx, 300*time.Millisecond)
	defer cancel()
	_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: true}, func(context.Context) (int, error) { return 2, nil })
	var storeErr *pgidem.StoreError
	require.ErrorAs(t, err, &storeErr)
	require.Equal(t, "reserve", storeErr.Op)
	require.Positive(t, storeErrors.Load())
}

// testCallKey marks the context of the call a test watches in the pool's tracer.
type testCallKey struct{}

// A driver deadline that is not the caller's (pgx's connect_timeout against a server that
// accepts and never answers) is a store error: the call matches ErrStoreUnavailable, and
// FailOpen engages, although the error wraps context.DeadlineExceeded.
func TestConnectTimeoutIsStoreError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	var mu sync.Mutex
	acceptDone := make(chan struct{})
	go func() { // a server that accepts and never answers
		defer close(acceptDone)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-acceptDone
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	pool, err := pgxpool.New(context.Background(),
		"postgres://postgres@"+ln.Addr().String()+"/postgres?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: true})
	require.NoError(t, err)

	res, err := pgidem.DoResult(context.Background(), coord, "mail", "k", testTTL, nil, returnOne)
	t.Logf("err=%v failedOpen=%v", err, res.FailedOpen)
	require.True(t, res.FailedOpen, "FailOpen must engage when the store does not answer")
	require.NoError(t, err)

	coord2, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)
	_, err = pgidem.Do(context.Background(), coord2, "mail", "k", testTTL, nil, returnOne)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
}
