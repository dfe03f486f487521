package pgidem_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Tests of the protocol's invariants and failure policy that an audit found proven only
// weakly: code changed to break each rule (the owner check of a release, the detached
// context of a finishing write, the fingerprint kept by DoTx's upsert) still passed the
// rest of the suite.

// rawRecord is the raw state of a record, read with SQL (owner included).
type rawRecord struct {
	Owner, Status, Err string
	Attempts           int
	Fingerprint        []byte
}

func (b *testBundle) readRaw(t *testing.T, ns, key string) rawRecord {
	t.Helper()
	var r rawRecord
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT owner::text, status, coalesce(error::text, ''), attempts, fingerprint
		FROM pgidem_record WHERE namespace = $1 AND key = $2`, ns, key).Scan(&r.Owner, &r.Status, &r.Err, &r.Attempts, &r.Fingerprint))
	return r
}

// insertDeadHolder writes a dead holder's in-progress row (lease expired, record live).
func (b *testBundle) insertDeadHolder(t *testing.T, ns, key string, fingerprint []byte) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, fingerprint, lease_expires_at, expires_at)
		VALUES ($1, $2, 'in_progress', gen_random_uuid(), 1, $3, now() - interval '1 second', now() + interval '1 hour')`,
		ns, key, fingerprint)
	require.NoError(t, err)
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
	const lease = 300 * time.Millisecond
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

// A stored fingerprint survives every later write of the row: heartbeat, completion,
// stored failure, non-storable result, a takeover and the kept release that follows it,
// DoTx's upsert over a released or lease-expired row. Every later call here passes no
// fingerprint, which must never clear the stored one.
func TestFingerprintSurvivesEveryWrite(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})
	fp := []byte("payload-A")
	withFP := &pgidem.DoOpts{Fingerprint: fp}
	requireFP := func(key, after string) {
		t.Helper()
		require.Equal(t, fp, b.readRaw(t, "ns", key).Fingerprint, "fingerprint lost after %s", after)
	}

	_, err := pgidem.Do(b.ctx, b.coord, "ns", "hb", testTTL, withFP, func(context.Context) (int, error) {
		time.Sleep(2 * lease) // several heartbeats
		return 1, nil
	})
	require.NoError(t, err)
	requireFP("hb", "heartbeats and completion")

	_, err = pgidem.Do(b.ctx, b.coord, "ns", "perm", testTTL, withFP, func(context.Context) (int, error) {
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	requireFP("perm", "a stored failure")

	_, err = pgidem.Do(b.ctx, b.coord, "ns", "nul", testTTL, withFP, func(context.Context) (string, error) { return "a\x00b", nil })
	require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
	requireFP("nul", "a non-storable result")

	// A dead holder; a takeover by a caller without fingerprint whose fn fails (a kept
	// release); then DoTx without fingerprint completes the released row.
	b.insertDeadHolder(t, "ns", "chain", fp)
	_, err = pgidem.Do(b.ctx, b.coord, "ns", "chain", testTTL, nil, func(context.Context) (int, error) {
		return 0, errors.New("transient")
	})
	require.Error(t, err)
	require.Equal(t, 2, b.readRaw(t, "ns", "chain").Attempts)
	requireFP("chain", "a takeover and its kept release")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "chain", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 3, nil })
	require.NoError(t, err)
	requireFP("chain", "DoTx over a released row")

	b.insertDeadHolder(t, "ns", "dotx-lease", fp)
	res, err := pgidem.DoInTx(b.ctx, b.coord, "ns", "dotx-lease", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 4, nil })
	require.NoError(t, err)
	require.Equal(t, 4, res)
	requireFP("dotx-lease", "DoTx taking over a dead holder")

	b.insertDeadHolder(t, "ns", "dotx-perm", fp)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "dotx-perm", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	requireFP("dotx-perm", "a DoTx stored failure over a dead holder's row")

	for _, key := range []string{"hb", "perm", "nul", "chain", "dotx-lease", "dotx-perm"} {
		_, err := pgidem.Do(b.ctx, b.coord, "ns", key, testTTL, &pgidem.DoOpts{Fingerprint: []byte("B")},
			func(context.Context) (int, error) { panic("must not run") })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, key)
	}
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

