package pgidem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func TestErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	t.Run("OrdinaryErrorReleases", func(t *testing.T) {
		boom := errors.New("smtp timeout")
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "retry", testTTL, nil, func(context.Context) (int, error) { return 0, boom })
		require.Same(t, boom, err, "returned unchanged")
		_, err = b.coord.Lookup(b.ctx, "mail", "retry")
		require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "retry", testTTL, nil, func(context.Context) (int, error) { return 2, nil })
		require.NoError(t, err)
		require.Equal(t, 2, v, "the next call runs fn")
	})

	t.Run("PermanentErrorReplays", func(t *testing.T) {
		declined := errors.New("card declined")
		_, err := pgidem.Do(b.ctx, b.coord, "pay", "order-9", testTTL, nil, func(context.Context) (int, error) {
			return 0, pgidem.Permanent(declined)
		})
		require.ErrorIs(t, err, declined)
		require.ErrorIs(t, err, pgidem.ErrPermanent)
		res, err := pgidem.DoResult(b.ctx, b.coord, "pay", "order-9", testTTL, nil, func(context.Context) (int, error) {
			t.Error("fn ran after a permanent failure")
			return 1, nil
		})
		require.True(t, res.Replayed)
		require.ErrorIs(t, err, pgidem.ErrPermanent)
		var sfe *pgidem.StoredFailureError
		require.ErrorAs(t, err, &sfe)
		require.Equal(t, "card declined", sfe.Message)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "pay", "order-9").Status)
		require.Nil(t, pgidem.Permanent(nil))
	})

	t.Run("PanicReleases", func(t *testing.T) {
		require.PanicsWithValue(t, "kaboom", func() {
			_, _ = pgidem.Do(b.ctx, b.coord, "mail", "panic", testTTL, nil, func(context.Context) (int, error) { panic("kaboom") })
		})
		_, err := b.coord.Lookup(b.ctx, "mail", "panic")
		require.ErrorIs(t, err, pgidem.ErrNotFound)
	})

	t.Run("CancelledCallerStillFinishes", func(t *testing.T) {
		ctx, cancel := context.WithCancel(b.ctx)
		v, err := pgidem.Do(ctx, b.coord, "mail", "cancel", testTTL, nil, func(ctx context.Context) (string, error) {
			cancel()
			<-ctx.Done()
			return "sent-anyway", nil
		})
		require.NoError(t, err)
		require.Equal(t, "sent-anyway", v)
		rec := b.lookup(t, "mail", "cancel")
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
	})

	t.Run("CancelledBeforeReserve", func(t *testing.T) {
		ctx, cancel := context.WithCancel(b.ctx)
		cancel()
		_, err := pgidem.Do(ctx, b.coord, "mail", "never", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, context.Canceled)
		_, err = b.coord.Lookup(b.ctx, "mail", "never")
		require.ErrorIs(t, err, pgidem.ErrNotFound)
	})
}

// A PermanentError made without an error (a literal, or a typed nil) is stored as a
// permanent failure like any other: no panic after fn returned, no record left in progress.
func TestPermanentErrorWithoutErr(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var typedNil *pgidem.PermanentError
	for i, perr := range []error{&pgidem.PermanentError{}, typedNil} {
		key := fmt.Sprintf("k%d", i)
		_, err := pgidem.Do(b.ctx, b.coord, "perm", key, testTTL, nil, func(context.Context) (int, error) { return 0, perr })
		require.ErrorIs(t, err, pgidem.ErrPermanent, "case %d", i)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "perm", key).Status, "case %d", i)
		_, err = pgidem.DoInTx(b.ctx, b.coord, "perm-tx", key, testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 0, perr })
		require.ErrorIs(t, err, pgidem.ErrPermanent, "case %d", i)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "perm-tx", key).Status, "case %d", i)
	}
}

// Result.LeaseLost tells that the write after fn found the reservation taken over, also
// when fn's own error is returned unchanged (the release found no row of its own).
func TestResultLeaseLost(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	boom := errors.New("boom")
	res, err := pgidem.DoResult(b.ctx, b.coord, "lost", "k", testTTL, nil, func(context.Context) (int, error) {
		_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid() WHERE namespace = 'lost' AND key = 'k'`)
		require.NoError(t, err)
		return 0, boom
	})
	require.Equal(t, boom, err, "fn's error, unchanged")
	require.True(t, res.LeaseLost)

	res, err = pgidem.DoResult(b.ctx, b.coord, "lost", "k2", testTTL, nil, func(context.Context) (int, error) { return 0, boom })
	require.Equal(t, boom, err)
	require.False(t, res.LeaseLost, "released normally")
}

// Errors carry their documented types: a lease below the minimum is an *InvalidTTLError
// matching ErrInvalidTTL, and Lookup with an invalid key returns ErrInvalidKey, not a store
// error.
func TestErrorTypes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fn := func(context.Context) (int, error) { return 1, nil }

	t.Run("OptsLeaseBelowMinIsInvalidTTLError", func(t *testing.T) {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{Lease: time.Millisecond}, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidTTL)
		var ite *pgidem.InvalidTTLError
		require.ErrorAs(t, err, &ite, "ErrInvalidTTL documents *InvalidTTLError for detail")
	})
	t.Run("LookupInvalidKey", func(t *testing.T) {
		_, err := b.coord.Lookup(b.ctx, "mail", "a\x00b")
		require.ErrorIs(t, err, pgidem.ErrInvalidKey, "an invalid key is not an unavailable store (got %v)", err)
	})
}
