package pgidem_test

// Regression tests from a second review of DoTx, DoInTx and the inbox: the defects it found
// (first section) and behaviour it confirmed (second section).

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
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// DoInTx commits the failed record of a Permanent error (fn's writes are undone): the next
// call replays it as a *StoredFailureError without running fn.
func TestDoInTxPermanentFailureIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) {
		runs.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('charge')`); err != nil {
			return "", err
		}
		return "", pgidem.Permanent(errors.New("card declined"))
	}
	_, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	var permanent *pgidem.PermanentError
	require.ErrorAs(t, err, &permanent, "the first call returns fn's own error")
	rec := b.lookup(t, "charge", "order-1")
	require.Equal(t, pgidem.StatusFailed, rec.Status, "the failure was committed")
	require.Zero(t, b.ledgerRows(t, "charge"), "fn's writes were undone")

	_, err = pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	var stored *pgidem.StoredFailureError
	require.ErrorAs(t, err, &stored, "the second call replays the stored permanent failure")
	require.Equal(t, "card declined", stored.Error())
	require.EqualValues(t, 1, runs.Load(), "a permanent failure is not retried")
	require.Zero(t, b.ledgerRows(t, "charge"))
}

// DoInTxResult reports how the value was obtained: run, then replayed.
func TestDoInTxResult(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, replayed := range []bool{false, true} {
		res, err := pgidem.DoInTxResult(b.ctx, b.coord, "ledger", "order-2", testTTL, nil,
			func(ctx context.Context, tx pgx.Tx) (int, error) { return 42, nil })
		require.NoError(t, err)
		require.Equal(t, 42, res.Value, "call %d", i)
		require.Equal(t, replayed, res.Replayed, "call %d", i)
		require.Equal(t, 1, res.Attempts, "call %d", i)
	}
}

// An ordinary error from fn still rolls DoInTx's transaction back: nothing is recorded and
// the next call runs fn again.
func TestDoInTxOrdinaryErrorIsNotStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context, tx pgx.Tx) (string, error) {
		if runs.Add(1) == 1 {
			return "", errors.New("timeout")
		}
		return "ok", nil
	}
	_, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.EqualError(t, err, "timeout")
	require.Zero(t, b.count(t))
	v, err := pgidem.DoInTx(b.ctx, b.coord, "charge", "order-1", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, "ok", v)
}

// A Do holder that reserves the key while DoTx's fn fails permanently: the failure is not
// recorded (Do's live row is left alone) and DoTx decides again — here Raise, so
// ErrInProgress — and once Do completes, its value is what everyone replays.
func TestDoTxPermanentFailureYieldsToDoReservation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var h *holder // Do holding the key, started from inside fn
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, reviewRaise(),
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

// The same race under Wait: DoTx waits for the Do holder and must not hold a lock on its
// record meanwhile. It used to write the failed record in tx itself; the refused upsert
// still locked the live row, the holder's heartbeat blocked on that lock, and after one
// lease DoTx took over a live holder (and the holder's fn was cancelled).
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

// An expired inbox row that a sweep deletes while InboxRecordTx's statement is running
// (the statement has already read the row and waits on the sweep's row lock) behaves like
// no row: the message is new. If the sweep rolls back instead, the expired row is taken
// over: new as well. The sweep's DELETE is held open in a transaction of its own, so the
// interleaving is deterministic.
func TestInboxExpiredRowSweptMidStatement(t *testing.T) {
	t.Parallel()
	for _, sweepCommits := range []bool{true, false} {
		name := map[bool]string{true: "SweepCommits", false: "SweepRollsBack"}[sweepCommits]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.insertExpiredInbox(t, "billing", "m-1")

			sweep := b.begin(t)
			_, err := sweep.Exec(b.ctx, `DELETE FROM pgidem_inbox WHERE expires_at <= now()`)
			require.NoError(t, err)

			type outcome struct {
				isNew, live bool
				err         error
			}
			done := make(chan outcome, 1)
			go func() {
				var out outcome
				defer func() { done <- out }()
				tx, err := b.db.Pool.Begin(b.ctx)
				if out.err = err; err != nil {
					return
				}
				defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
				if out.isNew, out.err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-1", nil); out.err != nil {
					return
				}
				out.err = tx.QueryRow(b.ctx, `SELECT expires_at > now() FROM pgidem_inbox
					WHERE consumer = 'billing' AND message_id = 'm-1'`).Scan(&out.live)
			}()
			b.waitForBlocked(t, "transactionid", 1) // the record statement waits for the sweep
			if sweepCommits {
				require.NoError(t, sweep.Commit(b.ctx))
			} else {
				require.NoError(t, sweep.Rollback(b.ctx))
			}
			out := <-done
			require.NoError(t, out.err)
			require.True(t, out.isNew, "the message's row had expired: it is new, its handler must run")
			require.True(t, out.live, "the message is recorded afresh")
		})
	}
}

// Recording a duplicate of a live message is a pure read: no row lock, no transaction id
// (so no WAL flush at commit). Recording a new or expired one writes.
func TestInboxDuplicateIsPureRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ('billing', 'live', now(), now() + interval '1 day'),
		       ('billing', 'expired', now() - interval '8 days', now() - interval '1 day')`)
	require.NoError(t, err)

	tests := []struct {
		messageID string
		wantNew   bool
	}{
		{"live", false},
		{"expired", true},
		{"absent", true},
	}
	for _, tt := range tests {
		tx := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", tt.messageID, nil)
		require.NoError(t, err)
		require.Equal(t, tt.wantNew, isNew, tt.messageID)
		var xid *int64
		require.NoError(t, tx.QueryRow(b.ctx, `SELECT txid_current_if_assigned()`).Scan(&xid))
		require.Equal(t, tt.wantNew, xid != nil, "%s: a transaction id is assigned only by a write", tt.messageID)
		require.NoError(t, tx.Rollback(b.ctx))
	}
}

