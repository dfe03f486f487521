package pgidem_test

import (
	"context"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestWaiterCancelledChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.hold(b.coord, "mail", "k", nil, "holder")
	before := b.lookup(t, "mail", "k")

	ctx, cancel := context.WithCancel(b.ctx)
	waitErr := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
			return "waiter", nil
		})
		waitErr <- err
	}()
	time.Sleep(50 * time.Millisecond) // let the waiter poll at least once
	cancel()
	require.ErrorIs(t, <-waitErr, context.Canceled)

	// A rejected (Raise) caller and a waiter that timed out never touch the holder's row.
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
		func(context.Context) (string, error) { return "raise", nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{WaitTimeout: 30 * time.Millisecond},
		func(context.Context) (string, error) { return "timeout", nil })
	var ipe *pgidem.InProgressError
	require.ErrorAs(t, err, &ipe)
	require.True(t, ipe.Waited)

	after := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusInProgress, after.Status)
	require.Equal(t, before.Attempts, after.Attempts)
	require.Equal(t, before.CreatedAt, after.CreatedAt)

	h.unblock()
	require.NoError(t, <-h.done)
	rec := b.lookup(t, "mail", "k")
	require.JSONEq(t, `"holder"`, string(rec.Result))
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
	waiting := make(chan struct{})
	var once sync.Once
	other := b.newCoordOn(t, b.newPool(t, nil), &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventWaited {
			once.Do(func() { close(waiting) })
		}
	})})
	go func() {
		res, err := pgidem.DoResult(b.ctx, other, "mail", "k", testTTL, nil, func(context.Context) (string, error) { return "waiter", nil })
		waiter <- res
		waiterErr <- err
	}()
	<-waiting // the waiter found the holder's record and waits
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

// queryCounter counts the statements a pool sends.
type queryCounter struct{ n atomic.Int64 }

func (c *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// Poll intervals are bounded: intervals so large that the backoff arithmetic would overflow
// are refused by NewCoordinator, and a waiter at the largest accepted interval waits
// instead of polling in a hot loop.
func TestPollIntervalBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// Huge intervals overflowed the backoff arithmetic into a hot loop; they are refused.
	_, err := pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{
		PollIntervalMin: time.Duration(math.MaxInt64),
		PollIntervalMax: time.Duration(math.MaxInt64),
	})
	require.ErrorContains(t, err, "Config.PollIntervalMax")
	// The largest accepted interval still waits rather than spins.
	insertRecord(t, b, "k", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", nil)
	var counter queryCounter
	pool := b.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &counter })
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{
		PollIntervalMin: pgidem.PollIntervalMaxMax,
		PollIntervalMax: pgidem.PollIntervalMaxMax,
		WaitTimeout:     500 * time.Millisecond,
	})
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	// The first read of a record in progress is two statements, and the waiter's listener
	// (a connection with the pool's settings, so the same tracer) sends its LISTEN and
	// lock: a hot loop would send thousands.
	require.Less(t, counter.n.Load(), int64(10), "the waiter sent %d statements", counter.n.Load())
}
