package pgidem_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Regression: under ReserveFirst the first statement sent is the reserving CTE. When it returns
// no row (the conflicting record committed after its snapshot — here a DoTx record whose
// transaction commits while the insert waits on it), acquire loops without setting
// acq.answered, so a connect error on the next round's probe fails open and runs fn although
// the store answered and a completed record exists: the effect runs twice (Attempts 0).
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

// Regression: a Permanent error whose message contains NUL is stored as JSON with \u0000,
// which jsonb refuses (class 22). finish now returns data exceptions without logging, and
// run ignores every finish error but errFinishNoRow on that path: the record stays in
// progress (silently), the next caller finds it in progress instead of replaying the
// failure, and after the lease the effect runs again.
func TestPermanentFailureWithNULIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) {
		return 0, pgidem.Permanent(errors.New("bad\x00byte"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusFailed, rec.Status, "the permanent failure was not stored")

	var ran atomic.Bool
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(), func(context.Context) (int, error) {
		ran.Store(true)
		return 1, nil
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.False(t, ran.Load())
}

type review3BadMarshal struct{}

func (review3BadMarshal) MarshalJSON() ([]byte, error) { return nil, errors.New("cannot\x00encode") }

// Regression: the same for a result that is not storable because its MarshalJSON error
// contains NUL: the "not storable" failure record is itself refused by jsonb, the record
// stays in progress and the caller gets a *StoreError (matching ErrStoreUnavailable)
// instead of ErrResultNotStorable, although fn ran. The River middleware then releases the
// job (ran && err) and the redelivery runs the effect again after the lease.
func TestNotStorableMessageWithNUL(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (review3BadMarshal, error) {
		return review3BadMarshal{}, nil
	})
	t.Logf("err=%v", err)
	require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
	require.Equal(t, pgidem.StatusFailed, b.lookup(t, "mail", "k").Status, "the effect ran but the record is left in progress")
}

// Regression: FailOpen now engages on any pgconn.ConnectError, which includes a server that
// answered the connection with an error: a database that does not exist (3D000) is a
// misconfiguration like a missing table, yet fn runs unprotected.
func TestFailOpenNotOnMissingDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Database = "pgidem_review3_no_such_db" })
	coord := b.newCoordOn(t, pool, &pgidem.Config{FailOpen: true})
	res, err := pgidem.DoResult(b.ctx, coord, "mail", "k", testTTL, nil, reviewFn1)
	t.Logf("err=%v failedOpen=%v", err, res.FailedOpen)
	require.False(t, res.FailedOpen, "a missing database is a misconfiguration, not an outage")
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
}
