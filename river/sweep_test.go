package pgidemriver_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// TestSweeper: the periodic sweep removes expired records and keeps live ones; two
// clients sweeping at once both succeed.
func TestSweeper(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const expired = 3000
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, expires_at, completed_at)
		SELECT 'mail.invoice', 'old-' || i, 'completed', gen_random_uuid(), now() - interval '1 hour', now() - interval '2 hours'
		FROM generate_series(1, $1) AS i`, expired)
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "mail.invoice", "order-9.invoice", testTTL, nil,
		func(context.Context) (string, error) { return "em_1", nil })
	require.NoError(t, err)

	newClientConfig := func() *river.Config {
		sweeper, err := pgidemriver.NewSweepWorker(b.coord, &pgidemriver.SweepConfig{BatchSize: 100, Pause: -1})
		require.NoError(t, err)
		workers := river.NewWorkers()
		river.AddWorker(workers, sweeper)
		cfg := riverConfig(t, workers)
		sweep, err := pgidemriver.NewSweepPeriodicJob(nil)
		require.NoError(t, err)
		cfg.PeriodicJobs = []*river.PeriodicJob{sweep}
		return cfg
	}
	clientA := b.startClient(t, newClientConfig())
	clientB := b.startClient(t, newClientConfig())

	// Besides the leader's run-on-start sweep, each client gets one more at the same time.
	var ids []int64
	for _, c := range []*river.Client[pgx.Tx]{clientA, clientB} {
		res, err := c.Insert(b.ctx, pgidemriver.SweepArgs{}, nil)
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
	}
	var swept int64
	for _, id := range ids {
		job := b.waitJob(t, id, rivertype.JobStateCompleted)
		require.Empty(t, job.Errors)
	}
	// The periodic job (unique by period) ran on start on the leader.
	periodic := b.waitKind(t, pgidemriver.SweepKind, 3)
	for _, job := range periodic {
		job = b.waitJob(t, job.ID, rivertype.JobStateCompleted)
		require.Empty(t, job.Errors)
		require.Contains(t, string(job.Output()), `"records":`, "the output's keys are the CLI's")
		var out pgidem.SweepResult
		require.NoError(t, json.Unmarshal(job.Output(), &out))
		swept += out.Records
	}

	require.EqualValues(t, expired, swept, "each expired row deleted exactly once across the sweeps")
	require.EqualValues(t, expired, b.events.get(pgidem.EventSwept))
	var left int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM pgidem_record").Scan(&left))
	require.Equal(t, 1, left)
	_, err = b.coord.Lookup(b.ctx, "mail.invoice", "order-9.invoice")
	require.NoError(t, err, "the live record is kept")
}

// waitKind polls until n jobs of kind exist and returns them.
func (b *bundle) waitKind(t *testing.T, kind string, n int) []*rivertype.JobRow {
	t.Helper()
	client, err := river.NewClient(riverpgxv5.New(b.db.Pool), &river.Config{})
	require.NoError(t, err)
	deadline := time.Now().Add(waitCap)
	for {
		res, err := client.JobList(b.ctx, river.NewJobListParams().Kinds(kind).First(100))
		require.NoError(t, err)
		if len(res.Jobs) >= n {
			return res.Jobs
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d jobs of kind %s after %s, want %d", len(res.Jobs), kind, waitCap, n)
		}
		time.Sleep(pollInterval)
	}
}

// Invalid sweep settings are refused with an error naming the field, before a client
// starts: River would refuse every insert of a sweep with a periodic interval under one
// second (its shortest unique period is one second), logging an error each period —
// continuously for a negative interval — without ever sweeping.
func TestSweepSettingsValidated(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, interval := range []time.Duration{-time.Minute, -1, time.Nanosecond, 999 * time.Millisecond} {
		job, err := pgidemriver.NewSweepPeriodicJob(&pgidemriver.SweepPeriodicJobOpts{Interval: interval})
		require.ErrorContains(t, err, "SweepPeriodicJobOpts.Interval", "interval %s", interval)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.Nil(t, job)
	}
	for _, interval := range []time.Duration{0, time.Second, time.Hour} {
		job, err := pgidemriver.NewSweepPeriodicJob(&pgidemriver.SweepPeriodicJobOpts{Interval: interval})
		require.NoError(t, err, "interval %s", interval)
		require.NotNil(t, job)
	}
	for field, config := range map[string]*pgidemriver.SweepConfig{
		"SweepConfig.BatchSize": {BatchSize: -1},
		"SweepConfig.Pause":     {Pause: -2},
		"SweepConfig.Timeout":   {Timeout: -1},
	} {
		worker, err := pgidemriver.NewSweepWorker(b.coord, config)
		require.ErrorContains(t, err, field)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.Nil(t, worker)
	}
	_, err := pgidemriver.NewSweepWorker(nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
}

// A sweep whose job is cancelled (the client stopping with StopAndCancel) is routine: it
// is logged at info, not error, and returns the context's error for River to handle.
func TestSweepCancelledIsNotAnError(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs bytes.Buffer
	sweeper, err := pgidemriver.NewSweepWorker(b.coord, &pgidemriver.SweepConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(b.ctx)
	cancel()
	err = sweeper.Work(ctx, &river.Job[pgidemriver.SweepArgs]{JobRow: &rivertype.JobRow{ID: 1, Kind: pgidemriver.SweepKind}})
	require.ErrorIs(t, err, context.Canceled)
	require.NotContains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "sweep stopped: its job was cancelled")
}

// A sweep whose timeout passes before its first batch finishes deleted nothing, and when one
// batch always takes longer than the timeout no run ever will: that is logged at warn, with
// the settings to change, while the job still succeeds.
func TestSweepTimeoutBeforeFirstBatchWarns(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, expires_at, completed_at)
		SELECT 'mail.invoice', 'old-' || i, 'completed', gen_random_uuid(), now() - interval '1 hour', now() - interval '2 hours'
		FROM generate_series(1, 10) AS i`)
	require.NoError(t, err)
	job := &river.Job[pgidemriver.SweepArgs]{JobRow: &rivertype.JobRow{ID: 1, Kind: pgidemriver.SweepKind}}
	newSweeper := func(logs *bytes.Buffer) *pgidemriver.SweepWorker {
		sweeper, err := pgidemriver.NewSweepWorker(b.coord, &pgidemriver.SweepConfig{BatchSize: 5, Logger: slog.New(slog.NewTextHandler(logs, nil))})
		require.NoError(t, err)
		return sweeper
	}

	var logs bytes.Buffer
	ctx, cancel := context.WithDeadline(b.ctx, time.Now().Add(-time.Second))
	defer cancel()
	require.NoError(t, newSweeper(&logs).Work(ctx, job))
	require.Contains(t, logs.String(), "level=WARN")
	require.Contains(t, logs.String(), "before its first batch finished")
	require.Contains(t, logs.String(), "batch_size=5")
	var left int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM pgidem_record").Scan(&left))
	require.Equal(t, 10, left)

	// A sweep that got through its batches is not warned about.
	logs.Reset()
	require.NoError(t, newSweeper(&logs).Work(b.ctx, job))
	require.NotContains(t, logs.String(), "before its first batch finished")
	require.Contains(t, logs.String(), "records=10")
}

// The sweep job deletes expired inbox rows as well as records (TestSweeper checks the
// records), and keeps live ones.
func TestSweepWorkerSweepsInbox(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		SELECT 'orders', 'old-' || i, now() - interval '8 days', now() - interval '1 day' FROM generate_series(1, 250) i
		UNION ALL
		SELECT 'orders', 'live-' || i, now(), now() + interval '7 days' FROM generate_series(1, 5) i`)
	require.NoError(t, err)
	sweeper, err := pgidemriver.NewSweepWorker(b.coord, &pgidemriver.SweepConfig{BatchSize: 100, Pause: -1})
	require.NoError(t, err)
	workers := river.NewWorkers()
	river.AddWorker(workers, sweeper)
	client := b.startClient(t, riverConfig(t, workers))
	res, err := client.Insert(b.ctx, pgidemriver.SweepArgs{}, nil)
	require.NoError(t, err)
	job := b.waitJob(t, res.Job.ID, rivertype.JobStateCompleted)
	var out pgidem.SweepResult
	require.NoError(t, json.Unmarshal(job.Output(), &out))
	require.EqualValues(t, 250, out.Inbox)
	var left int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_inbox`).Scan(&left))
	require.Equal(t, 5, left)
}
