package pgidemriver_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertest"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	"github.com/pgidem/pgidem/pgidemtest"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// beginTx begins a test transaction on b's database and rolls it back at cleanup.
func (b *bundle) beginTx(t *testing.T) pgx.Tx {
	t.Helper()
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// TestRivertestMiddleware: the middleware runs under River's rivertest.Worker as under a
// client (River runs a config's worker middleware there too): a second job for the same
// effect completes without running the worker.
func TestRivertestMiddleware(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	mw.Register(InvoiceArgs{}) // rivertest takes the worker itself, not a Workers bundle
	config := &river.Config{Middleware: []rivertype.Middleware{mw}}
	worker := rivertest.NewWorker(t, riverpgxv5.New(nil), config, &effectWorker[InvoiceArgs]{pool: b.db.Pool})
	tx := b.beginTx(t)

	for i := range 2 {
		res, err := worker.Work(b.ctx, t, tx, InvoiceArgs{OrderID: 9}, nil)
		require.NoError(t, err)
		require.Equal(t, river.EventKindJobCompleted, res.EventKind, "job %d", i)
	}
	require.Equal(t, 1, b.effects(t), "two jobs, one invoice")
	got := outs.list()
	require.Len(t, got, 2)
	require.Equal(t, pgidemriver.ActionExecuted, got[0].Action)
	require.Equal(t, pgidemriver.ActionReplayed, got[1].Action)
	// What pgidemtest's docs promise: the record is on the pool, in the kind's namespace,
	// under the args' key, completed once.
	pgidemtest.RequireCompleted(b.ctx, t, b.coord, InvoiceArgs{}.Kind(), InvoiceArgs{OrderID: 9}.IdempotencyKey(),
		&pgidemtest.RequireOpts{Attempts: 1})
}

// TestRivertestWorkTx: WorkTx in a transaction begun from rivertest's (a savepoint) puts
// the shipment, the record and the job's completion in the test's transaction: a second
// job for the shipment replays, another transaction holding the key snoozes the job, a
// permanent failure cancels it and is replayed, and rolling the test's transaction back
// leaves nothing.
func TestRivertestWorkTx(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
	require.NoError(t, err)
	tx := b.beginTx(t)
	ship := &shipWorker{coord: b.coord, begin: tx.Begin}
	worker := rivertest.NewWorker(t, riverpgxv5.New(nil), &river.Config{}, ship)

	inTx := func() (shipments int, status string) {
		t.Helper()
		require.NoError(t, tx.QueryRow(b.ctx, `SELECT (SELECT count(*) FROM shipments),
			coalesce((SELECT status FROM pgidem_record WHERE namespace = 'orders' AND key = 'order-9.ship'), 'none')`).Scan(&shipments, &status))
		return shipments, status
	}

	for i := range 2 {
		res, err := worker.Work(b.ctx, t, tx, ShipArgs{OrderID: 9}, nil)
		require.NoError(t, err)
		require.Equal(t, river.EventKindJobCompleted, res.EventKind, "job %d", i)
		require.Equal(t, rivertype.JobStateCompleted, res.Job.State)
		shipments, status := inTx()
		require.Equal(t, 1, shipments, "job %d: one shipment", i)
		require.Equal(t, "completed", status)
	}

	t.Run("HeldElsewhereSnoozes", func(t *testing.T) {
		// Another transaction holds order 10's key (DoTx, not yet committed).
		other, err := b.db.Pool.Begin(b.ctx)
		require.NoError(t, err)
		defer other.Rollback(b.ctx) //nolint:errcheck
		_, err = pgidem.DoTx(b.ctx, b.coord, other, "orders", "order-10.ship", testTTL, nil,
			func(context.Context, pgx.Tx) (int64, error) { return 0, nil })
		require.NoError(t, err)

		ship.opts = &pgidem.DoOpts{InFlight: pgidem.InFlightRaise}
		defer func() { ship.opts = nil }()
		res, err := worker.Work(b.ctx, t, tx, ShipArgs{OrderID: 10}, nil)
		require.NoError(t, err) // rivertest reports a snooze as an event, not an error
		require.Equal(t, river.EventKindJobSnoozed, res.EventKind)
		require.Equal(t, 0, res.Job.Attempt, "a snooze uses no attempt")
	})

	t.Run("PermanentFailureCancels", func(t *testing.T) {
		declined := errors.New("address refused by the carrier")
		runs := 0
		var last error // rivertest returns no cancel error: the worker's own, kept here
		failing := rivertest.NewWorker(t, riverpgxv5.New(nil), &river.Config{}, river.WorkFunc(
			func(ctx context.Context, job *river.Job[ShipArgs]) error {
				tx, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(ctx) //nolint:errcheck
				_, err = pgidemriver.WorkTx(ctx, b.coord, tx, job, "orders", "order-11.ship", testTTL, nil,
					func(context.Context, pgx.Tx) (int, error) { runs++; return 0, pgidem.Permanent(declined) })
				last = err
				if !pgidemriver.ShouldCommit(err) {
					return err
				}
				if cerr := tx.Commit(ctx); cerr != nil {
					return cerr
				}
				return err
			}))

		res, err := failing.Work(b.ctx, t, tx, ShipArgs{OrderID: 11}, nil)
		require.NoError(t, err)
		require.ErrorIs(t, last, declined)
		var cancel *river.JobCancelError
		require.ErrorAs(t, last, &cancel)
		require.Equal(t, river.EventKindJobCancelled, res.EventKind)
		var status string
		require.NoError(t, tx.QueryRow(b.ctx, `SELECT status FROM pgidem_record WHERE namespace = 'orders' AND key = 'order-11.ship'`).Scan(&status))
		require.Equal(t, "failed", status, "the commit kept the stored failure")

		res, err = failing.Work(b.ctx, t, tx, ShipArgs{OrderID: 11}, nil)
		require.NoError(t, err)
		var stored *pgidem.StoredFailureError
		require.ErrorAs(t, last, &stored, "the second job replays the failure")
		require.Equal(t, river.EventKindJobCancelled, res.EventKind)
		require.Equal(t, 1, runs, "fn ran for the first job only")
	})

	require.NoError(t, tx.Rollback(b.ctx))
	var shipments, records, jobs int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT (SELECT count(*) FROM shipments),
		(SELECT count(*) FROM pgidem_record), (SELECT count(*) FROM river_job)`).Scan(&shipments, &records, &jobs))
	require.Zero(t, shipments+records+jobs, "the test's rollback leaves nothing")
}
