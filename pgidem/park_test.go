package pgidem_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// eventCounts records the events a coordinator reports, by kind.
type eventCounts struct {
	mu     sync.Mutex
	counts map[pgidem.EventKind]int
}

func (e *eventCounts) hook() pgidem.Hook {
	return pgidem.HookFunc(func(_ context.Context, ev pgidem.Event) {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.counts == nil {
			e.counts = map[pgidem.EventKind]int{}
		}
		e.counts[ev.Kind]++
	})
}

func (e *eventCounts) get(kind pgidem.EventKind) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.counts[kind]
}

// insertDeadAt inserts an in-progress record of (namespace, key) with attempts, as a
// holder that died (stopped renewing, never released) leaves it: its lease ran out a
// second ago, its last renewal was a while before.
func (b *testBundle) insertDeadAt(t *testing.T, namespace, key string, attempts int) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at, updated_at)
		VALUES ($1, $2, 'in_progress', gen_random_uuid(), $3, now() - interval '1 second', now() + interval '1 hour', now() - interval '1 minute')`,
		namespace, key, attempts)
	require.NoError(t, err)
}

// requireParked checks that err is the typed error of a parked (namespace, key).
func requireParked(t *testing.T, err error, namespace, key string, attempts int) {
	t.Helper()
	require.ErrorIs(t, err, pgidem.ErrParked)
	var parked *pgidem.ParkedError
	require.ErrorAs(t, err, &parked)
	require.Equal(t, pgidem.ParkedError{Namespace: namespace, Key: key, Attempts: attempts}, *parked)
}

// A record whose holder died at the cap is parked instead of taken over: fn does not run,
// the call and every later one get the typed error, and Forget releases the key so the
// next call runs fn afresh.
func TestDoParksADeadHolderAtTheCap(t *testing.T) {
	t.Parallel()
	var events eventCounts
	b := setup(t, &pgidem.Config{MaxAttempts: 3, Hook: events.hook()})
	b.insertDeadAt(t, "mail", "order-9", 3)
	before := b.lookup(t, "mail", "order-9")
	owner := func() string {
		var o string
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT owner::text FROM pgidem_record WHERE key = 'order-9'`).Scan(&o))
		return o
	}
	deadOwner := owner()
	runs := 0
	fn := func(context.Context) (string, error) { runs++; return "sent", nil }

	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9", testTTL, nil, fn)
	requireParked(t, err, "mail", "order-9", 3)
	require.Zero(t, runs)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.True(t, res.Replayed)
	require.Equal(t, 3, res.Attempts)
	require.False(t, res.TookOver)
	require.Equal(t, 1, events.get(pgidem.EventParked))
	require.Zero(t, events.get(pgidem.EventTakenOver))
	require.Zero(t, events.get(pgidem.EventExecuted))

	rec := b.lookup(t, "mail", "order-9")
	require.Equal(t, pgidem.StatusParked, rec.Status)
	require.Equal(t, 3, rec.Attempts)
	require.True(t, rec.LeaseExpiresAt.IsZero())
	require.Equal(t, before.ExpiresAt, rec.ExpiresAt, "a parked record expires when its holder's record would have")
	require.Equal(t, deadOwner, owner(), "the dead holder's record, not a new reservation")
	var failure struct{ Message string }
	require.NoError(t, json.Unmarshal(rec.Error, &failure))
	require.Contains(t, failure.Message, "parked after 3 attempts")

	// Later calls replay the error, also under a higher cap: the record is parked.
	for _, opts := range []*pgidem.DoOpts{nil, {MaxAttempts: 10}, {InFlight: pgidem.InFlightRaise}} {
		res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "order-9", testTTL, opts, fn)
		requireParked(t, err, "mail", "order-9", 3)
		require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	}
	require.Zero(t, runs)
	require.Equal(t, 1, events.get(pgidem.EventParked), "only the call that parked it reports EventParked")
	require.Equal(t, 3, events.get(pgidem.EventReplayed))

	// An operator forgets it: the next call runs fn under a fresh reservation.
	forgotten, err := b.coord.Forget(b.ctx, "mail", "order-9", nil)
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusParked, forgotten.Status)
	res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "order-9", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, "sent", res.Value)
	require.Equal(t, pgidem.OutcomeExecuted, res.Outcome)
	require.Equal(t, 1, res.Attempts)
	require.Equal(t, 1, runs)
}

