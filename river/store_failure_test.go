package pgidemriver_test

// Store failures around the worker: a record that cannot be completed, and fail-open runs.

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// When the record cannot be completed after the worker ran, the middleware says so: a
// successful worker is an executed outcome flagged RecordNotCompleted (the job completes;
// nothing was released), and a permanent failure still cancels the job but with an error
// saying the failure was not stored. Neither is reported as if the record had been
// written.
func TestFinishingWriteFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	failCompletions(t, b)
	mw, outs := b.invoiceMiddleware(t, nil)

	t.Run("WorkerSucceeded", func(t *testing.T) {
		// The effect ran: the job completes (a retry would take the record over once its
		// lease ends and run the effect again), flagged and counted.
		err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { return nil })
		require.NoError(t, err)
		out := outs.waitFor(t, pgidemriver.ActionExecuted)
		require.Equal(t, "order-1.invoice", out.Key)
		require.True(t, out.RecordNotCompleted)
		stats := mw.Stats()
		require.Zero(t, stats.Released)
		require.EqualValues(t, 1, stats.RecordNotCompleted)
		rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-1.invoice")
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusInProgress, rec.Status)
	})

	t.Run("PermanentFailure", func(t *testing.T) {
		declined := errors.New("declined")
		err := mw.Work(b.ctx, jobRow(2, "mail.invoice", `{"order_id":2}`), func(context.Context) error {
			return pgidem.Permanent(declined)
		})
		var cancel *river.JobCancelError
		require.ErrorAs(t, err, &cancel)
		require.ErrorIs(t, err, declined)
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable, "the failure was not stored")
		require.True(t, outs.waitFor(t, pgidemriver.ActionCancelled).RecordNotCompleted)
		rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-2.invoice")
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusInProgress, rec.Status)
	})
}

// A store outage after the worker succeeded must not run the effect again through River's
// retry: the job completes although its record could not be completed. Were it to fail,
// each retry would take the record over when its lease ended and run the effect again.
func TestStoreOutageAfterTheEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	failCompletions(t, b)
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE outage SET until = '-infinity'`)
	require.NoError(t, err)
	mw, outs := b.newMiddleware(t, nil)
	var first atomic.Bool
	worker := &effectWorker[InvoiceArgs]{pool: b.db.Pool,
		after: func(ctx context.Context, job *river.Job[InvoiceArgs]) error {
			if first.CompareAndSwap(false, true) { // the store fails for longer than pgidem's finishing retries
				_, err := b.db.Pool.Exec(context.WithoutCancel(ctx), `UPDATE outage SET until = clock_timestamp() + interval '3 seconds'`)
				return err
			}
			return nil
		}}
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, worker)
	b.startClient(t, riverConfig(t, workers, mw))
	id := b.insert(t, InvoiceArgs{OrderID: 1}, nil)
	job := b.waitJob(t, id, rivertype.JobStateCompleted)
	require.Equal(t, 1, job.Attempt, "River did not retry the job")
	require.Equal(t, 1, b.effects(t), "the invoice was sent once")
	require.True(t, outs.waitFor(t, pgidemriver.ActionExecuted).RecordNotCompleted)
	rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-1.invoice")
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusInProgress, rec.Status, "the record stays in progress until its lease ends")
}

// Under pgidem's FailOpen with the store unreachable, the worker runs without a
// reservation: the outcome and Stats say so instead of describing a record that does not
// exist.
func TestFailedOpenOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t)
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.DialFunc = func(context.Context, string, string) (net.Conn, error) {
		return nil, errors.New("network unreachable")
	}
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: true})
	require.NoError(t, err)
	outs := newOutcomes()
	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{Hook: outs, Logger: testLogger(t)})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{})

	var runs atomic.Int32
	require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":4}`), func(context.Context) error { runs.Add(1); return nil }))
	require.EqualValues(t, 1, runs.Load())
	out := outs.list()[0]
	require.True(t, out.FailedOpen)
	require.Equal(t, pgidemriver.ActionExecuted, out.Action)
	require.EqualValues(t, 1, mw.Stats().FailedOpen)
}
