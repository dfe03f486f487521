package pgidemriver_test

// The middleware's actions for the worker's own errors, against real Postgres; the
// mapping itself is tested in action_internal_test.go.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// River's snooze and cancel errors from the worker pass through as the same value, and the
// reservation is released.
func TestSnoozeCancelPassThrough(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, _ := b.invoiceMiddleware(t, nil)
	for i, werr := range []error{river.JobSnooze(time.Hour), river.JobCancel(fmt.Errorf("stop"))} {
		err := mw.Work(b.ctx, jobRow(int64(i+1), "mail.invoice", fmt.Sprintf(`{"order_id":%d}`, i+1)),
			func(context.Context) error { return werr })
		require.Same(t, werr, err)
		_, err = b.coord.Lookup(b.ctx, "mail.invoice", fmt.Sprintf("order-%d.invoice", i+1))
		require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
	}
	require.EqualValues(t, 2, mw.Stats().Released)
}

// A worker that wraps a permanent failure in its own river.JobCancel: the failure is stored
// (a later job with the key replays it) and the outcome says cancelled, not released.
func TestJobCancelWrappingPermanent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	declined := errors.New("declined")
	err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":3}`), func(context.Context) error {
		return river.JobCancel(pgidem.Permanent(declined))
	})
	var cancel *river.JobCancelError
	require.ErrorAs(t, err, &cancel)
	require.ErrorIs(t, err, declined)
	outs.waitFor(t, pgidemriver.ActionCancelled)
	require.EqualValues(t, 1, mw.Stats().Cancelled)
	require.Zero(t, mw.Stats().Released)
	rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-3.invoice")
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusFailed, rec.Status)

	// A later job with the key replays the failure, cancelled too, and its error says it
	// replayed, so River's errors column tells it from the first job's.
	err = mw.Work(b.ctx, jobRow(2, "mail.invoice", `{"order_id":3}`), func(context.Context) error {
		t.Error("the worker ran on a replay")
		return nil
	})
	require.ErrorAs(t, err, &cancel)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.ErrorContains(t, err, "replayed the failure an earlier execution stored for mail.invoice/order-3.invoice: declined")
}

// The worker's own error may carry pgidem's errors from calls of its own (a nested Do that
// lost its lease, a WorkTx whose failure was not stored); they say nothing about the
// middleware's record. A permanent failure the middleware stored cancels the job and is
// not flagged RecordNotCompleted; nor is it retried as a lost lease.
func TestWorkerErrorCarryingPgidemErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	declined := errors.New("declined")
	storeErr := &pgidem.StoreError{Op: "complete", Err: errors.New("injected")}
	for i, werr := range []error{
		pgidem.Permanent(fmt.Errorf("sub-effect: %w", pgidem.ErrLeaseLost)),
		pgidem.Permanent(fmt.Errorf("sub-effect: %w", storeErr)),
		river.JobCancel(&pgidem.FailureNotStoredError{Err: pgidem.Permanent(declined), Cause: storeErr}),
		&pgidem.FailureNotStoredError{Err: pgidem.Permanent(declined), Cause: fmt.Errorf("nested: %w", pgidem.ErrLeaseLost)},
	} {
		order := 20 + i
		err := mw.Work(b.ctx, jobRow(int64(order), "mail.invoice", fmt.Sprintf(`{"order_id":%d}`, order)),
			func(context.Context) error { return werr })
		var cancel *river.JobCancelError
		require.ErrorAs(t, err, &cancel, "case %d: a stored permanent failure cancels the job", i)
		out := outs.waitFor(t, pgidemriver.ActionCancelled)
		require.False(t, out.RecordNotCompleted, "case %d", i)
		rec, err := b.coord.Lookup(b.ctx, "mail.invoice", fmt.Sprintf("order-%d.invoice", order))
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusFailed, rec.Status, "case %d", i)
	}
}

// A plain worker error that wraps a nested call's ErrLeaseLost is the worker's failure:
// the middleware's reservation is released and the error returned unchanged, not taken
// for the middleware's own lost lease (ActionError, wrapped).
func TestWorkerErrorWrappingLeaseLostReleases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	werr := fmt.Errorf("sub-effect order-5.sms: %w", pgidem.ErrLeaseLost)
	err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":5}`), func(context.Context) error { return werr })
	require.Equal(t, werr, err, "the worker's error, unchanged")
	outs.waitFor(t, pgidemriver.ActionReleased)
	_, err = b.coord.Lookup(b.ctx, "mail.invoice", "order-5.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
}

// A worker error that matches pgidem.ErrPermanent only through a failure a nested pgidem
// call replayed carries no pgidem.Permanent error: pgidem released the record, so the job
// is not cancelled as if the failure were stored (a plain error is retried; the worker's
// own JobCancel passes through as a release). Neither is reported cancelled, and the
// plain error is not turned into a JobCancel.
func TestWorkerErrorCarryingReplayedFailureReleases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, nil)
	replayed := &pgidem.StoredFailureError{Namespace: "geocode", Key: "street-9", Message: "no such street"}
	for i, werr := range []error{
		fmt.Errorf("geocode the address: %w", replayed),
		river.JobCancel(replayed),
	} {
		order := 40 + i
		err := mw.Work(b.ctx, jobRow(int64(order), "mail.invoice", fmt.Sprintf(`{"order_id":%d}`, order)),
			func(context.Context) error { return werr })
		require.Equal(t, werr, err, "case %d: the worker's error, unchanged", i)
		outs.waitFor(t, pgidemriver.ActionReleased)
		_, err = b.coord.Lookup(b.ctx, "mail.invoice", fmt.Sprintf("order-%d.invoice", order))
		require.ErrorIs(t, err, pgidem.ErrNotFound, "case %d: released", i)
	}
	require.Zero(t, mw.Stats().Cancelled)
}
