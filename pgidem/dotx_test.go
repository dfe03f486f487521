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
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// createLedger creates the table the transactional tests write their effect to.
func (b *testBundle) createLedger(t *testing.T) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, ref text NOT NULL)`)
	require.NoError(t, err)
}

// ledgerRows counts the ledger rows for ref as seen outside any transaction.
func (b *testBundle) ledgerRows(t *testing.T, ref string) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM ledger WHERE ref = $1`, ref).Scan(&n))
	return n
}

func (b *testBundle) begin(t *testing.T) pgx.Tx {
	t.Helper()
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// requireUsable asserts that tx has not been aborted.
func requireUsable(t *testing.T, ctx context.Context, tx pgx.Tx) {
	t.Helper()
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one), "the caller's transaction must stay usable")
}

// waitForBlocked waits until n backends of the test database wait for a lock of the given
// type ("advisory", "transactionid"): a condition, not a timing assumption.
func (b *testBundle) waitForBlocked(t *testing.T, lockType string, n int) {
	t.Helper()
	b.waitForLocks(t, lockType, false, n)
}

// waitForLocks waits until n locks of the given type are granted (or, with granted false,
// waited for) by backends of the test database.
func (b *testBundle) waitForLocks(t *testing.T, lockType string, granted bool, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var count int
		err := b.db.Pool.QueryRow(b.ctx, `
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted = $2 AND l.locktype = $1 AND a.datname = current_database()`, lockType, granted).Scan(&count)
		return err == nil && count >= n
	}, 30*time.Second, 5*time.Millisecond)
}