// A waiter whose holder releases (fn error) reserves again and runs its own fn; it reports
// that it waited, and the record's attempts stay 1.
func TestWaiterReservesAgainAfterRelease(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	holding, release := make(chan struct{}), make(chan struct{})
	holderErr := make(chan error, 1)
	transient := errors.New("transient")
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
			close(holding)
			<-release
			return "", transient
		})
		holderErr <- err
	}()
	<-holding
	waiter := make(chan pgidem.Result[string], 1)
	waiterErr := make(chan error, 1)
	other := b.newCoordOn(t, b.newPool(t, nil), nil)
	go func() {
		res, err := pgidem.DoResult(b.ctx, other, "mail", "k", testTTL, nil, func(context.Context) (string, error) { return "waiter", nil })
		waiter <- res
		waiterErr <- err
	}()
	time.Sleep(100 * time.Millisecond) // the waiter polls
	close(release)
	require.ErrorIs(t, <-holderErr, transient)
	res := <-waiter
	require.NoError(t, <-waiterErr)
	require.Equal(t, "waiter", res.Value)
	require.False(t, res.Replayed)
	require.True(t, res.Waited)
	require.Equal(t, 1, res.Attempts)
	require.JSONEq(t, `"waiter"`, string(b.lookup(t, "mail", "k").Result))
}

// The failure policy's "store fails after fn succeeded": the value comes back with a store
// error, logged at error and counted; the record stays in progress, and once its lease
// has expired a later call takes it over.
func TestStoreFailsAfterFnSucceeded(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 64} {
		t.Run(fmt.Sprint("MaxBatch", maxBatch), func(t *testing.T) {
			t.Parallel()
			const lease = 600 * time.Millisecond
			b := setup(t, nil)
			var down atomic.Bool
			pool := b.downablePool(t, &down, nil)
			var logs bytes.Buffer
			var mu sync.Mutex
			var storeErrors atomic.Int32
			coord := b.newCoordOn(t, pool, &pgidem.Config{Lease: lease, MaxBatch: maxBatch,
				Logger: slog.New(slog.NewTextHandler(&syncWriter{w: &logs, mu: &mu}, nil)),
				Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
					if e.Kind == pgidem.EventStoreError {
						storeErrors.Add(1)
					}
				})})
			v, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
				down.Store(true)
				pool.Reset()
				return "sent", nil
			})
			require.Equal(t, "sent", v, "the value comes back")
			require.Error(t, err)
			require.True(t, errors.Is(err, pgidem.ErrStoreUnavailable) || errors.Is(err, pgidem.ErrLeaseLost), "err=%v", err)
			mu.Lock()
			require.Contains(t, logs.String(), "level=ERROR")
			mu.Unlock()
			require.Positive(t, storeErrors.Load())

			rec := b.lookup(t, "mail", "k")
			require.Equal(t, pgidem.StatusInProgress, rec.Status, "nothing stored, nothing released")
			down.Store(false)
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) { return "again", nil })
			require.NoError(t, err)
			require.True(t, res.TookOver)
			require.Equal(t, 2, res.Attempts)
		})
	}
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

// The failure policy's "caller context cancelled while fn runs: fn sees it; the finishing
// write still happens", for every finishing write (complete, stored failure, release),
// with batching off and on.
func TestCancelledCallerStillFinishesEveryWrite(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 64} {
		for _, mode := range []string{"Success", "Permanent", "Error"} {
			t.Run(fmt.Sprintf("MaxBatch%d/%s", maxBatch, mode), func(t *testing.T) {
				t.Parallel()
				b := setup(t, &pgidem.Config{MaxBatch: maxBatch})
				ctx, cancel := context.WithCancel(b.ctx)
				_, err := pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
					cancel()
					<-ctx.Done() // fn sees the cancellation
					switch mode {
					case "Permanent":
						return "", pgidem.Permanent(errors.New("declined"))
					case "Error":
						return "", errors.New("transient")
					}
					return "sent", nil
				})
				switch mode {
				case "Success":
					require.NoError(t, err)
					require.Equal(t, pgidem.StatusCompleted, b.lookup(t, "mail", "k").Status)
				case "Permanent":
					require.ErrorIs(t, err, pgidem.ErrPermanent)
					require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, "the failure was stored")
					require.Equal(t, pgidem.StatusFailed, b.lookup(t, "mail", "k").Status)
				case "Error":
					require.EqualError(t, err, "transient")
					_, err := b.coord.Lookup(b.ctx, "mail", "k")
					require.ErrorIs(t, err, pgidem.ErrNotFound, "released although the caller was cancelled")
				}
			})
		}
	}
}

// A holder whose result's MarshalJSON panics after its reservation was deleted (or taken
// over) under it reports the lost lease before the panic continues, as a holder whose fn
// panics does.
func TestMarshalPanicAfterLeaseLostIsReported(t *testing.T) {
	t.Parallel()
	var lost atomic.Int64
	b := setup(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			lost.Add(e.Count)
		}
	})})
	require.PanicsWithValue(t, "MarshalJSON boom", func() {
		_, _ = pgidem.Do(b.ctx, b.coord, "pay", "k", testTTL, nil, func(ctx context.Context) (reviewMarshal, error) {
			_, err := b.db.Pool.Exec(ctx, `DELETE FROM pgidem_record`) // an operator's forced forget
			require.NoError(t, err)
			return reviewMarshal{Panic: true}, nil
		})
	})
	require.Equal(t, int64(1), lost.Load())
}
