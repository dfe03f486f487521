package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// lostReplyPool returns a pool on the bundle's database whose first statement containing
// marker loses its reply. Statements are sent with their text each time (no statement
// cache) and without TLS, so the marker can be seen on the wire.
func (b *testBundle) lostReplyPool(t *testing.T, marker string) (*pgxpool.Pool, *lostReplyDialer) {
	t.Helper()
	d := &lostReplyDialer{marker: []byte(marker)}
	return b.dialerPool(t, d, nil), d
}

// A release whose reply is lost after it committed is retried; the retry finds the first
// reservation already deleted, which is the release having worked, not a lost lease.
func TestReleaseLostReply(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool, d := b.lostReplyPool(t, "WITH deleted AS")
	var leaseLost atomic.Int32
	coord := b.newCoordOn(t, pool, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			leaseLost.Add(1)
		}
	})})
	transient := errors.New("transient")
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 0, transient })
	require.ErrorIs(t, err, transient)
	require.True(t, d.fired.Load(), "the release's reply was lost")
	_, err = b.coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	require.Zero(t, leaseLost.Load(), "no lease was lost")
}

// The same for a release that keeps a taken-over reservation: repeating it leaves the row
// and its attempts as they were, so the takeover stays on record.
func TestKeptReleaseLostReply(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool, d := b.lostReplyPool(t, "WITH deleted AS")
	coord := b.newCoordOn(t, pool, nil)
	insertRecord(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
	transient := errors.New("transient")
	res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 0, transient })
	require.ErrorIs(t, err, transient)
	require.True(t, res.TookOver)
	require.True(t, d.fired.Load(), "the release's reply was lost")
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, 2, rec.Attempts)
	res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, raiseOpts(), func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, 2, res.Attempts)
}

// A release retried after an attempt that never reached the server (it could not connect)
// and that then finds no row reports the lost lease: nothing of ours was written, so the
// row is gone because another caller took the key over. Only an attempt that may have
// committed excuses a missing row.
func TestReleaseRetryAfterConnectFailureReportsTakeover(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, nil)
	var offline atomic.Bool
	pool := b.downablePool(t, &offline, nil)
	var leaseLost atomic.Int32
	coord := b.newCoordOn(t, pool, &pgidem.Config{Lease: lease, Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			leaseLost.Add(1)
		}
	})})
	var taker *holder
	transient := errors.New("transient")
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
		offline.Store(true)
		pool.Reset()                                       // the holder's connections are gone; its heartbeat cannot reach the server
		<-ctx.Done()                                       // cancelled with ErrLeaseLost once a whole lease passed without renewal
		taker = b.hold(b.coord, "mail", "k", nil, "taker") // takes the expired lease over
		time.AfterFunc(20*time.Millisecond, func() { offline.Store(false) })
		return 0, transient
	})
	require.ErrorIs(t, err, transient)
	require.EqualValues(t, 1, leaseLost.Load(), "the release found the key taken over")
	taker.unblock()
	require.NoError(t, <-taker.done)
	require.Equal(t, 2, b.lookup(t, "mail", "k").Attempts)
}

// A reserving write whose reply is lost after it committed is not abandoned: the call finds
// its own owner token on the row and holds the reservation it made, so fn runs once and a
// takeover is reported only when there was one. Without the recovery the call failed with
// a store error and left a reservation that the next caller took over after a lease
// (attempts 2). The insert alone, in a shared round (the marker is in both forms), and the
// takeover of an expired lease (the takeover judged from the read before the write).
func TestReserveLostReply(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, marker string
		opts         *pgidem.DoOpts
		expiredLease bool
		tookOver     bool
		attempts     int
	}{
		{"InsertAlone", "WITH ins AS", &pgidem.DoOpts{ReserveFirst: true}, false, false, 1},
		{"InsertAfterRead", "WITH ins AS", nil, false, false, 1},
		{"Takeover", "AS took_over", nil, true, true, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			pool, d := b.lostReplyPool(t, tc.marker)
			coord := b.newCoordOn(t, pool, nil)
			if tc.expiredLease {
				insertRecord(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
			}
			var runs atomic.Int32
			res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, tc.opts, func(context.Context) (int, error) {
				runs.Add(1)
				return 7, nil
			})
			require.NoError(t, err)
			require.True(t, d.fired.Load(), "the reserving write's reply was lost")
			require.EqualValues(t, 1, runs.Load())
			require.Equal(t, tc.tookOver, res.TookOver)
			require.Equal(t, tc.attempts, res.Attempts)
			rec := b.lookup(t, "mail", "k")
			require.Equal(t, pgidem.StatusCompleted, rec.Status)
			require.Equal(t, tc.attempts, rec.Attempts)
		})
	}
}