// ledgerInsert is a DoTx fn that writes one ledger row and returns its id.
func ledgerInsert(ref string, runs *atomic.Int32) func(ctx context.Context, tx pgx.Tx) (int64, error) {
	return func(ctx context.Context, tx pgx.Tx) (int64, error) {
		runs.Add(1)
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO ledger (ref) VALUES ($1) RETURNING id`, ref).Scan(&id)
		return id, err
	}
}

func TestDoTxBasic(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := ledgerInsert("order-9", &runs)

	tx := b.begin(t)
	first, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "order-9.entry", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			ns, key, ok := pgidem.KeyFromContext(ctx)
			require.True(t, ok)
			require.Equal(t, "ledger/order-9.entry", ns+"/"+key)
			return fn(ctx, tx)
		})
	require.NoError(t, err)
	require.False(t, first.Replayed)
	require.Equal(t, 1, first.Attempts)
	require.Zero(t, b.count(t), "nothing is visible before the caller commits")
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, 1, b.ledgerRows(t, "order-9"))

	rec := b.lookup(t, "ledger", "order-9.entry")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, fmt.Sprint(first.Value), string(rec.Result))

	tx2 := b.begin(t)
	second, err := pgidem.DoTxResult(b.ctx, b.coord, tx2, "ledger", "order-9.entry", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, second.Replayed)
	require.Equal(t, first.Value, second.Value)
	require.NoError(t, tx2.Commit(b.ctx))

	value, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "order-9.entry", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, first.Value, value)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, b.ledgerRows(t, "order-9"))
}

func TestDoTxRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := ledgerInsert("order-1", &runs)

	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "order-1.entry", testTTL, nil, fn)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(b.ctx))
	require.Zero(t, b.count(t), "a rollback leaves no record")
	require.Zero(t, b.ledgerRows(t, "order-1"), "and no effect")

	res, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "order-1.entry", testTTL, nil, fn)
	require.NoError(t, err)
	require.NotZero(t, res)
	require.EqualValues(t, 2, runs.Load(), "the next delivery runs fn again")
	require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	require.Equal(t, 1, b.count(t))
}

func TestDoTxConcurrent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := ledgerInsert("order-16", &runs)

	const n = 16
	results := make([]pgidem.Result[int64], n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			tx, err := b.db.Pool.Begin(b.ctx)
			if err != nil {
				errs[i] = err
				return
			}
			defer tx.Rollback(b.ctx) //nolint:errcheck // after Commit it is a no-op
			results[i], errs[i] = pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "order-16.entry", testTTL, nil, fn)
			if errs[i] == nil {
				errs[i] = tx.Commit(b.ctx)
			}
		})
	}
	wg.Wait()

	replays := 0
	for i := range n {
		require.NoError(t, errs[i], "caller %d", i)
		require.Equal(t, results[0].Value, results[i].Value, "caller %d", i)
		if results[i].Replayed {
			replays++
		}
	}
	require.EqualValues(t, 1, runs.Load(), "fn runs exactly once")
	require.Equal(t, n-1, replays, "every other caller replays")
	require.Equal(t, 1, b.ledgerRows(t, "order-16"))
	require.Equal(t, 1, b.lookup(t, "ledger", "order-16.entry").Attempts)
}

// holdKey runs DoTx on key in a transaction it leaves open, so the key's advisory lock
// stays held until the returned transaction ends.
func (b *testBundle) holdKey(t *testing.T, namespace, key string) pgx.Tx {
	t.Helper()
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, namespace, key, testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "holder", nil })
	require.NoError(t, err)
	return tx
}

func TestDoTxLockConflict(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name string
		opts *pgidem.DoOpts
	}{
		{"Raise", &pgidem.DoOpts{InFlight: pgidem.InFlightRaise}},
		{"WaitTimeout", &pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 50 * time.Millisecond}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			holder := b.holdKey(t, "ledger", "k")

			tx := b.begin(t)
			_, err := tx.Exec(b.ctx, `SET LOCAL lock_timeout = '7s'`)
			require.NoError(t, err)
			var ran atomic.Bool
			_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, tt.opts,
				func(ctx context.Context, tx pgx.Tx) (string, error) { ran.Store(true); return "", nil })
			require.ErrorIs(t, err, pgidem.ErrInProgress)
			var inProgress *pgidem.InProgressError
			require.ErrorAs(t, err, &inProgress)
			require.Equal(t, tt.opts.InFlight == pgidem.InFlightWait, inProgress.Waited)
			require.Positive(t, inProgress.RetryAfter)
			require.False(t, ran.Load())

			requireUsable(t, b.ctx, tx)
			var lockTimeout string
			require.NoError(t, tx.QueryRow(b.ctx, `SHOW lock_timeout`).Scan(&lockTimeout))
			require.Equal(t, "7s", lockTimeout, "the caller's lock_timeout is restored")
			require.NoError(t, tx.Commit(b.ctx))

			require.NoError(t, holder.Commit(b.ctx))
			res, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, tt.opts,
				func(ctx context.Context, tx pgx.Tx) (string, error) { return "second", nil })
			require.NoError(t, err)
			require.Equal(t, "holder", res, "after the holder commits, its value replays")
		})
	}
}

// A finished record is final until it expires, so DoTx replays it without the key's lock:
// another transaction that holds the lock (here one that replayed the record itself and
// stays open) neither makes a Raise call report the key in progress nor makes a Wait call
// wait for its end. A stored permanent failure replays the same way.
func TestDoTxReplaysWithoutTheLock(t *testing.T) {
	t.Parallel()
	for _, stored := range []string{"Completed", "Failed"} {
		for _, policy := range []pgidem.InFlightPolicy{pgidem.InFlightRaise, pgidem.InFlightWait} {
			t.Run(fmt.Sprintf("%s/%v", stored, policy), func(t *testing.T) {
				t.Parallel()
				b := setup(t, nil)
				_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (string, error) {
					if stored == "Failed" {
						return "", pgidem.Permanent(errors.New("refused"))
					}
					return "first", nil
				})
				require.Equal(t, stored == "Failed", err != nil, "%v", err)

				// An open transaction holds the key's lock after replaying.
				holder := b.begin(t)
				_, err = pgidem.DoTx(b.ctx, b.coord, holder, "ledger", "k", testTTL, nil,
					func(ctx context.Context, tx pgx.Tx) (string, error) { return "holder", nil })
				require.Equal(t, stored == "Failed", err != nil, "%v", err)

				tx := b.begin(t)
				res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL,
					&pgidem.DoOpts{InFlight: policy, WaitTimeout: 100 * time.Millisecond},
					func(ctx context.Context, tx pgx.Tx) (string, error) { return "second", nil })
				require.NotErrorIs(t, err, pgidem.ErrInProgress)
				require.True(t, res.Replayed)
				require.False(t, res.Waited)
				if stored == "Failed" {
					require.ErrorIs(t, err, pgidem.ErrPermanent)
				} else {
					require.NoError(t, err)
					require.Equal(t, "first", res.Value)
				}
				requireUsable(t, b.ctx, tx)
			})
		}
	}
}

// A Wait call queued for the key's lock notices the record finishing although the lock's
// holder stays open: a Do holder runs the effect, one transaction takes the lock and polls
// Do's row, another queues for the lock; Do completes, the first transaction replays and
// stays open. The queued call replays too, well inside its wait budget.
func TestDoTxLockWaiterReplaysWhileTheHolderStaysOpen(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{PollIntervalMax: 50 * time.Millisecond})
	doHolder := b.hold(b.coord, "ledger", "k", nil, "from-do")

	first := make(chan error, 1)
	replayed := make(chan struct{})
	holder := b.begin(t)
	go func() {
		res, err := pgidem.DoTxResult(b.ctx, b.coord, holder, "ledger", "k", testTTL, nil,
			func(context.Context, pgx.Tx) (string, error) { return "from-first-tx", nil })
		if err == nil && !res.Replayed {
			err = errors.New("the first transaction ran fn")
		}
		close(replayed)
		first <- err
	}()
	b.waitForLocks(t, "advisory", true, 1) // the first transaction holds the lock, polling Do's row

	type outcome struct {
		res pgidem.Result[string]
		err error
	}
	second := make(chan outcome, 1)
	go func() {
		tx, err := b.db.Pool.Begin(b.ctx)
		if err != nil {
			second <- outcome{err: err}
			return
		}
		defer tx.Rollback(b.ctx) //nolint:errcheck // read only
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL,
			&pgidem.DoOpts{WaitTimeout: time.Minute},
			func(context.Context, pgx.Tx) (string, error) { return "from-second-tx", nil })
		second <- outcome{res, err}
	}()
	b.waitForBlocked(t, "advisory", 1)

	doHolder.unblock()
	require.NoError(t, <-doHolder.done)
	<-replayed // the first transaction replays, and stays open: its lock is held
	select {
	case out := <-second:
		require.NoError(t, out.err)
		require.True(t, out.res.Replayed)
		require.Equal(t, "from-do", out.res.Value)
	case <-time.After(20 * time.Second):
		t.Fatal("the queued call still waits for the lock of a transaction that only replayed")
	}
	require.NoError(t, <-first)
}

func TestDoTxWaitsForLock(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	holder := b.holdKey(t, "ledger", "k")

	type outcome struct {
		res pgidem.Result[string]
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		tx, err := b.db.Pool.Begin(b.ctx)
		if err != nil {
			done <- outcome{err: err}
			return
		}
		defer tx.Rollback(b.ctx) //nolint:errcheck // after Commit it is a no-op
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "waiter", nil })
		if err == nil {
			err = tx.Commit(b.ctx)
		}
		done <- outcome{res, err}
	}()
	b.waitForBlocked(t, "advisory", 1)
	require.NoError(t, holder.Commit(b.ctx))

	out := <-done
	require.NoError(t, out.err)
	require.True(t, out.res.Replayed)
	require.True(t, out.res.Waited)
	require.Equal(t, "holder", out.res.Value)
}

func TestDoTxLockKeyIsLengthPrefixed(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	holder := b.holdKey(t, "a", "bc")
	defer holder.Rollback(b.ctx) //nolint:errcheck

	_, err := pgidem.DoInTx(b.ctx, b.coord, "ab", "c", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "other", nil })
	require.NoError(t, err, `("ab", "c") must not share ("a", "bc")'s lock`)
}

func TestDoTxInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	tests := []struct {
		name      string
		namespace string
		key       string
		ttl       time.Duration
		want      error
	}{
		{"EmptyKey", "ledger", "", testTTL, pgidem.ErrInvalidKey},
		{"NulInKey", "ledger", "a\x00b", testTTL, pgidem.ErrInvalidKey},
		{"EmptyNamespace", "", "k", testTTL, pgidem.ErrInvalidKey},
		{"InvalidUTF8", "ledger", "\xff", testTTL, pgidem.ErrInvalidKey},
		{"ShortTTL", "ledger", "k", time.Second, pgidem.ErrInvalidTTL},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tx := b.begin(t)
			var ran atomic.Bool
			fn := func(ctx context.Context, tx pgx.Tx) (int, error) { ran.Store(true); return 1, nil }
			_, err := pgidem.DoTx(b.ctx, b.coord, tx, tt.namespace, tt.key, tt.ttl, nil, fn)
			require.ErrorIs(t, err, tt.want)
			_, err = pgidem.DoInTx(b.ctx, b.coord, tt.namespace, tt.key, tt.ttl, nil, fn)
			require.ErrorIs(t, err, tt.want)
			require.False(t, ran.Load(), "fn must not run for an invalid key")
			requireUsable(t, b.ctx, tx)
		})
	}
}

