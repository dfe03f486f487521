package pgidem_test

import (
	"context"
	"encoding/json"
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

// DoTx whose fn's statement is cut off by the caller's deadline, and which then fails
// permanently: storing the failure fails on the closed connection, which is the
// deadline's doing, not the store's, so it is neither logged nor counted as a store error.
func TestDoTxCallerDeadlineThenPermanent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	tx := b.begin(t)
	ctx, cancel := context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err := pgidem.DoTx(ctx, coord, tx, "mail", "k", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
		require.Error(t, err)
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	notStored, ok := err.(*pgidem.FailureNotStoredError)
	require.True(t, ok, "%T: %v", err, err)
	require.ErrorIs(t, notStored.Cause, context.DeadlineExceeded)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.Zero(t, storeErrors.Load())
}

// DoTx in a read-only transaction, which can never write the record, refuses before fn
// runs.
func TestDoTxReadOnlyTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
		func(context.Context, pgx.Tx) (int, error) { panic("fn must not run") })
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorContains(t, err, "read-only")
	var one int
	require.NoError(t, tx.QueryRow(b.ctx, "SELECT 1").Scan(&one), "tx stays usable")
}

// A Do holder that reserves the key while DoTx's fn fails permanently: the failure is not
// recorded (Do's live row is left alone) and DoTx decides again — here Raise, so
// ErrInProgress — and once Do completes, its value is what everyone replays.
func TestDoTxPermanentFailureYieldsToDoReservation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var h *holder // Do holding the key, started from inside fn
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, raiseOpts(),
		func(ctx context.Context, tx pgx.Tx) (string, error) {
			// Do sees no record yet: DoTx has not written it
			h = b.hold(b.coord, "mail", "k", nil, "from-do")
			return "", pgidem.Permanent(errors.New("declined"))
		})
	require.ErrorIs(t, err, pgidem.ErrInProgress, "DoTx yields to Do's live reservation")
	require.NotErrorIs(t, err, pgidem.ErrPermanent)
	requireUsable(t, b.ctx, tx)
	require.NoError(t, tx.Commit(b.ctx))

	h.unblock()
	require.NoError(t, <-h.done)
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	v, err := pgidem.DoInTx(b.ctx, b.coord, "mail", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
	require.NoError(t, err)
	require.Equal(t, "from-do", v)
}

// The same race under Wait: DoTx waits for the Do holder and holds no lock on its record
// meanwhile, so the holder's heartbeat is never blocked, the live holder is never taken
// over and its fn is not cancelled.
func TestDoTxPermanentFailureWaitsWithoutLockingHolder(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})
	holders := make(chan *holder, 1)
	var runs atomic.Int32
	tx := b.begin(t)
	type outcome struct {
		res pgidem.Result[string]
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL,
			&pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 30 * time.Second},
			func(ctx context.Context, tx pgx.Tx) (string, error) {
				if runs.Add(1) == 1 {
					holders <- b.hold(b.coord, "mail", "k", nil, "from-do")
				}
				return "", pgidem.Permanent(errors.New("declined"))
			})
		done <- outcome{res, err}
	}()
	h := <-holders
	// Four leases: long enough for a blocked heartbeat to lose the holder's lease.
	time.Sleep(4 * lease)
	select {
	case out := <-done:
		t.Fatalf("DoTx returned while the holder was alive: %+v, %v", out.res, out.err)
	case err := <-h.done:
		t.Fatalf("the holder ended before it was unblocked: %v", err)
	default:
	}
	h.unblock()
	require.NoError(t, <-h.done, "the live holder kept its lease")
	out := <-done
	require.NoError(t, out.err)
	require.True(t, out.res.Replayed)
	require.Equal(t, "from-do", out.res.Value)
	require.Equal(t, int32(1), runs.Load())
	require.NoError(t, tx.Commit(b.ctx))
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.Equal(t, 1, rec.Attempts)
}

