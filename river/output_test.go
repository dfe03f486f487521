package pgidemriver_test

import (
	"context"
	"strings"
	"testing"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// Output that the pgidem record cannot store (here: larger than the coordinator's
// MaxValueBytes, though River takes it) does not make the middleware misreport the run:
// the effect ran once, the job completes (ActionExecuted, OutputNotStored), and a later job
// with the key replays and completes without output — never released, retried or
// cancelled.
func TestOutputNotStorableCompletes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var err error
	b.coord, err = pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{MaxValueBytes: 200})
	require.NoError(t, err)
	mw, outs := b.newMiddleware(t, nil)
	worker := &effectWorker[InvoiceArgs]{pool: b.db.Pool,
		after: func(ctx context.Context, _ *river.Job[InvoiceArgs]) error {
			return pgidemriver.RecordOutput(ctx, "receipt "+strings.Repeat("x", 200))
		}}
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, worker)
	b.startClient(t, riverConfig(t, workers, mw))

	first := b.insert(t, InvoiceArgs{OrderID: 12}, nil)
	job := b.waitJob(t, first, rivertype.JobStateCompleted, rivertype.JobStateCancelled, rivertype.JobStateDiscarded, rivertype.JobStateRetryable)
	require.Equal(t, rivertype.JobStateCompleted, job.State)
	require.Contains(t, string(job.Metadata), "receipt", "River keeps the output it recorded")
	executed := outs.waitFor(t, pgidemriver.ActionExecuted)
	require.True(t, executed.OutputNotStored)
	require.Contains(t, string(executed.Output), "receipt", "the outcome carries the output the record lacks")
	require.NoError(t, executed.Err)

	second := b.insert(t, InvoiceArgs{OrderID: 12}, nil)
	job = b.waitJob(t, second, rivertype.JobStateCompleted, rivertype.JobStateCancelled, rivertype.JobStateDiscarded, rivertype.JobStateRetryable)
	require.Equal(t, rivertype.JobStateCompleted, job.State)
	replayed := outs.waitFor(t, pgidemriver.ActionReplayed)
	require.True(t, replayed.OutputNotStored)
	require.Nil(t, replayed.Output)

	require.Equal(t, 1, b.effects(t))
	stats := mw.Stats()
	require.EqualValues(t, 1, stats.Executed)
	require.EqualValues(t, 1, stats.Replayed)
	require.Zero(t, stats.Released+stats.Cancelled+stats.Errors)
}