// Payloads json.Valid accepts but jsonb rejects are refused with ErrInvalidPayload before
// the transaction is touched (not a store error that aborts it); payloads at jsonb's edges
// are stored.
func TestInboxPayloadJSONBRules(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	rejected := []struct {
		name    string
		payload string
	}{
		{"NotJSON", `{`},
		{"NulEscape", `{"note":"a\u0000b"}`},
		{"NulEscapeInKey", `{"\u0000":1}`},
		{"InvalidUTF8", "{\"note\":\"\xff\"}"},
		{"LoneHighSurrogate", `["\ud800"]`},
		{"HighSurrogateThenText", `["\ud800x"]`},
		{"HighSurrogateThenHigh", `["\uD800\uD800"]`},
		{"LoneLowSurrogate", `["\udc00"]`},
		{"IntegerTooLong", `1e131072`},
		{"IntegerTooLongMantissa", `10e131071`},
		{"TooManyDecimals", `1e-16384`},
		{"TooManyDecimalsMantissa", `1.5e-16383`},
		{"ZeroTooManyDecimals", `[0.0e-16383]`},
		{"ExponentOverflow", `{"n":0e1073741823}`},
		{"ExponentBeyondInt64", `-1e-99999999999999999999999`},
	}
	for _, tt := range rejected {
		t.Run("Rejects"+tt.name, func(t *testing.T) {
			t.Parallel()
			tx := b.begin(t)
			_, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-"+tt.name, &pgidem.InboxOpts{Payload: []byte(tt.payload)})
			require.ErrorIs(t, err, pgidem.ErrInvalidPayload)
			assert.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, "bad input is not a store outage")
			requireUsable(t, b.ctx, tx)
		})
	}

	accepted := []struct {
		name    string
		payload string
	}{
		{"EscapedBackslashThenU0000", `{"note":"\\u0000"}`},
		{"SurrogatePair", `["\ud83d\ude00"]`},
		{"ReplacementCharacterEscape", `["\ufffd"]`},
		{"RawUnicode", `{"note":"čaj 🍵"}`},
		{"LargestInteger", `1e131071`},
		{"LargestIntegerSmallMantissa", `0.001e131074`},
		{"MostDecimals", `1.5e-16382`},
		{"ZeroWithHugeExponent", `0e1073741822`},
		{"NegativeZeroScaledBack", `-0.000e16383`},
		{"Mixed", `{"a":[1,-2.5e3,true,false,null,"e\"1e999999"],"b":{}}`},
	}
	for _, tt := range accepted {
		t.Run("Accepts"+tt.name, func(t *testing.T) {
			t.Parallel()
			tx := b.begin(t)
			isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-"+tt.name, &pgidem.InboxOpts{Payload: []byte(tt.payload)})
			require.NoError(t, err)
			require.True(t, isNew)
			requireUsable(t, b.ctx, tx)
		})
	}
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

// Two transactions that take two keys in opposite order: Postgres reports the deadlock to
// one of them (40P01, as a *StoreError) and the other commits. DoTx used to wait for the
// lock in slices no longer than deadlock_timeout, so the server never looked for the
// cycle, and both waited out their whole WaitTimeout and failed with ErrInProgress.
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

// ---------------------------------------------------------------------------------------
// Confirmed behaviour.
// ---------------------------------------------------------------------------------------

// A contended DoTx waits for the lock holder and replays, whatever the caller's session
// timeouts: it sets lock_timeout for the wait and lifts statement_timeout (a shorter one
// used to cancel the wait, reported as a store outage), then puts both back.
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

	res, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, reviewRaise(),
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
	first, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", testTTL, reviewRaise(), ledgerInsert("r", &runs))
	require.NoError(t, err)
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, reviewRaise(), ledgerInsert("r", &runs))
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, first, res.Value)
	require.EqualValues(t, 1, runs.Load())
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, 1, b.ledgerRows(t, "r"))
}

// Two transactions reusing one expired inbox row: the second blocks on the first's
// takeover and then skips (first commits) or takes over itself (first rolls back).
func TestInboxExpiredRowConcurrentTakeover(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		name := map[bool]string{true: "FirstCommits", false: "FirstRollsBack"}[commit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.insertExpiredInbox(t, "billing", "m")

			first := b.begin(t)
			isNew, err := b.coord.InboxRecordTx(b.ctx, first, "billing", "m", nil)
			require.NoError(t, err)
			require.True(t, isNew)

			done := make(chan error, 1)
			var secondNew atomic.Bool
			go func() {
				tx, err := b.db.Pool.Begin(b.ctx)
				if err != nil {
					done <- err
					return
				}
				defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
				isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m", nil)
				secondNew.Store(isNew)
				done <- err
			}()
			b.waitForBlocked(t, "transactionid", 1)
			if commit {
				require.NoError(t, first.Commit(b.ctx))
			} else {
				require.NoError(t, first.Rollback(b.ctx))
			}
			require.NoError(t, <-done)
			require.Equal(t, !commit, secondNew.Load())
		})
	}
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
// the next call runs fn again. It used to be reported (and logged) as ErrStoreUnavailable.
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
// transaction aborted. DoTx, DoInTx and InboxHandle say so, and that it is fn's mistake:
// they used to return a store error (logged at error and counted, as for an outage) for
// the refused record write or the commit that rolled back. Nothing of fn's is committed,
// and the next delivery runs fn again.
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
// ErrInvalidArgument, neither logged nor counted as a store error (it used to be one, for
// op "lock"), and fn does not run.
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