// A wait timeout above Postgres's lock_timeout maximum (INT_MAX ms, about 24.8 days) is
// waited out in capped lock waits instead of failing; the caller's context bounds the wait
// here.
func TestDoTxWaitTimeoutAboveLockTimeoutMax(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	holder := b.holdKey(t, "ledger", "k")
	defer holder.Rollback(b.ctx) //nolint:errcheck // test cleanup

	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		tx, err := b.db.Pool.Begin(ctx)
		if err != nil {
			done <- err
			return
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // test cleanup
		_, err = pgidem.DoTx(ctx, b.coord, tx, "ledger", "k", testTTL,
			&pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 30 * 24 * time.Hour},
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "waiter", nil })
		done <- err
	}()
	// Either the waiter blocks on the advisory lock (correct) or it has already failed.
	var early error
	require.Eventually(t, func() bool {
		select {
		case early = <-done:
			return true
		default:
		}
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype = 'advisory' AND a.datname = current_database()`).Scan(&waiting)
		return err == nil && waiting >= 1
	}, 30*time.Second, 5*time.Millisecond)
	require.NoError(t, early, "a long wait timeout must wait, not fail")
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
}

// Two transactions that take two keys in opposite order: Postgres detects the deadlock and
// reports it to one of them (40P01, as a *StoreError), and the other commits; neither waits
// out its WaitTimeout.
func TestDoTxOppositeLockOrderIsADeadlock(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	opts := &pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 15 * time.Second}

	var holding sync.WaitGroup // both transactions hold their first key
	holding.Add(2)
	run := func(first, second string) error {
		tx, err := b.db.Pool.Begin(b.ctx)
		if err != nil {
			holding.Done()
			return err
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // a no-op after Commit
		_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", first, testTTL, opts,
			func(ctx context.Context, tx pgx.Tx) (string, error) {
				holding.Done()
				holding.Wait()
				return pgidem.DoTx(ctx, b.coord, tx, "ledger", second, testTTL, opts,
					func(ctx context.Context, tx pgx.Tx) (string, error) { return first + second, nil })
			})
		if err != nil {
			return err
		}
		return tx.Commit(b.ctx)
	}
	errs := make(chan error, 2)
	go func() { errs <- run("a", "b") }()
	go func() { errs <- run("b", "a") }()

	var deadlocks, commits int
	for range 2 {
		select {
		case err := <-errs:
			var pgErr *pgconn.PgError
			var storeErr *pgidem.StoreError
			switch {
			case err == nil:
				commits++
			case errors.As(err, &storeErr) && errors.As(err, &pgErr) && pgErr.Code == "40P01":
				deadlocks++
			default:
				t.Errorf("want a deadlock (40P01) or a commit, got %v", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("the transactions did not finish")
		}
	}
	require.Equal(t, 1, deadlocks)
	require.Equal(t, 1, commits)
	require.NotNil(t, b.lookup(t, "ledger", "a"))
	require.NotNil(t, b.lookup(t, "ledger", "b"))
}

// A contended DoTx waits for the lock holder and replays, whatever the caller's session
// timeouts: it sets lock_timeout for the wait and lifts statement_timeout (so a shorter one
// cannot cancel the wait), then puts both back.
func TestDoTxLockTimeoutRestoredAfterWait(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	holder := b.holdKey(t, "ledger", "k")

	type outcome struct {
		res                      pgidem.Result[string]
		lockTimeout, stmtTimeout string
		err                      error
	}
	done := make(chan outcome, 1)
	go func() {
		var out outcome
		defer func() { done <- out }()
		tx, err := b.db.Pool.Begin(b.ctx)
		if err != nil {
			out.err = err
			return
		}
		defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
		if _, out.err = tx.Exec(b.ctx, `SET LOCAL lock_timeout = '7s'`); out.err != nil {
			return
		}
		if _, out.err = tx.Exec(b.ctx, `SET LOCAL statement_timeout = '300ms'`); out.err != nil {
			return
		}
		out.res, out.err = pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL,
			&pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: time.Minute},
			func(ctx context.Context, tx pgx.Tx) (string, error) { return "waiter", nil })
		if out.err == nil {
			out.err = tx.QueryRow(b.ctx, `SELECT current_setting('lock_timeout'), current_setting('statement_timeout')`).
				Scan(&out.lockTimeout, &out.stmtTimeout)
		}
	}()
	b.waitForBlocked(t, "advisory", 1)
	time.Sleep(600 * time.Millisecond) // the wait outlasts the caller's statement_timeout
	require.NoError(t, holder.Commit(b.ctx))
	out := <-done
	require.NoError(t, out.err)
	require.True(t, out.res.Replayed)
	require.Equal(t, "holder", out.res.Value)
	require.Equal(t, "7s", out.lockTimeout)
	require.Equal(t, "300ms", out.stmtTimeout)
}

// DoTx in a savepoint the caller rolls back: the record and the advisory lock go with it,
// so another transaction gets the key at once (Raise) and runs fn.
func TestDoTxInRolledBackSavepoint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx := b.begin(t)
	sp, err := tx.Begin(b.ctx)
	require.NoError(t, err)
	_, err = pgidem.DoTx(b.ctx, b.coord, sp, "ledger", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "first", nil })
	require.NoError(t, err)
	require.NoError(t, sp.Rollback(b.ctx))

	res, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, raiseOpts(),
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "second", nil })
	require.NoError(t, err, "the rolled-back savepoint released the lock")
	require.Equal(t, "second", res)
	requireUsable(t, b.ctx, tx)
}

// Two DoTx calls on one key in one transaction: the second replays the first's
// uncommitted record (the advisory lock is re-entrant), fn runs once.
func TestDoTxTwiceInOneTx(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	tx := b.begin(t)
	var runs atomic.Int32
	first, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, raiseOpts(), ledgerInsert("r", &runs))
	require.NoError(t, err)
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, raiseOpts(), ledgerInsert("r", &runs))
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, first, res.Value)
	require.EqualValues(t, 1, runs.Load())
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, 1, b.ledgerRows(t, "r"))
}

// Do on a key whose DoTx record is still uncommitted in the same goroutine's transaction
// waits for a commit that cannot come (the deadlock DoTxResult documents): its reserve
// statement is bounded by Config.FinishTimeout, not by its ctx, and then Do fails with a
// store error without running fn. DoTx in the same transaction replays instead.
func TestDoTxThenDoInSameGoroutineBlocks(t *testing.T) {
	t.Parallel()
	for _, failOpen := range []bool{false, true} {
		t.Run(fmt.Sprintf("FailOpen=%t", failOpen), func(t *testing.T) {
			t.Parallel()
			testDoTxThenDo(t, failOpen)
		})
	}
}

// testDoTxThenDo: with FailOpen too, the blocked reserve is not an unreachable store (the
// store answered the read), so fn never runs beside the uncommitted DoTx record.
func testDoTxThenDo(t *testing.T, failOpen bool) {
	const finishTimeout = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{FinishTimeout: finishTimeout, FailOpen: failOpen})
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(b.ctx, time.Minute) // bounds the test, not Do
	defer cancel()
	var ran atomic.Bool
	start := time.Now()
	_, err = pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil,
		func(ctx context.Context) (string, error) { ran.Store(true); return "from-do", nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	var storeErr *pgidem.StoreError
	require.ErrorAs(t, err, &storeErr)
	require.Equal(t, "reserve", storeErr.Op)
	require.GreaterOrEqual(t, time.Since(start), finishTimeout)
	require.False(t, ran.Load())

	v, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "again", nil })
	require.NoError(t, err)
	require.Equal(t, "from-dotx", v)
	require.NoError(t, tx.Commit(b.ctx))
}

// Under REPEATABLE READ, DoTx waiting for a Do holder never sees it finish (each poll
// reads the transaction's snapshot): the wait ends with ErrInProgress at the wait timeout
// although Do completed meanwhile.
func TestDoTxRepeatableReadWaitForDoTimesOut(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.hold(b.coord, "mail", "k", nil, "from-do")

	tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx.Rollback(b.ctx)    //nolint:errcheck // test cleanup
	requireUsable(t, b.ctx, tx) // takes the snapshot: Do's row in progress

	h.unblock()
	require.NoError(t, <-h.done)
	require.Equal(t, pgidem.StatusCompleted, b.lookup(t, "mail", "k").Status)

	var ran atomic.Bool
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, &pgidem.DoOpts{WaitTimeout: 300 * time.Millisecond},
		func(ctx context.Context, tx pgx.Tx) (string, error) { ran.Store(true); return "from-dotx", nil })
	var inProgress *pgidem.InProgressError
	require.ErrorAs(t, err, &inProgress, "the snapshot still shows Do in progress")
	require.True(t, inProgress.Waited)
	require.False(t, ran.Load())
	requireUsable(t, b.ctx, tx)
}

// A result jsonb refuses (class 22 or 54) is the caller's value at fault, not a store
// outage: DoTx returns ErrResultNotStorable, rolls fn's writes back and stores nothing, so
// the next call runs fn again. It is not reported or logged as ErrStoreUnavailable.
func TestDoTxResultRefusedByJSONB(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	deep := func() any {
		v := any([]any{})
		for range 50000 {
			v = []any{v}
		}
		return v
	}
	for name, value := range map[string]any{
		"Surrogate": json.RawMessage(`"\ud800"`),
		"TooDeep":   deep(),
	} {
		t.Run(name, func(t *testing.T) {
			_, err := pgidem.DoInTx(b.ctx, b.coord, "t", name, testTTL, nil, func(ctx context.Context, tx pgx.Tx) (any, error) {
				_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ($1)`, name)
				return value, err
			})
			require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
			require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
			_, err = b.coord.Lookup(b.ctx, "t", name)
			require.ErrorIs(t, err, pgidem.ErrNotFound)
			var n int
			require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM ledger WHERE ref = $1`, name).Scan(&n))
			require.Zero(t, n, "fn's writes were rolled back")
		})
	}
}

// Under REPEATABLE READ and SERIALIZABLE, an expired record that a sweep deletes after the
// caller's snapshot behaves like no record: DoTx inserts afresh. (A version of the upsert
// that locked the old row first failed here with a serialization failure.)
func TestDoTxSweptExpiredRecordUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	for _, iso := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(iso), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at)
				VALUES ('t', 'k', 'completed', gen_random_uuid(), '0', now() - interval '1 second')`)
			require.NoError(t, err)
			tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: iso})
			require.NoError(t, err)
			defer tx.Rollback(b.ctx) //nolint:errcheck // a no-op after commit
			res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", "k", testTTL, nil, func(ctx context.Context, _ pgx.Tx) (int, error) {
				swept, err := b.coord.Sweep(ctx, nil) // another session deletes the expired row
				require.NoError(t, err)
				require.EqualValues(t, 1, swept.Records)
				return 1, nil
			})
			require.NoError(t, err)
			require.Equal(t, 1, res.Value)
			require.Equal(t, 1, res.Attempts)
			require.False(t, res.TookOver)
			require.NoError(t, tx.Commit(b.ctx))
		})
	}
}

