package pgidemriver_test

// Lost and stalled leases while the worker runs, most by calling Middleware.Work directly
// with a job row (real Postgres, no client) so that the interleaving is deterministic.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// A lost lease cancels the worker with cause pgidem.ErrLeaseLost however long it has run,
// also past Config.SQLTimeout (which bounds only the reservation step), so the worker does
// not keep running beside whoever took the key over.
func TestLeaseLostCancelsWorker(t *testing.T) {
	t.Parallel()
	const sqlTimeout = 500 * time.Millisecond
	for _, tc := range []struct {
		name        string
		sqlTimeout  time.Duration
		runPastSQLT bool
	}{
		{"WithinSQLTimeout", time.Minute, false},
		{"PastSQLTimeout", sqlTimeout, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			mw, _ := b.invoiceMiddleware(t, &pgidemriver.Config{SQLTimeout: tc.sqlTimeout})

			running := make(chan struct{})
			stolen := make(chan struct{})
			var cause error
			doInner := func(ctx context.Context) error {
				if tc.runPastSQLT {
					time.Sleep(tc.sqlTimeout + 300*time.Millisecond) // a long job: past the SQL budget
					if ctx.Err() != nil {                            // not require: this runs on Work's goroutine
						t.Errorf("SQLTimeout must not bound the worker: %v", context.Cause(ctx))
					}
				}
				close(running)
				<-stolen
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
				case <-time.After(15 * testLease): // failure cap, not a timing assertion
				}
				return nil
			}
			errCh := make(chan error, 1)
			go func() { errCh <- mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":7}`), doInner) }()
			<-running
			// Another execution takes the key over (as after a missed heartbeat).
			tag, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid()
				WHERE namespace = 'mail.invoice' AND key = 'order-7.invoice' AND status = 'in_progress'`)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected())
			close(stolen)

			require.ErrorIs(t, <-errCh, pgidem.ErrLeaseLost)
			require.ErrorIs(t, cause, pgidem.ErrLeaseLost, "the worker must be cancelled when its lease is lost")
		})
	}
}

// A worker that fails permanently after its lease was taken over does not cancel its job:
// nothing was stored (the record is the new holder's), so the job fails with
// pgidem.ErrLeaseLost and River's retry replays or waits for the new holder's outcome; it
// is not reported as a stored failure. The worker's own river.JobCancel still passes
// through unchanged.
func TestLeaseLostPermanentFailureRetries(t *testing.T) {
	t.Parallel()
	declined := errors.New("declined")
	for i, werr := range []error{pgidem.Permanent(declined), river.JobCancel(pgidem.Permanent(declined))} {
		b := setup(t)
		mw, outs := b.invoiceMiddleware(t, nil)
		err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":7}`), func(ctx context.Context) error {
			// Another execution takes the key over (as after a missed heartbeat).
			tag, err := b.db.Pool.Exec(ctx, `UPDATE pgidem_record SET owner = gen_random_uuid()
				WHERE namespace = 'mail.invoice' AND key = 'order-7.invoice' AND status = 'in_progress'`)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected())
			return werr
		})
		require.ErrorIs(t, err, pgidem.ErrLeaseLost, "case %d", i)
		require.ErrorIs(t, err, declined, "case %d", i)
		var cancel *river.JobCancelError
		require.Equal(t, i == 1, errors.As(err, &cancel), "case %d: cancelled only by the worker's own JobCancel", i)
		out := outs.waitFor(t, pgidemriver.ActionError)
		require.False(t, out.RecordNotCompleted, "case %d", i)
		rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-7.invoice")
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusInProgress, rec.Status, "case %d: the new holder's record is untouched", i)
	}
}

// A worker that stops on its cancelled context after the lease was lost (returning
// ctx.Err(), as most workers do) fails its job with an error naming the lost lease, and
// the outcome is an error, not a release: River's errors column does not show a bare
// "context canceled".
func TestLeaseLostWorkerReturnsContextError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	running, _, errCh := workUntilCancelled(b, mw, 8)
	<-running
	tag, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid()
		WHERE namespace = 'mail.invoice' AND key = 'order-8.invoice' AND status = 'in_progress'`)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	err = <-errCh
	require.ErrorIs(t, err, pgidem.ErrLeaseLost)
	require.ErrorIs(t, err, context.Canceled)
	require.ErrorContains(t, err, "lease was lost")
	outs.waitFor(t, pgidemriver.ActionError)
	require.Zero(t, mw.Stats().Released)
}

// Renewals that merely stall (a lock on the record, a slow store) cancel the worker with
// cause pgidem.ErrLeaseLost before anyone took the record over; when the release that
// follows finds the reservation still this execution's, the outcome is a release, not a
// lost lease, and the worker's error is returned wrapped in one that says pgidem cancelled
// it, so River's errors column does not show a bare "context canceled". The context's
// cause alone does not make it a lost lease.
func TestStalledRenewalIsNotALostLease(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	running, cancelled, errCh := workUntilCancelled(b, mw, 12)
	<-running
	blocker, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	_, err = blocker.Exec(b.ctx, `SELECT 1 FROM pgidem_record WHERE namespace = 'mail.invoice' AND key = 'order-12.invoice' FOR UPDATE`)
	require.NoError(t, err)
	<-cancelled
	require.NoError(t, blocker.Rollback(b.ctx)) // the release goes through now

	err = <-errCh
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, pgidem.ErrLeaseLost)
	require.ErrorContains(t, err, "lease could not be renewed in time")
	outs.waitFor(t, pgidemriver.ActionReleased)
	_, err = b.coord.Lookup(b.ctx, "mail.invoice", "order-12.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
}
