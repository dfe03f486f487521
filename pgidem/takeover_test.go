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
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestLeaseLostHolderCannotOverwrite(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})

	started := make(chan struct{})
	type outcome struct {
		value string
		err   error
		cause error
	}
	first := make(chan outcome, 1)
	go func() {
		var cause error
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
			close(started)
			<-ctx.Done() // a stalled holder: only the heartbeat's verdict ends it
			cause = context.Cause(ctx)
			return "stale", nil
		})
		first <- outcome{v, err, cause}
	}()
	<-started
	// Simulate the stall that outlived the lease: expire it, then let a second caller take
	// over before the first holder's heartbeat runs again.
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
		return "fresh", nil
	})
	require.NoError(t, err)
	require.True(t, second.TookOver)
	require.Equal(t, 2, second.Attempts)

	got := <-first
	require.ErrorIs(t, got.cause, pgidem.ErrLeaseLost, "fn's context is cancelled with cause ErrLeaseLost")
	require.ErrorIs(t, got.err, pgidem.ErrLeaseLost)
	require.Equal(t, "stale", got.value, "the value comes back with the error")

	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"fresh"`, string(rec.Result), "the taken-over holder did not overwrite")
	require.Equal(t, 2, rec.Attempts)
}

// Only the owner can complete, fail or release. A holder whose reservation is no longer
// its own — taken over after its lease expired (the new row has attempts 2), or deleted by
// an operator and reserved afresh by another caller (attempts 1) — returns a Permanent
// error, an ordinary error, or panics: none of them may rewrite the new holder's row, and
// each reports the lost lease (EventLeaseLost) once.
func TestOnlyOwnerCanFailOrRelease(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"TakenOver", "Forgotten"} {
		for _, mode := range []string{"Permanent", "Error", "Panic"} {
			t.Run(how+"/"+mode, func(t *testing.T) {
				t.Parallel()
				testOnlyOwner(t, how, mode)
			})
		}
	}
}

func testOnlyOwner(t *testing.T, how, mode string) {
	// Long enough that the new holder's heartbeat keeps its lease live on a loaded machine
	// while the test inspects it; short enough that the stale holder learns of the loss soon.
	const lease = 1500 * time.Millisecond
	var lost atomic.Int64
	b := setup(t, &pgidem.Config{Lease: lease, Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			lost.Add(e.Count)
		}
	})})
	declined := errors.New("declined")
	started, proceed := make(chan struct{}), make(chan struct{})
	type outcome struct {
		err      error
		panicked any
		cause    error
	}
	first := make(chan outcome, 1)
	go func() {
		var out outcome
		defer func() { out.panicked = recover(); first <- out }()
		_, out.err = pgidem.Do(b.ctx, b.coord, "pay", "k", testTTL, nil, func(ctx context.Context) (string, error) {
			close(started)
			<-ctx.Done() // the heartbeat finds the row no longer ours
			out.cause = context.Cause(ctx)
			<-proceed
			switch mode {
			case "Permanent":
				return "", pgidem.Permanent(declined)
			case "Error":
				return "", declined
			}
			panic("boom")
		})
	}()
	<-started
	wantAttempts := 2
	if how == "TakenOver" {
		_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second'`)
		require.NoError(t, err)
	} else {
		_, err := b.db.Pool.Exec(b.ctx, `DELETE FROM pgidem_record`)
		require.NoError(t, err)
		wantAttempts = 1
	}
	taker := b.hold(b.coord, "pay", "k", nil, "taker") // reserves and stays in progress
	before := b.readRaw(t, "pay", "k")
	require.Equal(t, wantAttempts, before.Attempts)
	require.Equal(t, "in_progress", before.Status)

	close(proceed)
	out := <-first
	require.ErrorIs(t, out.cause, pgidem.ErrLeaseLost)
	switch mode {
	case "Permanent":
		require.ErrorIs(t, out.err, declined)
		require.ErrorIs(t, out.err, pgidem.ErrLeaseLost, "the failure was not stored: the lease was lost")
		notStored, ok := out.err.(*pgidem.FailureNotStoredError)
		require.True(t, ok, "pgidem's verdict is the top-level error: %T", out.err)
		require.ErrorIs(t, notStored.Cause, pgidem.ErrLeaseLost)
		require.ErrorIs(t, notStored.Err, declined)
	case "Error":
		require.ErrorIs(t, out.err, declined)
	case "Panic":
		require.Equal(t, "boom", out.panicked)
	}

	require.Equal(t, before, b.readRaw(t, "pay", "k"), "the stale holder rewrote the new holder's row")
	require.Equal(t, int64(1), lost.Load(), "the stale holder's lost lease is counted once, whatever fn did")
	var leaseLive bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx,
		`SELECT lease_expires_at > now() AND lease_expires_at <> updated_at FROM pgidem_record`).Scan(&leaseLive))
	require.True(t, leaseLive, "the stale holder released the new holder's lease")
	_, err := pgidem.Do(b.ctx, b.coord, "pay", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
		func(context.Context) (string, error) { return "third", nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress, "the new holder is still the holder")

	taker.unblock()
	require.NoError(t, <-taker.done)
	rec := b.lookup(t, "pay", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"taker"`, string(rec.Result))
}

// A slow live holder is never taken over, however long fn runs — here three times the
// record's TTL. Contenders on its own and on another pool and coordinator see it in
// progress the whole time, and a sweep running meanwhile never deletes the live
// reservation.
func TestLiveHolderNeverTakenOver(t *testing.T) {
	t.Parallel()
	// Long enough that the holder's renewals get through when the race detector and
	// parallel tests starve its goroutines: a renewal must be answered within about 0.6
	// of a lease, or the heartbeat cancels fn before anyone could take over.
	const lease, ttl = time.Second, 2 * time.Second
	cfg := &pgidem.Config{Lease: lease, MinTTL: ttl, InFlight: pgidem.InFlightRaise}
	b := setup(t, cfg)
	other := b.newCoordOn(t, b.newPool(t, nil), cfg)

	var runs atomic.Int32
	done := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "slow", ttl, nil, func(ctx context.Context) (string, error) {
			runs.Add(1)
			close(started)
			select {
			case <-time.After(3 * ttl):
				return "slow-done", nil
			case <-ctx.Done():
				return "", context.Cause(ctx)
			}
		})
		done <- err
	}()
	<-started
	contenders := 0
loop:
	for {
		select {
		case err := <-done:
			require.NoError(t, err)
			break loop
		default:
		}
		for _, coord := range []*pgidem.Coordinator{b.coord, other} {
			_, err := pgidem.Do(b.ctx, coord, "mail", "slow", ttl, nil, func(context.Context) (string, error) {
				runs.Add(1)
				return "contender", nil
			})
			if err != nil { // nil only if the holder completed between the select and the call
				require.ErrorIs(t, err, pgidem.ErrInProgress)
			}
		}
		sw, err := other.Sweep(b.ctx, nil)
		require.NoError(t, err)
		require.Zero(t, sw.Records, "a sweep deleted a live holder's reservation")
		contenders++
		time.Sleep(lease / 5)
	}
	require.Greater(t, contenders, 10)
	require.EqualValues(t, 1, runs.Load())
	rec := b.lookup(t, "mail", "slow")
	require.Equal(t, 1, rec.Attempts)
	require.JSONEq(t, `"slow-done"`, string(rec.Result))
}

// N concurrent callers on a key whose record expired but was never swept (and on a key
// with no record): 24 callers on 4 coordinators (separate pools; batching on and off). fn
// runs once, nobody replays the old value, every caller gets the new one, attempts start
// afresh.
func TestConcurrentCallersOnExpiredRecordAcrossCoordinators(t *testing.T) {
	t.Parallel()
	for _, preset := range []string{"expired", "absent"} {
		t.Run(preset, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			if preset == "expired" {
				_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
					(namespace, key, status, owner, attempts, result, expires_at, completed_at)
					VALUES ('mail', 'k', 'completed', gen_random_uuid(), 3, '"old"', now() - interval '1 second', now() - interval '1 hour')`)
				require.NoError(t, err)
			}
			var coords []*pgidem.Coordinator
			for i := range 4 {
				coords = append(coords, b.newCoordOn(t, b.newPool(t, nil), &pgidem.Config{MaxBatch: 1 + i%2*63}))
			}
			const callers = 24
			var runs atomic.Int32
			values := make([]string, callers)
			errs := make([]error, callers)
			start := make(chan struct{})
			var wg sync.WaitGroup
			for i := range callers {
				wg.Go(func() {
					<-start
					values[i], errs[i] = pgidem.Do(b.ctx, coords[i%len(coords)], "mail", "k", testTTL, nil,
						func(context.Context) (string, error) {
							n := runs.Add(1)
							time.Sleep(50 * time.Millisecond)
							return fmt.Sprintf("new-%d", n), nil
						})
				})
			}
			close(start)
			wg.Wait()
			require.EqualValues(t, 1, runs.Load())
			for i := range callers {
				require.NoError(t, errs[i], "caller %d", i)
				require.Equal(t, "new-1", values[i], "caller %d", i)
			}
			rec := b.lookup(t, "mail", "k")
			require.Equal(t, 1, rec.Attempts)
			require.JSONEq(t, `"new-1"`, string(rec.Result))
		})
	}
}