// DoTx's savepoints are released on every path, also when they are rolled back: ROLLBACK
// TO SAVEPOINT alone keeps the savepoint open, and a transaction looping over DoTx calls
// that fail nested one subtransaction per call. After many failing calls and a write, the
// transaction holds one transaction id, not one per call, and no pgidem savepoint is left.
func TestDoTxErrorsLeaveNoSavepoints(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx := b.begin(t)
	failed := errors.New("fn failed")
	for i := range 70 {
		fn := func(context.Context, pgx.Tx) (int, error) { return 0, failed }
		if i%2 == 1 {
			fn = func(context.Context, pgx.Tx) (int, error) { return 0, pgidem.Permanent(failed) }
		}
		_, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", fmt.Sprintf("k-%d", i), testTTL, nil, fn)
		require.ErrorIs(t, err, failed)
	}
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "ok", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)
	var xids int
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT count(*) FROM pg_locks
		WHERE locktype = 'transactionid' AND pid = pg_backend_pid()`).Scan(&xids))
	require.LessOrEqual(t, xids, 2, "the transaction's id (and at most one subtransaction's), not one per DoTx call")
	_, err = tx.Exec(b.ctx, "RELEASE SAVEPOINT pgidem_dotx")
	require.ErrorContains(t, err, "3B001", "no pgidem savepoint is left open")
}

// A fn that swallows the error of one of its statements and returns nil leaves the
// transaction aborted. DoTx, DoInTx and InboxHandle say so, and that it is fn's mistake, not
// a store error (nothing is logged at error or counted). Nothing of fn's is committed, and
// the next delivery runs fn again.
func TestFnSwallowingAFailedStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	swallow := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "INSERT INTO effects (id) VALUES (1)")
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "SELECT 1/0")
		require.Error(t, err)
		return nil
	}
	_, err := b.db.Pool.Exec(b.ctx, "CREATE TABLE effects (id int PRIMARY KEY)")
	require.NoError(t, err)
	check := func(t *testing.T, err error) {
		t.Helper()
		require.ErrorContains(t, err, "fn returned nil after one of its statements failed")
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
		var effects int
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM effects").Scan(&effects))
		require.Zero(t, effects)
	}

	_, err = coord.InboxHandle(b.ctx, "billing", "m1", nil, swallow)
	check(t, err)
	var inbox int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM pgidem_inbox").Scan(&inbox))
	require.Zero(t, inbox, "the message is not marked handled")

	_, err = pgidem.DoInTx(b.ctx, coord, "mail", "k1", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 1, swallow(ctx, tx)
	})
	check(t, err)

	tx := b.begin(t)
	_, err = pgidem.DoTx(b.ctx, coord, tx, "mail", "k2", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
		return 1, swallow(ctx, tx)
	})
	check(t, err)
	requireUsable(t, b.ctx, tx)
	require.NoError(t, tx.Commit(b.ctx))
	require.Zero(t, b.count(t), "no record was written")
	require.Zero(t, storeErrors.Load())

	v, err := pgidem.DoInTx(b.ctx, coord, "mail", "k1", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, "INSERT INTO effects (id) VALUES (1)")
		return 2, err
	})
	require.NoError(t, err, "the next delivery runs fn again")
	require.Equal(t, 2, v)
}

// A transaction an earlier failed statement aborted, given to DoTx: an error matching
// ErrInvalidArgument, neither logged nor counted as a store error, and fn does not run.
func TestDoTxOnAbortedTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	tx := b.begin(t)
	_, err := tx.Exec(b.ctx, "SELECT 1/0")
	require.Error(t, err)
	ran := false
	_, err = pgidem.DoTx(b.ctx, coord, tx, "mail", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		ran = true
		return 1, nil
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.False(t, ran)
	require.Zero(t, storeErrors.Load())
}

// fn returns a Permanent error as the caller's context ends: the failure cannot be stored
// on that context, and fn's writes are still undone (the rollback to the savepoint runs on
// a context of its own), so a caller that commits keeps no effect without a record.
func TestDoTxPermanentAfterCancelUndoesWrites(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := func(cancel context.CancelFunc) func(ctx context.Context, tx pgx.Tx) (string, error) {
		return func(ctx context.Context, tx pgx.Tx) (string, error) {
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('charge')`); err != nil {
				return "", err
			}
			cancel() // the caller's deadline passes as fn returns
			return "", pgidem.Permanent(errors.New("card declined"))
		}
	}
	tx := b.begin(t)
	ctx, cancel := context.WithCancel(b.ctx)
	defer cancel()
	_, err := pgidem.DoTx(ctx, b.coord, tx, "charge", "order-1", testTTL, nil, fn(cancel))
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.ErrorContains(t, err, "the failure was not stored")
	_, top := err.(*pgidem.FailureNotStoredError)
	require.True(t, top, "pgidem's verdict is the top-level error: %T", err)
	requireUsable(t, b.ctx, tx)
	var inTx int
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT count(*) FROM ledger WHERE ref = 'charge'`).Scan(&inTx))
	require.Zero(t, inTx, "fn's writes are undone")
	require.NoError(t, tx.Commit(b.ctx))

	_, err = pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn(func() {}))
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.Zero(t, b.ledgerRows(t, "charge"), "a permanent failure never commits its writes")
}

// fn calling DoTx (or Do) on its own key is refused at once: a nested DoTx in the same
// transaction does not find its own record and run fn again, and Do inside Do's fn does not
// wait for itself.
func TestCallForHeldKeyFromFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var outer, inner atomic.Int32
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			outer.Add(1)
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "k", testTTL, nil, ledgerInsert("r", &inner))
		})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.EqualValues(t, 1, outer.Load())
	require.Zero(t, inner.Load())
	require.Zero(t, b.ledgerRows(t, "r"))

	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	// Through another key (A's fn calls B, B's fn calls A): refused too. DoTx sees every
	// key held on the way in, not only the innermost one, so A's fn never runs again
	// inside B's.
	outer.Store(0)
	var middle atomic.Int32
	var fnA func(ctx context.Context, tx pgx.Tx) (int64, error)
	fnA = func(ctx context.Context, tx pgx.Tx) (int64, error) {
		if outer.Add(1) > 3 {
			return 0, errors.New("A ran again inside itself")
		}
		return pgidem.DoTx(ctx, b.coord, tx, "ledger", "B", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int64, error) {
			middle.Add(1)
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "A", testTTL, nil, fnA)
		})
	}
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "A", testTTL, nil, fnA)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.EqualValues(t, 1, outer.Load())
	require.EqualValues(t, 1, middle.Load())
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "A", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, b.coord, "mail", "B", testTTL, nil, func(ctx context.Context) (int, error) {
			return pgidem.Do(ctx, b.coord, "mail", "A", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		})
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	// Another key from within fn is fine.
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "outer", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			return pgidem.DoTx(ctx, b.coord, tx, "ledger", "inner", testTTL, nil, ledgerInsert("inner", &inner))
		})
	require.NoError(t, err)
	require.Equal(t, 1, b.ledgerRows(t, "inner"))
}

// DoTx waiting for a Do holder leaves tx idle between its reads; each sleep stays inside
// the session's idle_in_transaction_session_timeout, which would otherwise end the
// caller's transaction (a sleep could reach 1.5 × PollIntervalMax, 1.5 s by default).
func TestDoTxWaitForDoKeepsTxAlive(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.hold(b.coord, "mail", "k", nil, "from-do")
	tx := b.begin(t)
	_, err := tx.Exec(b.ctx, `SET LOCAL idle_in_transaction_session_timeout = '1s'`)
	require.NoError(t, err)
	go func() {
		time.Sleep(4 * time.Second) // several of the waiter's longest sleeps
		h.unblock()
	}()
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL,
		&pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: 30 * time.Second},
		func(ctx context.Context, tx pgx.Tx) (string, error) { return "from-dotx", nil })
	require.NoError(t, <-h.done)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, "from-do", res.Value)
	requireUsable(t, b.ctx, tx)
}

// Coordinators on two different named schemas hold different records: a call for the
// same namespace and key on the other's coordinator from within fn is allowed (the guard
// compares the schema too). The default schema ("", the search_path's) may be any named
// one, so "" beside "public" is still refused: that nesting would wait for itself.
func TestHeldKeyGuardIsPerSchema(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `CREATE SCHEMA tenant2;
		CREATE TABLE tenant2.pgidem_record (LIKE public.pgidem_record INCLUDING ALL)`)
	require.NoError(t, err)
	public := b.newCoord(t, &pgidem.Config{Schema: "public"})
	tenant2 := b.newCoord(t, &pgidem.Config{Schema: "tenant2"})
	v, err := pgidem.Do(b.ctx, public, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, tenant2, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 7, nil })
	})
	require.NoError(t, err)
	require.Equal(t, 7, v)

	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k2", testTTL, nil, func(ctx context.Context) (int, error) {
		return pgidem.Do(ctx, public, "mail", "k2", testTTL, nil, func(context.Context) (int, error) { return 7, nil })
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = b.coord.InboxHandle(b.ctx, "c", "m", nil, func(ctx context.Context, _ pgx.Tx) error {
		_, err := public.InboxHandle(ctx, "c", "m", nil, func(context.Context, pgx.Tx) error { return nil })
		return err
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
}

// Replays through DoTx return what fn returned (TestReplayExactValues covers Do): zero
// values, nil pointers, empty and nil slices, null in a map.
func TestDoTxReplayExactValues(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type receipt struct {
		ID   string
		Tags []string
		Ptr  *int
	}
	check := func(name string, run func(key string) (any, bool, error), want any) {
		t.Helper()
		got, replayed, err := run(name)
		require.NoError(t, err, name)
		require.False(t, replayed, name)
		require.Equal(t, want, got, name)
		got, replayed, err = run(name)
		require.NoError(t, err, name)
		require.True(t, replayed, name)
		require.Equal(t, want, got, "replay of %s", name)
	}
	doTx := func(v any) func(string) (any, bool, error) {
		return func(key string) (any, bool, error) {
			tx, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
			var got any
			var replayed bool
			switch v := v.(type) {
			case int:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			case string:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) (string, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			case *receipt:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) (*receipt, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			case receipt:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) (receipt, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			case []string:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) ([]string, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			case map[string]any:
				r, err2 := pgidem.DoTxResult(b.ctx, b.coord, tx, "t", key, testTTL, nil, func(context.Context, pgx.Tx) (map[string]any, error) { return v, nil })
				got, replayed, err = r.Value, r.Replayed, err2
			default:
				panic(fmt.Sprintf("unhandled %T", v))
			}
			if err == nil {
				err = tx.Commit(b.ctx)
			}
			return got, replayed, err
		}
	}
	for name, v := range map[string]any{
		"ZeroInt":       0,
		"EmptyString":   "",
		"NilPointer":    (*receipt)(nil),
		"ZeroStruct":    receipt{},
		"EmptySlice":    []string{},
		"NilSlice":      []string(nil),
		"NilMap":        map[string]any(nil),
		"JSONNullInMap": map[string]any{"a": nil},
		"EmptySliceIn":  receipt{Tags: []string{}},
	} {
		check(name, doTx(v), v)
	}
	// The stored form of a nil result is JSON null, not SQL NULL.
	var isJSONNull bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT result = 'null'::jsonb FROM pgidem_record WHERE key = 'NilPointer'`).Scan(&isJSONNull))
	require.True(t, isJSONNull)
}
