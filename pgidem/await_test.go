package pgidem_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/pgidem/pgidem/pgidem"
	"github.com/stretchr/testify/require"
)

// Await returns a completed record's value and a stored failure's error, and never runs
// or reserves anything.
func TestAwaitFinished(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "done", testTTL, nil, func(context.Context) (string, error) { return "sent", nil })
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "failed", testTTL, nil, func(context.Context) (string, error) {
		return "", pgidem.Permanent(errors.New("mailbox gone"))
	})
	require.Error(t, err)

	res, err := pgidem.Await[string](b.ctx, b.coord, "mail", "done", nil)
	require.NoError(t, err)
	require.Equal(t, "sent", res.Value)
	require.Equal(t, pgidem.OutcomeReplayed, res.Outcome)
	require.Equal(t, 1, res.Attempts)

	res, err = pgidem.Await[string](b.ctx, b.coord, "mail", "failed", nil)
	var stored *pgidem.StoredFailureError
	require.ErrorAs(t, err, &stored)
	require.Contains(t, stored.Error(), "mailbox gone")
	require.Equal(t, pgidem.OutcomeStoredFailure, res.Outcome)

	_, err = pgidem.Await[int](b.ctx, b.coord, "mail", "done", nil)
	require.ErrorIs(t, err, pgidem.ErrReplayNotDecodable)
}

// Await on a key with no record, or one whose holder's lease ran out, returns ErrNotFound
// at once and leaves the table as it was.
func TestAwaitAbsent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Await[string](b.ctx, b.coord, "mail", "nobody", nil)
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	_, err = b.coord.Lookup(b.ctx, "mail", "nobody")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "Await wrote a record")

	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at)
		VALUES ('mail', 'dead', 'in_progress', gen_random_uuid(), 1, now() - interval '1 second', now() + interval '1 hour')`)
	require.NoError(t, err)
	_, err = pgidem.Await[string](b.ctx, b.coord, "mail", "dead", nil)
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	rec, err := b.coord.Lookup(b.ctx, "mail", "dead")
	require.NoError(t, err)
	require.Equal(t, 1, rec.Attempts, "Await took the record over")
}

// Await waits for a record in progress and returns its value once the holder completes;
// under InFlightRaise it returns an InProgressError at once.
func TestAwaitInProgress(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
			close(started)
			<-release
			return "sent", nil
		})
		done <- err
	}()
	<-started

	res, err := pgidem.Await[string](b.ctx, b.coord, "mail", "k", &pgidem.DoOpts{InFlight: pgidem.InFlightRaise})
	var inProgress *pgidem.InProgressError
	require.ErrorAs(t, err, &inProgress)
	require.Equal(t, pgidem.OutcomeInProgress, res.Outcome)
	require.Positive(t, res.RetryAfter)

	awaited := make(chan pgidem.Result[string], 1)
	go func() {
		res, err := pgidem.Await[string](b.ctx, b.coord, "mail", "k", &pgidem.DoOpts{WaitTimeout: time.Minute})
		require.NoError(t, err)
		awaited <- res
	}()
	close(release)
	require.NoError(t, <-done)
	res = <-awaited
	require.Equal(t, "sent", res.Value)
	require.True(t, res.Waited || res.Outcome == pgidem.OutcomeReplayed)
}

// Await checks the fingerprint as Do does, and refuses an invalid key with a typed error.
func TestAwaitFingerprintAndInvalidKey(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("a")}, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	res, err := pgidem.Await[int](b.ctx, b.coord, "mail", "k", &pgidem.DoOpts{Fingerprint: []byte("b")})
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	require.Equal(t, pgidem.OutcomeFingerprintMismatch, res.Outcome)

	_, err = pgidem.Await[int](b.ctx, b.coord, "mail", "", nil)
	var invalid *pgidem.InvalidKeyError
	require.ErrorAs(t, err, &invalid)
	res, err = pgidem.Await[int](b.ctx, nil, "mail", "k", nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.Equal(t, pgidem.OutcomeInvalid, res.Outcome)
	res, err = pgidem.DoResult[int](b.ctx, nil, "mail", "k", testTTL, nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.Equal(t, pgidem.OutcomeInvalid, res.Outcome, "a nil argument is an invalid input")
}