// Below the cap a dead holder is taken over as ever. A holder that returns an error
// releases the key: a retry, not a death, so a released record at the cap is run again,
// not parked.
func TestDoTakesOverBelowTheCapAndRetriesAReleasedRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MaxAttempts: 3})
	b.insertDeadAt(t, "mail", "order-9", 2)

	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9", testTTL, nil, func(context.Context) (string, error) {
		return "", errors.New("smtp down")
	})
	require.EqualError(t, err, "smtp down")
	require.Equal(t, pgidem.OutcomeTakenOver, res.Outcome)
	require.Equal(t, 3, res.Attempts)
	rec := b.lookup(t, "mail", "order-9")
	require.Equal(t, pgidem.StatusInProgress, rec.Status, "released, kept with its attempts")
	require.Equal(t, 3, rec.Attempts)

	res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "order-9", testTTL, nil, func(context.Context) (string, error) {
		return "sent", nil
	})
	require.NoError(t, err)
	require.Equal(t, "sent", res.Value)
	require.Equal(t, pgidem.OutcomeExecuted, res.Outcome)
	require.Equal(t, 3, res.Attempts)
	require.Equal(t, pgidem.StatusCompleted, b.lookup(t, "mail", "order-9").Status)
}

// DoOpts.MaxAttempts overrides the coordinator's cap for one call, lower or higher; 0
// (the default) means the coordinator's, and a coordinator without a cap never parks.
func TestDoMaxAttemptsOverride(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	capped := b.newCoord(t, &pgidem.Config{MaxAttempts: 2})
	ran := func(context.Context) (int, error) { return 1, nil }

	b.insertDeadAt(t, "ns", "no-cap", 100)
	res, err := pgidem.DoResult(b.ctx, b.coord, "ns", "no-cap", testTTL, nil, ran)
	require.NoError(t, err, "no cap: a dead holder is always taken over")
	require.Equal(t, pgidem.OutcomeTakenOver, res.Outcome)
	require.Equal(t, 101, res.Attempts)

	b.insertDeadAt(t, "ns", "lower", 2)
	_, err = pgidem.DoResult(b.ctx, b.coord, "ns", "lower", testTTL, &pgidem.DoOpts{MaxAttempts: 2}, ran)
	requireParked(t, err, "ns", "lower", 2)

	b.insertDeadAt(t, "ns", "higher", 2)
	res, err = pgidem.DoResult(b.ctx, capped, "ns", "higher", testTTL, &pgidem.DoOpts{MaxAttempts: 3}, ran)
	require.NoError(t, err)
	require.Equal(t, pgidem.OutcomeTakenOver, res.Outcome)
	require.Equal(t, 3, res.Attempts)

	b.insertDeadAt(t, "ns", "config", 2)
	_, err = pgidem.DoResult(b.ctx, capped, "ns", "config", testTTL, &pgidem.DoOpts{}, ran)
	requireParked(t, err, "ns", "config", 2)

	res, err = pgidem.DoResult(b.ctx, capped, "ns", "negative", testTTL, &pgidem.DoOpts{MaxAttempts: -1}, ran)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorContains(t, err, "DoOpts.MaxAttempts")
	require.Equal(t, pgidem.OutcomeInvalid, res.Outcome)
	_, err = pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{MaxAttempts: -1})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorContains(t, err, "Config.MaxAttempts")
}

