package pgidem_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// xminXmax returns "xmin/xmax" of the row of table (pgidem_record or pgidem_inbox) whose
// key is (k1, k2): any write to the row, or a row lock on it, changes it.
func (b *testBundle) xminXmax(t *testing.T, table, k1, k2 string) string {
	t.Helper()
	cols := map[string][2]string{"pgidem_record": {"namespace", "key"}, "pgidem_inbox": {"consumer", "message_id"}}[table]
	var v string
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, fmt.Sprintf(`SELECT xmin::text || '/' || xmax::text FROM %s WHERE %s = $1 AND %s = $2`,
		table, cols[0], cols[1]), k1, k2).Scan(&v))
	return v
}

// Replays and in-progress checks never write — also on the ReserveFirst path (the
// reserving INSERT … ON CONFLICT DO NOTHING meets the existing row), with batching on and
// off, for DoInTx and for an inbox duplicate. A row lock (ON CONFLICT DO UPDATE … WHERE
// false) would set xmax. TestReadPathsNeverWrite covers Do's plain-read path.
func TestReadPathsNeverWriteOnEveryEntry(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 64} {
		for _, reserveFirst := range []bool{true, false} {
			t.Run(fmt.Sprintf("MaxBatch%d/ReserveFirst%t", maxBatch, reserveFirst), func(t *testing.T) {
				t.Parallel()
				b := setup(t, &pgidem.Config{MaxBatch: maxBatch})
				opts := func(o pgidem.DoOpts) *pgidem.DoOpts { o.ReserveFirst = reserveFirst; return &o }
				fail := func(context.Context) (int, error) { return 0, errors.New("fn must not run") }
				failTx := func(context.Context, pgx.Tx) (int, error) { return 0, errors.New("fn must not run") }

				// A live holder (a fake one: no heartbeat writes the row during the test).
				insertRecord(t, b, "live", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", []byte{1})
				before := b.xminXmax(t, "pgidem_record", "mail", "live")
				_, err := pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{InFlight: pgidem.InFlightRaise}), fail)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				_, err = pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{WaitTimeout: 50 * time.Millisecond}), fail)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				_, err = pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{Fingerprint: []byte{2}}), fail)
				require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
				_, err = pgidem.DoInTx(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{InFlight: pgidem.InFlightRaise}), failTx)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				require.Equal(t, before, b.xminXmax(t, "pgidem_record", "mail", "live"), "in-progress checks never write")

				// A completed record and a stored failure.
				insertRecord(t, b, "done", "completed", "NULL", "now() + interval '1 hour'", nil)
				_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, error, expires_at, completed_at)
					VALUES ('mail', 'failed', 'failed', gen_random_uuid(), '{"message": "declined"}', now() + interval '1 hour', now())`)
				require.NoError(t, err)
				beforeDone := b.xminXmax(t, "pgidem_record", "mail", "done")
				beforeFailed := b.xminXmax(t, "pgidem_record", "mail", "failed")
				for range 3 {
					res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "done", testTTL, opts(pgidem.DoOpts{}),
						func(context.Context) (string, error) { return "", errors.New("fn must not run") })
					require.NoError(t, err)
					require.True(t, res.Replayed)
					require.Equal(t, "old", res.Value)
					_, err = pgidem.Do(b.ctx, b.coord, "mail", "failed", testTTL, opts(pgidem.DoOpts{}), fail)
					require.ErrorIs(t, err, pgidem.ErrPermanent)

					txRes, err := pgidem.DoInTxResult(b.ctx, b.coord, "mail", "done", testTTL, opts(pgidem.DoOpts{}),
						func(context.Context, pgx.Tx) (string, error) { return "", errors.New("fn must not run") })
					require.NoError(t, err)
					require.True(t, txRes.Replayed)
					require.Equal(t, "old", txRes.Value)
					_, err = pgidem.DoInTx(b.ctx, b.coord, "mail", "failed", testTTL, opts(pgidem.DoOpts{}), failTx)
					require.ErrorIs(t, err, pgidem.ErrPermanent)
				}
				require.Equal(t, beforeDone, b.xminXmax(t, "pgidem_record", "mail", "done"), "replays never write")
				require.Equal(t, beforeFailed, b.xminXmax(t, "pgidem_record", "mail", "failed"), "replays of a stored failure never write")

				// An inbox duplicate, through InboxHandle and InboxRecordTx (committed).
				handled, err := b.coord.InboxHandle(b.ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { return nil })
				require.NoError(t, err)
				require.True(t, handled)
				beforeInbox := b.xminXmax(t, "pgidem_inbox", "billing", "m1")
				for range 3 {
					handled, err = b.coord.InboxHandle(b.ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error {
						return errors.New("handler must not run")
					})
					require.NoError(t, err)
					require.False(t, handled)
					tx := b.begin(t)
					isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m1", nil)
					require.NoError(t, err)
					require.False(t, isNew)
					require.NoError(t, tx.Commit(b.ctx))
				}
				require.Equal(t, beforeInbox, b.xminXmax(t, "pgidem_inbox", "billing", "m1"), "inbox duplicates never write")
			})
		}
	}
}

// A caller whose context ends while its reserving statement waits on the server (behind an
// open transaction's record for the key), on a pool whose only connection another
// goroutine is queued for, releases the reservation its statement then makes on that same
// connection: the key is free at once, and the next caller does not count a takeover
// (attempts stays 1). And when that release fails on the kept connection (it broke), the
// connection is given back before the release is tried again on the pool, whose only
// connection it was.
func TestCancelledReservationReleasedOnItsConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		name          string
		maxBatch      int
		queued, broke bool
	}{
		{"Queued", 1, true, false},
		{"QueuedBatching", 0, true, false},
		{"ReleaseConnectionBroke", 1, false, true},
		{"ReleaseConnectionBrokeBatching", 0, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) { // one at a time: the wait below counts the database's waiters
			key := tc.name
			d := &lostReplyDialer{marker: []byte("WITH deleted AS"), unsent: true}
			d.fired.Store(!tc.broke)
			hogQueued := make(chan struct{})
			tracer := &acquireSignal{onAcquire: func(actx context.Context) {
				if actx.Value(hogKey{}) != nil {
					close(hogQueued)
				}
			}}
			pool := b.dialerPool(t, d, func(cfg *pgxpool.Config) { cfg.MaxConns = 1; cfg.ConnConfig.Tracer = tracer })
			coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: tc.maxBatch, FinishTimeout: 10 * time.Second})
			tx, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(b.ctx) }()
			_, err = tx.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
				VALUES ('mail', $1, 'in_progress', gen_random_uuid(), now() + interval '1 minute', now() + interval '1 hour')`, key)
			require.NoError(t, err)

			ctx, cancel := context.WithCancel(b.ctx)
			done := make(chan error, 1)
			go func() {
				_, err := pgidem.Do(ctx, coord, "mail", key, testTTL, &pgidem.DoOpts{ReserveFirst: true},
					func(context.Context) (int, error) { return 1, nil })
				done <- err
			}()
			// The reserving insert waits for the open transaction: under batching, its own
			// statement, once the shared round gave up at its lock timeout.
			require.Eventually(t, func() bool {
				var waiting int
				err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'
						AND query NOT LIKE '%set_config(''lock_timeout''%'`).Scan(&waiting)
				return err == nil && waiting == 1
			}, 30*time.Second, 5*time.Millisecond)
			hogged := make(chan *pgxpool.Conn, 1)
			waitedBefore := pool.Stat().EmptyAcquireCount()
			if tc.queued {
				go func() {
					conn, err := pool.Acquire(context.WithValue(b.ctx, hogKey{}, true)) // queued for the only connection
					if err != nil {
						conn = nil
					}
					hogged <- conn
				}()
				<-hogQueued // its Acquire started, on a pool whose only connection the call holds
			}
			cancel()
			require.NoError(t, tx.Rollback(b.ctx)) // the insert now reserves the key
			require.ErrorIs(t, <-done, context.Canceled)
			if tc.broke {
				require.True(t, d.fired.Load(), "the release's first attempt broke its connection")
			}
			if tc.queued {
				conn := <-hogged
				require.NotNil(t, conn)
				require.Greater(t, pool.Stat().EmptyAcquireCount(), waitedBefore, "the other goroutine waited for the connection")
				conn.Release()
			}
			rec, err := coord.Lookup(b.ctx, "mail", key)
			if err == nil {
				require.NotEqual(t, pgidem.StatusInProgress, rec.Status, "the reservation was left in progress (%+v)", rec)
			} else {
				require.ErrorIs(t, err, pgidem.ErrNotFound)
			}
		})
	}
}

// hogKey marks the context of a test's own Acquire that queues for a pool's connection.
type hogKey struct{}

// The reserve CTE when the conflicting row commits after the statement's snapshot: neither
// branch returns a row and the caller runs it again; when the conflicting insert rolls back,
// the caller's insert proceeds.
func TestReserveSnapshotRetry(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		name := "Rollback"
		if commit {
			name = "Commit"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			tx := b.begin(t)
			_, err := tx.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
				VALUES ('mail', 'k', 'in_progress', gen_random_uuid(), now() + interval '1 hour', now() + interval '2 hours')`)
			require.NoError(t, err)

			var runs atomic.Int32
			type out struct {
				res pgidem.Result[int]
				err error
			}
			done := make(chan out, 1)
			go func() {
				res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, raiseOpts(), func(context.Context) (int, error) {
					return int(runs.Add(1)), nil
				})
				done <- out{res, err}
			}()
			waitLockBlocked(t, b, 1) // the speculative insert waits for the uncommitted row
			if commit {
				require.NoError(t, tx.Commit(b.ctx))
				got := <-done
				require.ErrorIs(t, got.err, pgidem.ErrInProgress)
				require.Zero(t, runs.Load())
			} else {
				require.NoError(t, tx.Rollback(b.ctx))
				got := <-done
				require.NoError(t, got.err)
				require.Equal(t, 1, got.res.Value)
				require.Equal(t, 1, got.res.Attempts)
			}
		})
	}
}

