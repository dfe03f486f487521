package pgidem_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// A shared round refused by the server (here: its key is behind an open DoTx) means the
// store answered: if the call's own statement then cannot connect, it must not fail open.
func TestRefusedRoundThenUnreachableDoesNotFailOpen(t *testing.T) {
	b := setup(t, nil)
	var dials atomic.Int32
	pool := b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.MinConns = 0
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if dials.Add(1) > 1 {
				return nil, errors.New("network down")
			}
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}
		cfg.AfterRelease = func(*pgx.Conn) bool { return false } // each connection is used once
	})
	coord := b.newCoordOn(t, pool, &pgidem.Config{FailOpen: true})

	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "side", "held", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		return "from-dotx", nil
	})
	require.NoError(t, err)

	ran := false
	res, err := pgidem.DoResult(b.ctx, coord, "side", "held", testTTL, &pgidem.DoOpts{ReserveFirst: true},
		func(context.Context) (string, error) { ran = true; return "from-do", nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.False(t, ran, "fn must not run beside the DoTx's record")
	require.False(t, res.FailedOpen)
}

// Under ReserveFirst the first statement sent is the reserving CTE. When it returns no row
// (the conflicting record committed after its snapshot — here a DoTx record whose
// transaction commits while the insert waits on it), the store has answered: a connect
// error on the next attempt's probe does not fail open, fn does not run again beside the
// completed record.
func TestFailOpenAfterReserveFirstNoRow(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	var down atomic.Bool
	pool := b.downablePool(t, &down, func(cfg *pgxpool.Config) {
		cfg.MinConns = 0
		// A connection released while the store is "down" is dropped, so the next
		// statement needs a new connection (as after a server restart or a network blip).
		cfg.AfterRelease = func(*pgx.Conn) bool { return !down.Load() }
	})
	coord := b.newCoordOn(t, pool, &pgidem.Config{FailOpen: true})

	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
		func(context.Context, pgx.Tx) (string, error) { return "from-dotx", nil })
	require.NoError(t, err)

	var ran atomic.Bool
	type out struct {
		res pgidem.Result[string]
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: true},
			func(context.Context) (string, error) { ran.Store(true); return "from-do", nil })
		done <- out{res, err}
	}()
	b.waitForBlocked(t, "transactionid", 1) // the reserving insert waits on tx's record
	down.Store(true)
	require.NoError(t, tx.Commit(b.ctx))
	o := <-done
	t.Logf("err=%v failedOpen=%v value=%q", o.err, o.res.FailedOpen, o.res.Value)
	require.JSONEq(t, `"from-dotx"`, string(b.lookup(t, "mail", "k").Result))
	require.False(t, ran.Load(), "FailOpen ran fn after the reserving statement was answered; a completed record exists (FailedOpen=%v)", o.res.FailedOpen)
}

// FailOpen does not engage on a server that answered the connection with an error: a
// database that does not exist (3D000) is a misconfiguration like a missing table, so the
// call returns ErrStoreUnavailable and fn does not run.
func TestFailOpenNotOnMissingDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Database = "pgidem_no_such_db" })
	coord := b.newCoordOn(t, pool, &pgidem.Config{FailOpen: true})
	res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, nil, returnOne)
	t.Logf("err=%v failedOpen=%v", err, res.FailedOpen)
	require.False(t, res.FailedOpen, "a missing database is a misconfiguration, not an outage")
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
}

// FailOpen never runs fn beside a holder the caller has seen alive: a lookup that fails
// while waiting for that holder returns a store error instead of failing open.
func TestFailOpenNeverBesideHolder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	var down atomic.Bool
	waiterPool := b.downablePool(t, &down, nil)
	waited := make(chan struct{})
	var waitedOnce sync.Once
	waiter, err := pgidem.NewCoordinator(waiterPool, &pgidem.Config{
		FailOpen: true,
		Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
			if e.Kind == pgidem.EventWaited {
				waitedOnce.Do(func() { close(waited) })
			}
		}),
	})
	require.NoError(t, err)

	h := b.hold(b.coord, "pay", "order-9", nil, "charged-by-holder")

	var waiterRan atomic.Bool
	waiterDone := make(chan pgidem.Result[string], 1)
	go func() {
		res, _ := pgidem.DoResult(b.ctx, waiter, "pay", "order-9", testTTL, nil, func(context.Context) (string, error) {
			waiterRan.Store(true)
			return "charged-by-waiter", nil
		})
		waiterDone <- res
	}()
	<-waited
	down.Store(true)
	waiterPool.Reset() // the waiter's store becomes unreachable mid-wait
	res := <-waiterDone
	h.unblock()
	require.NoError(t, <-h.done)
	require.False(t, waiterRan.Load(), "FailOpen ran the effect beside a live holder (FailedOpen=%v)", res.FailedOpen)
}