func TestDoTxFnError(t *testing.T) {
	t.Parallel()

	errDeclined := errors.New("card declined")
	tests := []struct {
		name       string
		fnErr      error
		wantStored bool
	}{
		{"Transient", errors.New("boom"), false},
		{"Permanent", pgidem.Permanent(errDeclined), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.createLedger(t)
			tx := b.begin(t)
			_, err := tx.Exec(b.ctx, `INSERT INTO ledger (ref) VALUES ('before')`)
			require.NoError(t, err)

			_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil,
				func(ctx context.Context, tx pgx.Tx) (int, error) {
					_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('inside')`)
					require.NoError(t, err)
					return 0, tt.fnErr
				})
			require.ErrorIs(t, err, tt.fnErr)
			requireUsable(t, b.ctx, tx)
			require.NoError(t, tx.Commit(b.ctx))
			require.Equal(t, 1, b.ledgerRows(t, "before"), "the caller's own writes survive")
			require.Zero(t, b.ledgerRows(t, "inside"), "fn's writes are rolled back")

			var runs atomic.Int32
			_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil,
				func(ctx context.Context, tx pgx.Tx) (int, error) { runs.Add(1); return 2, nil })
			if tt.wantStored {
				require.ErrorIs(t, err, pgidem.ErrPermanent)
				var stored *pgidem.StoredFailureError
				require.ErrorAs(t, err, &stored)
				require.Equal(t, "card declined", stored.Message)
				require.Zero(t, runs.Load())
				require.Equal(t, pgidem.StatusFailed, b.lookup(t, "ledger", "k").Status)
			} else {
				require.NoError(t, err)
				require.EqualValues(t, 1, runs.Load(), "a transient error records nothing")
			}
		})
	}
}

func TestDoTxPanicRollsBackToSavepoint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	tx := b.begin(t)
	require.PanicsWithValue(t, "handler bug", func() {
		_, _ = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (int, error) {
				_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('inside')`)
				require.NoError(t, err)
				panic("handler bug")
			})
	})
	requireUsable(t, b.ctx, tx)
	require.NoError(t, tx.Commit(b.ctx))
	require.Zero(t, b.ledgerRows(t, "inside"))
	require.Zero(t, b.count(t))
}

