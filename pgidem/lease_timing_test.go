package pgidem_test

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// A lease runs from its statement's start on the server. A reserving insert that waited
// longer than a lease behind another transaction's uncommitted record (an open DoTx that
// then rolled back) used to hand its caller a lease that had already ended: another caller
// took the key over at once and both fns ran side by side. The holder now renews such a
// lease before fn starts.
func TestReservationAfterLockWaitIsRenewed(t *testing.T) {
	t.Parallel()
	const lease = 500 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})

	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		return "tx", nil
	})
	require.NoError(t, err)

	var running, maxRunning atomic.Int32
	enter := func() {
		n := running.Add(1)
		for {
			m := maxRunning.Load()
			if n <= m || maxRunning.CompareAndSwap(m, n) {
				break
			}
		}
	}
	aStarted := make(chan struct{})
	aDone := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
			enter()
			defer running.Add(-1)
			close(aStarted)
			select {
			case <-ctx.Done():
			case <-time.After(2 * time.Second):
			}
			return "A", nil
		})
		aDone <- err
	}()
	b.waitForBlocked(t, "transactionid", 1) // A's insert waits for tx's record
	time.Sleep(2 * lease)                   // longer than a lease
	require.NoError(t, tx.Rollback(b.ctx))
	<-aStarted

	other := b.newCoord(t, &pgidem.Config{Lease: lease})
	res, err := pgidem.DoResult(b.ctx, other, "mail", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
		func(context.Context) (string, error) {
			enter()
			defer running.Add(-1)
			return "B", nil
		})
	require.ErrorIs(t, err, pgidem.ErrInProgress, "A holds a live lease")
	require.False(t, res.TookOver)
	require.NoError(t, <-aDone)
	require.EqualValues(t, 1, maxRunning.Load(), "fn ran twice side by side")
}

// The heartbeat counts a lease from the send time of the statement that granted it, and a
// timer cancels fn when it runs out without a renewal. It used to count a whole lease from
// when fn started (later still after a lost-reply recovery) and check only after a failed
// renewal, so a holder cut off from the store kept running fn after another caller had
// taken the key over.
func TestHeartbeatCancelsBeforeTakeover(t *testing.T) {
	t.Parallel()
	const lease = 600 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})

	var down atomic.Bool
	d := &lostReplyDialer{marker: []byte("WITH ins AS")}
	pool := b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if down.Load() {
				return nil, errors.New("network unreachable")
			}
			return d.dial(ctx, network, addr)
		}
		cfg.ConnConfig.TLSConfig = nil
		cfg.ConnConfig.Fallbacks = nil
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeExec
	})
	coord := b.newCoordOn(t, pool, &pgidem.Config{Lease: lease})

	var aRunning atomic.Bool
	aStarted := make(chan struct{})
	aDone := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
			aRunning.Store(true)
			down.Store(true) // the holder is cut off from the store from now on
			pool.Reset()
			close(aStarted)
			select {
			case <-ctx.Done():
			case <-time.After(3 * time.Second):
			}
			aRunning.Store(false)
			return "A", nil
		})
		aDone <- err
	}()
	<-aStarted
	require.True(t, d.fired.Load(), "the reserve's reply was lost and recovered")

	var overlap atomic.Bool
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
		overlap.Store(aRunning.Load())
		return "B", nil
	})
	require.NoError(t, err)
	require.True(t, res.TookOver)
	down.Store(false)
	require.ErrorIs(t, <-aDone, pgidem.ErrLeaseLost)
	require.False(t, overlap.Load(), "B's fn ran while A's fn still ran with a live context")
}
