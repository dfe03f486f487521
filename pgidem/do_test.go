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

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestDoBasic(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context) (string, error) {
		ns, key, ok := pgidem.KeyFromContext(ctx)
		if !ok {
			return "", errors.New("no key in context")
		}
		return fmt.Sprintf("%s/%s#%d", ns, key, runs.Add(1)), nil
	}
	first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.False(t, first.Replayed)
	require.Equal(t, 1, first.Attempts)
	require.Equal(t, "mail/order-9.invoice#1", first.Value)

	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, second.Replayed)
	require.Equal(t, first.Value, second.Value)
	require.EqualValues(t, 1, runs.Load())

	rec := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"mail/order-9.invoice#1"`, string(rec.Result))
	require.WithinDuration(t, rec.CompletedAt.Add(testTTL), rec.ExpiresAt, time.Second, "TTL counts from completion")

	_, err = b.coord.Lookup(b.ctx, "mail", "nope")
	require.ErrorIs(t, err, pgidem.ErrNotFound)

	_, _, ok := pgidem.KeyFromContext(b.ctx)
	require.False(t, ok)
}

func TestConcurrentCallers(t *testing.T) {
	t.Parallel()
	const callers = 32

	t.Run("Wait", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range callers {
			wg.Go(func() {
				<-start
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
					n := runs.Add(1)
					time.Sleep(50 * time.Millisecond) // keep the others in flight
					return fmt.Sprintf("em_%d", n), nil
				})
			})
		}
		close(start)
		wg.Wait()
		require.EqualValues(t, 1, runs.Load(), "fn ran once")
		for i := range callers {
			require.NoError(t, errs[i])
			require.Equal(t, "em_1", values[i], "caller %d", i)
		}
	})

	t.Run("Raise", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &pgidem.Config{InFlight: pgidem.InFlightRaise})
		var runs, answered atomic.Int32
		release := make(chan struct{})
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range callers {
			wg.Go(func() {
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
					runs.Add(1)
					<-release // hold the key until every other caller has answered
					return "em_1", nil
				})
				if errs[i] != nil && answered.Add(1) == callers-1 {
					close(release)
				}
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, runs.Load())
		var ok, inProgress int
		for i := range callers {
			if errs[i] == nil {
				ok++
				require.Equal(t, "em_1", values[i])
				continue
			}
			var ipe *pgidem.InProgressError
			require.ErrorAs(t, errs[i], &ipe)
			require.ErrorIs(t, errs[i], pgidem.ErrInProgress)
			require.Positive(t, ipe.RetryAfter)
			inProgress++
		}
		require.Equal(t, 1, ok)
		require.Equal(t, callers-1, inProgress)
	})

	t.Run("ManyKeys", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		const keys = 16
		var runs [keys]atomic.Int32
		var wg sync.WaitGroup
		errs := make(chan error, keys*4)
		for i := range keys * 4 {
			wg.Go(func() {
				k := i % keys
				v, err := pgidem.Do(b.ctx, b.coord, "mail", fmt.Sprintf("order-%d.invoice", k), testTTL, nil,
					func(context.Context) (int, error) {
						runs[k].Add(1)
						time.Sleep(20 * time.Millisecond)
						return k, nil
					})
				if err == nil && v != k {
					err = fmt.Errorf("key %d got value %d", k, v)
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		for k := range keys {
			require.EqualValues(t, 1, runs[k].Load(), "key %d", k)
		}
		require.Equal(t, keys, b.count(t))
	})
}

func TestNilArguments(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do[int](b.ctx, b.coord, "mail", "k", testTTL, nil, nil)
	require.ErrorContains(t, err, "must not be nil")
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidem.Do(b.ctx, nil, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorContains(t, err, "must not be nil")
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	for _, opts := range []*pgidem.DoOpts{{WaitTimeout: -1}, {InFlight: 9}} {
		_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, opts, func(context.Context) (int, error) { panic("not run") })
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	}
	_, err = b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: -1})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.Equal(t, 0, b.count(t))
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