// Many callers find the same dead holder at the cap: exactly one parks it, every caller
// gets the typed error, and fn never runs.
func TestDoParksOnceUnderConcurrency(t *testing.T) {
	t.Parallel()
	var events eventCounts
	b := setup(t, &pgidem.Config{MaxAttempts: 2, Hook: events.hook()})
	b.insertDeadAt(t, "ns", "k", 2)
	const callers = 16
	errs := make(chan error, callers)
	var runs sync.WaitGroup
	ranFn := make(chan struct{}, callers)
	for range callers {
		runs.Add(1)
		go func() {
			defer runs.Done()
			_, err := pgidem.Do(b.ctx, b.coord, "ns", "k", testTTL, nil, func(context.Context) (int, error) {
				ranFn <- struct{}{}
				return 1, nil
			})
			errs <- err
		}()
	}
	runs.Wait()
	close(errs)
	for err := range errs {
		requireParked(t, err, "ns", "k", 2)
	}
	require.Empty(t, ranFn)
	require.Equal(t, 1, events.get(pgidem.EventParked))
	require.Equal(t, callers-1, events.get(pgidem.EventReplayed))
}

// DoTx finding a dead Do holder at the cap parks the record in its transaction instead
// of taking it over; committed, the park stands and later calls replay the same error.
// DoInTx commits the park itself. A DoTx rolled back leaves the record for the next call,
// which parks it again.
func TestDoTxParksADeadHolderAtTheCap(t *testing.T) {
	t.Parallel()
	var events eventCounts
	b := setup(t, &pgidem.Config{MaxAttempts: 2, Hook: events.hook()})
	runs := 0
	fn := func(context.Context, pgx.Tx) (int, error) { runs++; return 1, nil }
	doTx := func(key string, commit bool) (pgidem.Result[int], error) {
		t.Helper()
		tx, err := b.db.Pool.Begin(b.ctx)
		require.NoError(t, err)
		defer tx.Rollback(b.ctx) //nolint:errcheck
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ns", key, testTTL, nil, fn)
		if commit {
			require.NoError(t, tx.Commit(b.ctx))
		}
		return res, err
	}

	b.insertDeadAt(t, "ns", "tx", 2)
	res, err := doTx("tx", false)
	requireParked(t, err, "ns", "tx", 2)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.Equal(t, pgidem.StatusInProgress, b.lookup(t, "ns", "tx").Status, "rolled back with the transaction")
	res, err = doTx("tx", true)
	requireParked(t, err, "ns", "tx", 2)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.Equal(t, pgidem.StatusParked, b.lookup(t, "ns", "tx").Status)
	require.Equal(t, 2, events.get(pgidem.EventParked))
	res, err = doTx("tx", false)
	requireParked(t, err, "ns", "tx", 2)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.True(t, res.Replayed)
	require.Equal(t, 2, events.get(pgidem.EventParked), "a parked record is replayed, not parked again")

	b.insertDeadAt(t, "ns", "intx", 2)
	res, err = pgidem.DoInTxResult(b.ctx, b.coord, "ns", "intx", testTTL, nil, fn)
	requireParked(t, err, "ns", "intx", 2)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.Equal(t, pgidem.StatusParked, b.lookup(t, "ns", "intx").Status, "DoInTx commits the park")
	require.Zero(t, runs)

	// Below the cap DoTx takes the dead holder over as ever.
	b.insertDeadAt(t, "ns", "below", 1)
	res, err = pgidem.DoInTxResult(b.ctx, b.coord, "ns", "below", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, pgidem.OutcomeTakenOver, res.Outcome)
	require.Equal(t, 2, res.Attempts)
	require.Equal(t, 1, runs)
}

// Await returns the typed error for a parked record; it never parks one itself.
func TestAwaitParked(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{MaxAttempts: 2})
	b.insertDeadAt(t, "ns", "k", 2)
	_, err := pgidem.Await[int](b.ctx, b.coord, "ns", "k", nil)
	require.ErrorIs(t, err, pgidem.ErrNotFound, "a dead holder has no outcome to wait for")
	require.Equal(t, pgidem.StatusInProgress, b.lookup(t, "ns", "k").Status, "Await never writes")

	_, err = pgidem.Do(b.ctx, b.coord, "ns", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	requireParked(t, err, "ns", "k", 2)
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute)
	defer cancel()
	res, err := pgidem.Await[int](ctx, b.coord, "ns", "k", nil)
	requireParked(t, err, "ns", "k", 2)
	require.Equal(t, pgidem.OutcomeParked, res.Outcome)
	require.True(t, res.Replayed)
}