func TestDoTxResultNotStorable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)

	tests := []struct {
		name  string
		value any
	}{
		{"Channel", make(chan int)},
		{"NulCharacter", "a\x00b"},
		{"InvalidUTF8", "a\xffb"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", tt.name, testTTL, nil,
				func(ctx context.Context, tx pgx.Tx) (any, error) {
					_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ($1)`, tt.name)
					return tt.value, err
				})
			require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
			require.Zero(t, b.ledgerRows(t, tt.name), "the effect is rolled back with the savepoint")
			_, err = b.coord.Lookup(b.ctx, "ledger", tt.name)
			require.ErrorIs(t, err, pgidem.ErrNotFound, "nothing is recorded")
		})
	}

	t.Run("EscapedBackslashIsStorable", func(t *testing.T) {
		t.Parallel()
		fn := func(ctx context.Context, tx pgx.Tx) (string, error) { return `\u0000`, nil }
		_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "escaped", testTTL, nil, fn)
		require.NoError(t, err)
		res, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "escaped", testTTL, nil, fn)
		require.NoError(t, err)
		require.Equal(t, `\u0000`, res)
	})
}

func TestDoTxFingerprint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) { return "v", nil }
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, fn)
	require.NoError(t, err)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("b")}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	v, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, fn)
	require.NoError(t, err)
	require.Equal(t, "v", v)
}

func TestDoTxExpiredRecordRunsAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (int32, error) { return runs.Add(1), nil }
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, fn)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)

	tx := b.begin(t)
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("b")}, fn)
	require.NoError(t, err, "an expired record's fingerprint does not bind")
	require.False(t, res.Replayed)
	require.False(t, res.TookOver)
	require.Equal(t, 1, res.Attempts)
	require.EqualValues(t, 2, res.Value)
	require.NoError(t, tx.Commit(b.ctx))
	rec := b.lookup(t, "ledger", "k")
	require.False(t, rec.Expired)
	require.Equal(t, []byte("b"), rec.Fingerprint)
}

// TestDoTxMeetsDo covers every way Do and DoTx can meet on one key (see DoTxResult).
func TestDoTxMeetsDo(t *testing.T) {
	t.Parallel()

	t.Run("DoTxReplaysDo", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil,
			func(ctx context.Context) (string, error) { return "from-do", nil })
		require.NoError(t, err)
		v, err := pgidem.DoInTx(b.ctx, b.coord, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		require.Equal(t, "from-do", v)
	})

	t.Run("DoReplaysDoTx", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		_, err := pgidem.DoInTx(b.ctx, b.coord, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil,
			func(ctx context.Context) (string, error) { return "from-do", nil })
		require.NoError(t, err)
		require.True(t, res.Replayed)
		require.Equal(t, "from-dotx", res.Value)
	})

	t.Run("DoInProgress", func(t *testing.T) {
		t.Parallel()
		waited := make(chan struct{}, 1)
		b := setup(t, &pgidem.Config{Hook: pgidem.HookFunc(func(ctx context.Context, e pgidem.Event) {
			if e.Kind == pgidem.EventWaited {
				select {
				case waited <- struct{}{}:
				default:
				}
			}
		})})
		h := b.hold(b.coord, "mail", "k", nil, "from-do")

		// Raise: ErrInProgress at once, with the Do holder's lease as retry-after.
		_, err := pgidem.DoInTx(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		var inProgress *pgidem.InProgressError
		require.ErrorAs(t, err, &inProgress)
		require.False(t, inProgress.Waited)
		require.Equal(t, 1, inProgress.Attempts)
		require.False(t, inProgress.LeaseExpiresAt.IsZero())

		// Wait: polls until Do completes, then replays.
		type outcome struct {
			res pgidem.Result[string]
			err error
		}
		waiter := make(chan outcome, 1)
		go func() {
			tx, err := b.db.Pool.Begin(b.ctx)
			if err != nil {
				waiter <- outcome{err: err}
				return
			}
			defer tx.Rollback(b.ctx) //nolint:errcheck
			res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
				func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
			waiter <- outcome{res, err}
		}()
		<-waited
		h.unblock()
		require.NoError(t, <-h.done)
		out := <-waiter
		require.NoError(t, out.err)
		require.True(t, out.res.Replayed)
		require.True(t, out.res.Waited)
		require.Equal(t, "from-do", out.res.Value)
	})

	t.Run("DoHolderDied", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		// A Do holder that reserved the key and died: its lease ran out.
		_, err := b.db.Pool.Exec(b.ctx, `
INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at)
VALUES ('mail', 'k', 'in_progress', gen_random_uuid(), 1, now() - interval '1 second', now() + interval '1 hour')`)
		require.NoError(t, err)
		tx := b.begin(t)
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		require.True(t, res.TookOver)
		require.Equal(t, 2, res.Attempts, "the dead holder may have run the effect too")
		require.NoError(t, tx.Commit(b.ctx))
		rec := b.lookup(t, "mail", "k")
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		require.Equal(t, 2, rec.Attempts)
	})

	t.Run("DoReservesWhileDoTxRuns", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.createLedger(t)
		var h *holder // Do holding the key, started from inside fn
		tx := b.begin(t)
		_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
			func(ctx context.Context, tx pgx.Tx) (string, error) {
				_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('dotx')`)
				require.NoError(t, err)
				// Do sees no record yet: DoTx has not written it
				h = b.hold(b.coord, "mail", "k", nil, "from-do")
				return "from-dotx", nil
			})
		require.ErrorIs(t, err, pgidem.ErrInProgress, "DoTx yields to Do's live reservation")
		requireUsable(t, b.ctx, tx)
		var inTx int
		require.NoError(t, tx.QueryRow(b.ctx, `SELECT count(*) FROM ledger`).Scan(&inTx))
		require.Zero(t, inTx, "fn's writes were rolled back to the savepoint")
		require.NoError(t, tx.Rollback(b.ctx))

		h.unblock()
		require.NoError(t, <-h.done)
		v, err := pgidem.DoInTx(b.ctx, b.coord, "mail", "k", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
		require.NoError(t, err)
		require.Equal(t, "from-do", v, "the effect happened once: Do's")
	})

	t.Run("DoWaitsForDoTxCommit", func(t *testing.T) {
		t.Parallel()
		tests := []struct {
			name   string
			commit bool
			want   string
		}{
			{"Commit", true, "from-dotx"},
			{"Rollback", false, "from-do"},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				b := setup(t, nil)
				tx := b.begin(t)
				_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
					func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
				require.NoError(t, err)

				type outcome struct {
					res pgidem.Result[string]
					err error
				}
				doDone := make(chan outcome, 1)
				go func() {
					res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil,
						func(ctx context.Context) (string, error) { return "from-do", nil })
					doDone <- outcome{res, err}
				}()
				b.waitForBlocked(t, "transactionid", 1) // Do's insert waits for tx
				if tt.commit {
					require.NoError(t, tx.Commit(b.ctx))
				} else {
					require.NoError(t, tx.Rollback(b.ctx))
				}
				out := <-doDone
				require.NoError(t, out.err)
				require.Equal(t, tt.commit, out.res.Replayed)
				require.Equal(t, tt.want, out.res.Value)
			})
		}
	})
}

func TestDoTxRepeatableReadFailsInsteadOfDuplicating(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (int32, error) { return runs.Add(1), nil }

	tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx.Rollback(b.ctx)    //nolint:errcheck
	requireUsable(t, b.ctx, tx) // takes the snapshot

	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil, fn) // commits after the snapshot
	require.NoError(t, err)

	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "40001", pgErr.Code, "a serialization failure, for the caller to retry")
	require.NoError(t, tx.Rollback(b.ctx))
	require.Equal(t, 1, b.lookup(t, "ledger", "k").Attempts)

	v, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil, fn)
	require.NoError(t, err)
	require.EqualValues(t, 1, v, "the retry replays")
}