// Two takers of an expired lease: the second one's UPDATE blocks on the first's row lock,
// re-checks the WHERE clause on the new row version (READ COMMITTED) and updates nothing.
func TestTakeoverRecheckUnderReadCommitted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	insertRecord(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)

	tx := b.begin(t)
	// A competing taker, not yet committed.
	tag, err := tx.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = attempts + 1,
		lease_expires_at = now() + interval '1 hour' WHERE key = 'k' AND lease_expires_at <= now()`)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	var ran atomic.Bool
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, raiseOpts(), func(context.Context) (int, error) {
			ran.Store(true)
			return 1, nil
		})
		done <- err
	}()
	waitLockBlocked(t, b, 1) // our takeover UPDATE waits for the competitor's row lock
	require.NoError(t, tx.Commit(b.ctx))
	require.ErrorIs(t, <-done, pgidem.ErrInProgress)
	require.False(t, ran.Load(), "the loser of the takeover race must not run fn")
	require.Equal(t, 2, b.lookup(t, "mail", "k").Attempts)
}

// Many callers racing to take over one dead holder's lease: fn runs once, attempts 2.
func TestConcurrentTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	insertRecord(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
	const callers = 16
	var runs atomic.Int32
	var tookOver atomic.Int32
	values := make([]int32, callers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range callers {
		wg.Go(func() {
			<-start
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int32, error) {
				return runs.Add(1), nil
			})
			assertNoErr(t, err)
			if res.TookOver {
				tookOver.Add(1)
			}
			values[i] = res.Value
		})
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 1, tookOver.Load())
	for _, v := range values {
		require.EqualValues(t, 1, v)
	}
	require.Equal(t, 2, b.lookup(t, "mail", "k").Attempts)
}

// Releasing a reservation that took over a dead holder's keeps the evidence: the row stays
// with its lease ended (the next caller takes over at once) and its attempts, so the record
// says the effect may have run more than once all along. Taking the released row over
// counts no attempt and reports no takeover (its holder did not die). A first reservation
// that is released still leaves no row.
func TestReleaseAfterTakeoverKeepsAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	transient := errors.New("transient")
	failing := func(context.Context) (int, error) { return 0, transient }
	requireKept := func(t *testing.T, key string, attempts int) {
		t.Helper()
		rec := b.lookup(t, "mail", key)
		require.Equal(t, pgidem.StatusInProgress, rec.Status)
		require.Equal(t, attempts, rec.Attempts)
		require.False(t, rec.LeaseExpiresAt.After(rec.UpdatedAt), "its lease ended when it was released")
		var tookOver bool
		require.NoError(t, b.db.Pool.QueryRow(b.ctx,
			`SELECT took_over FROM pgidem_record_overview WHERE namespace = 'mail' AND key = $1`, key).Scan(&tookOver))
		require.True(t, tookOver, "the overview shows the takeover")
	}

	t.Run("Error", func(t *testing.T) {
		insertRecord(t, b, "err", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "err", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		require.True(t, res.TookOver)
		requireKept(t, "err", 2)

		res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "err", testTTL, raiseOpts(),
			func(context.Context) (int, error) { return 7, nil })
		require.NoError(t, err, "taken over at once, without waiting for a lease")
		require.False(t, res.TookOver, "a released record's holder did not stop renewing: no takeover")
		require.Equal(t, 2, res.Attempts, "the release counted no attempt")
		rec := b.lookup(t, "mail", "err")
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		require.Equal(t, 2, rec.Attempts, "the dead holder may have run the effect too")
	})

	t.Run("Panic", func(t *testing.T) {
		insertRecord(t, b, "panic", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		require.Panics(t, func() {
			_, _ = pgidem.Do(b.ctx, b.coord, "mail", "panic", testTTL, nil,
				func(context.Context) (int, error) { panic("boom") })
		})
		requireKept(t, "panic", 2)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "panic", testTTL, nil,
			func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.Equal(t, 2, res.Attempts)
	})

	t.Run("DoTx", func(t *testing.T) {
		insertRecord(t, b, "dotx", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		_, err := pgidem.DoResult(b.ctx, b.coord, "mail", "dotx", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		tx := b.begin(t)
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "dotx", testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.False(t, res.TookOver)
		require.Equal(t, 2, res.Attempts, "DoTx counts no attempt for a released record either")
		require.NoError(t, tx.Commit(b.ctx))
	})

	t.Run("FirstReservation", func(t *testing.T) {
		_, err := pgidem.DoResult(b.ctx, b.coord, "mail", "first", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		_, err = b.coord.Lookup(b.ctx, "mail", "first")
		require.ErrorIs(t, err, pgidem.ErrNotFound, "a released first reservation leaves no row")
	})
}

// Whether a call took over is decided on the row its takeover statement locked, not on its
// earlier read: here the read sees a released record (no takeover), but before the
// takeover writes, another holder took the key over and died (its lease ran out). That is
// a takeover: attempts go up and Result.TookOver says so.
func TestTookOverDecidedAtWrite(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"Do", "DoTxCommitDuringFn", "DoTxCommitDuringWrite", "DoTxReadUncommittedCommitDuringWrite"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testTookOverDecidedAtWrite(t, mode)
		})
	}
}

// testTookOverDecidedAtWrite: mode says who takes the key over (Do or DoTx) and, for DoTx,
// whether the other holder commits while fn runs or while DoTx's write waits for its lock.
func testTookOverDecidedAtWrite(t *testing.T, mode string) {
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, lease_expires_at, updated_at, expires_at)
		VALUES ('mail', 'k', 'in_progress', gen_random_uuid(), 2, now() - interval '1 second',
			now() - interval '1 second', now() + interval '1 hour')`) // released
	require.NoError(t, err)
	crashed := b.begin(t) // another holder's takeover, committed after our read
	_, err = crashed.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = 3,
		lease_expires_at = now() - interval '1 millisecond', updated_at = now() - interval '1 second'
		WHERE namespace = 'mail' AND key = 'k'`)
	require.NoError(t, err)
	type outcome struct {
		res pgidem.Result[int]
		err error
	}
	done := make(chan outcome, 1)
	if mode != "Do" {
		// DoTx reads, then runs fn, then writes.
		inFn, proceed := make(chan struct{}), make(chan struct{})
		go func() {
			iso := pgx.ReadCommitted
			if mode == "DoTxReadUncommittedCommitDuringWrite" {
				iso = pgx.ReadUncommitted // Postgres runs it as READ COMMITTED
			}
			tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				done <- outcome{err: err}
				return
			}
			defer tx.Rollback(b.ctx) //nolint:errcheck // a no-op after commit
			res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
				func(context.Context, pgx.Tx) (int, error) {
					close(inFn)
					<-proceed
					return 1, nil
				})
			if err == nil {
				err = tx.Commit(b.ctx)
			}
			done <- outcome{res, err}
		}()
		<-inFn
		if mode == "DoTxCommitDuringFn" {
			require.NoError(t, crashed.Commit(b.ctx))
			close(proceed)
		} else { // the CommitDuringWrite modes
			close(proceed)
			waitLockBlocked(t, b, 1) // DoTx's write waits for the other holder's row lock
			require.NoError(t, crashed.Commit(b.ctx))
		}
	} else {
		go func() {
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
			done <- outcome{res, err}
		}()
		waitLockBlocked(t, b, 1) // the takeover statement waits for the other holder's row lock
		require.NoError(t, crashed.Commit(b.ctx))
	}
	out := <-done
	require.NoError(t, out.err)
	require.True(t, out.res.TookOver, "the holder whose lease it took over died")
	require.Equal(t, 4, out.res.Attempts)
}