// Replays and in-progress checks are pure reads: the row's xmin/xmax never change (a row lock
// as taken by ON CONFLICT DO UPDATE ... WHERE false would set xmax).
func TestReadPathsNeverWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	version := func() string {
		var v string
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT xmin::text || '/' || xmax::text FROM pgidem_record WHERE key = 'k'`).Scan(&v))
		return v
	}
	// In progress (a fake live holder: no heartbeat writes the row during the test).
	insertRecord(t, b, "k", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", []byte{1})
	before := version()
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, raiseOpts(), func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{WaitTimeout: 30 * time.Millisecond}, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{2}}, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Millisecond)
	defer cancel()
	_, err = pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, before, version(), "in-progress checks never write")

	// Completed.
	_, err = b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET status = 'completed', result = '7', lease_expires_at = NULL, completed_at = now()`)
	require.NoError(t, err)
	before = version()
	for range 5 {
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.True(t, res.Replayed)
		require.Equal(t, 7, res.Value)
	}
	require.Equal(t, before, version(), "replays never write")
}

// DoOpts.ReserveFirst changes the statements, not the protocol: the invariants hold.
func TestReserveFirst(t *testing.T) {
	t.Parallel()
	rf := func(o pgidem.DoOpts) *pgidem.DoOpts { o.ReserveFirst = true; return &o }

	t.Run("Replay", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		runs := 0
		fn := func(context.Context) (string, error) { runs++; return "em_1", nil }
		first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), fn)
		require.NoError(t, err)
		require.False(t, first.Replayed)
		second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), fn)
		require.NoError(t, err)
		require.True(t, second.Replayed)
		require.Equal(t, "em_1", second.Value)
		require.Equal(t, 1, runs)
	})

	t.Run("ConcurrentWait", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		const callers = 32
		var runs atomic.Int32
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range callers {
			wg.Go(func() {
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), func(context.Context) (string, error) {
					n := runs.Add(1)
					time.Sleep(50 * time.Millisecond)
					return fmt.Sprintf("em_%d", n), nil
				})
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, runs.Load())
		for i := range callers {
			require.NoError(t, errs[i])
			require.Equal(t, "em_1", values[i])
		}
	})

	t.Run("FingerprintFromReservingStatement", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		ok := func(context.Context) (int, error) { return 1, nil }
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "k", testTTL, rf(pgidem.DoOpts{Fingerprint: []byte("A")}), ok)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "k", testTTL, rf(pgidem.DoOpts{Fingerprint: []byte("B")}), ok)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	})

	t.Run("ExpiredIsAbsent", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, result, expires_at)
			VALUES ('mail', 'k', 'completed', gen_random_uuid(), 3, '"old"', now() - interval '1 second')`)
		require.NoError(t, err)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}), func(context.Context) (string, error) { return "new", nil })
		require.NoError(t, err)
		require.False(t, res.Replayed)
		require.Equal(t, 1, res.Attempts)
	})

	t.Run("FailOpenNeverBehindUncommittedRecord", func(t *testing.T) {
		t.Parallel()
		// With no read first, the blocked reserving insert is the first statement; it was
		// sent, so the store answered and FailOpen must not run fn.
		b := setup(t, &pgidem.Config{FinishTimeout: 300 * time.Millisecond, FailOpen: true})
		tx := b.begin(t)
		_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		var ran atomic.Bool
		_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, rf(pgidem.DoOpts{}),
			func(context.Context) (string, error) { ran.Store(true); return "from-do", nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.False(t, ran.Load())
		require.NoError(t, tx.Rollback(b.ctx))
	})
}
