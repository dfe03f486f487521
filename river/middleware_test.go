package pgidemriver_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// TestRescuerDuplicate: River's stuck-job rescuer re-runs a job that is still running
// (JobTimeout 1 s, RescueStuckJobsAfter 2 s, a worker that ignores cancellation), so the
// same job runs twice in parallel. The effect runs once: the duplicate is snoozed (Raise)
// and later replays, or waits and replays (Wait).
func TestRescuerDuplicate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		policy pgidem.InFlightPolicy
	}{
		{"Raise", pgidem.InFlightRaise},
		{"Wait", pgidem.InFlightWait},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			// SnoozeMin keeps a snoozed duplicate parked long enough to observe.
			mw, outs := b.newMiddleware(t, &pgidemriver.Config{InFlight: tc.policy, SnoozeMin: 3 * time.Second})

			var runs atomic.Int32
			duplicateAnswered := make(chan struct{})
			worker := &effectWorker[InvoiceArgs]{pool: b.db.Pool,
				after: func(ctx context.Context, job *river.Job[InvoiceArgs]) error {
					if runs.Add(1) == 1 {
						// The effect is done; keep "running" past JobTimeout, ignoring the
						// cancelled context, until River's duplicate has been answered
						// (capped, so a failing test still ends).
						select {
						case <-duplicateAnswered:
						case <-time.After(waitCap):
						}
					}
					return nil
				}}
			workers := river.NewWorkers()
			pgidemriver.AddWorker(workers, mw, worker)
			newConfig := func() *river.Config {
				cfg := riverConfig(t, workers, mw)
				cfg.JobTimeout = time.Second
				cfg.RescueStuckJobsAfter = 2 * time.Second
				return cfg
			}

			// Client A works the job and takes no part in leader election, so no rescuer
			// runs yet.
			cfgA := newConfig()
			cfgA.LeaderElectionDisabled = true
			b.startClient(t, cfgA)
			id := b.insert(t, InvoiceArgs{OrderID: 9}, nil)
			b.waitRunningFor(t, id, 2*time.Second+200*time.Millisecond)

			// Client B becomes leader; its rescuer runs at once and makes the running job
			// available again, and a second execution of it starts beside the first.
			b.startClient(t, newConfig())
			if tc.policy == pgidem.InFlightRaise {
				snoozed := outs.waitFor(t, pgidemriver.ActionSnoozed)
				require.Equal(t, id, snoozed.Job.ID)
				require.Positive(t, snoozed.Snooze)
				require.Equal(t, pgidem.OutcomeInProgress, snoozed.Outcome)
				// Release the first run only once River has written the snooze, so the
				// first run's completion finds the job no longer running and the next
				// delivery is the one that completes it, by replaying.
				b.waitJob(t, id, rivertype.JobStateAvailable, rivertype.JobStateScheduled)
			} else {
				b.waitEvent(t, pgidem.EventWaited)
			}
			close(duplicateAnswered)

			job := b.waitJob(t, id, rivertype.JobStateCompleted)
			replayed := outs.waitFor(t, pgidemriver.ActionReplayed)
			require.Equal(t, id, replayed.Job.ID)
			require.Equal(t, tc.policy == pgidem.InFlightWait, replayed.Waited)
			wantReplay := pgidem.OutcomeReplayed
			if tc.policy == pgidem.InFlightWait {
				wantReplay = pgidem.OutcomeWaitedReplayed
			}
			require.Equal(t, wantReplay, replayed.Outcome, "the action says replayed; pgidem's outcome says how")

			require.EqualValues(t, 1, runs.Load(), "the worker body ran once")
			require.Equal(t, 1, b.effects(t), "the effect ran once")
			var executed *pgidemriver.Outcome
			for _, o := range outs.list() {
				if o.Action == pgidemriver.ActionExecuted {
					require.Nil(t, executed, "only one execution ran the worker")
					executed = &o
				}
			}
			require.NotNil(t, executed)
			require.Equal(t, pgidem.OutcomeExecuted, executed.Outcome)
			require.EqualValues(t, 1, mw.Stats().Outcomes[pgidem.OutcomeExecuted], "Stats count by pgidem's outcome too")
			require.JSONEq(t, string(executed.Output), string(replayed.Output), "the duplicate returns the first run's receipt")
			require.JSONEq(t, string(executed.Output), string(job.Output()))
			rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-9.invoice")
			require.NoError(t, err)
			require.Equal(t, pgidem.StatusCompleted, rec.Status)
			require.Equal(t, 1, rec.Attempts)
		})
	}
}

func (b *bundle) waitEvent(t *testing.T, kind pgidem.EventKind) {
	t.Helper()
	timer := time.NewTimer(waitCap)
	defer timer.Stop()
	for b.events.get(kind) == 0 {
		select {
		case <-b.events.notify:
		case <-timer.C:
			t.Fatalf("no %s event after %s", kind, waitCap)
		}
	}
}

// TestTwoJobsOneEffect: two jobs carrying the same effect key run the effect once; two
// jobs of a kind without a key fall back to the job id and run it twice — the documented
// limit of a job-id key.
func TestTwoJobsOneEffect(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: b.db.Pool})
	pgidemriver.AddWorker(workers, mw, &effectWorker[PlainArgs]{pool: b.db.Pool})
	b.startClient(t, riverConfig(t, workers, mw))

	ids := []int64{
		b.insert(t, InvoiceArgs{OrderID: 9}, nil),
		b.insert(t, InvoiceArgs{OrderID: 9}, nil),
		b.insert(t, PlainArgs{OrderID: 9}, nil),
		b.insert(t, PlainArgs{OrderID: 9}, nil),
	}
	for _, id := range ids {
		b.waitJob(t, id, rivertype.JobStateCompleted)
	}

	var keyed, byJobID int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx,
		`SELECT count(*) FILTER (WHERE key = 'order-9.invoice'), count(*) FILTER (WHERE key LIKE 'job-%') FROM effects`).
		Scan(&keyed, &byJobID))
	require.Equal(t, 1, keyed, "same effect key: once")
	require.Equal(t, 2, byJobID, "job-id fallback: once per job, so twice")
	require.EqualValues(t, 2, mw.Stats().JobIDKeys)
	for _, o := range outs.list() {
		if o.Job.Kind == (PlainArgs{}).Kind() {
			require.Equal(t, pgidemriver.KeySourceJobID, o.KeySource)
		} else {
			require.Equal(t, pgidemriver.KeySourceArgs, o.KeySource)
		}
	}
}

// TestFailingWorkerReleases: a worker error releases the reservation and reaches River
// unchanged; River's retry runs the effect, which is recorded once.
func TestFailingWorkerReleases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	errSMTP := errors.New("smtp: connection refused")
	worker := &effectWorker[InvoiceArgs]{pool: b.db.Pool,
		before: func(_ context.Context, job *river.Job[InvoiceArgs]) error {
			if job.Attempt == 1 {
				return errSMTP
			}
			return nil
		}}
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, worker)
	b.startClient(t, riverConfig(t, workers, mw))

	id := b.insert(t, InvoiceArgs{OrderID: 9}, nil)
	job := b.waitJob(t, id, rivertype.JobStateCompleted)

	require.Equal(t, 2, job.Attempt)
	require.Len(t, job.Errors, 1)
	require.Equal(t, errSMTP.Error(), job.Errors[0].Error, "the worker's error reaches River unchanged")
	released := outs.waitFor(t, pgidemriver.ActionReleased)
	require.Same(t, errSMTP, released.Err)
	require.Equal(t, pgidem.OutcomeExecuted, released.Outcome, "pgidem ran fn and released the record after its error")
	require.Equal(t, 1, b.effects(t))
	rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-9.invoice")
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.Equal(t, 1, rec.Attempts, "the released reservation left no trace")
	var stored struct {
		JobID   int64 `json:"job_id"`
		Attempt int   `json:"attempt"`
	}
	require.NoError(t, json.Unmarshal(rec.Result, &stored))
	require.Equal(t, id, stored.JobID)
	require.Equal(t, 2, stored.Attempt)
}

// TestSnoozeKeepsAttempts: a job whose key is in progress elsewhere is snoozed, which uses
// no attempt; once the holder completes, the job replays its result without running.
func TestSnoozeKeepsAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t)
	// A long minimum snooze keeps the job parked long enough to read its row.
	mw, outs := b.newMiddleware(t, &pgidemriver.Config{SnoozeMin: 3 * time.Second})
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: b.db.Pool})
	b.startClient(t, riverConfig(t, workers, mw))

	// Someone else (another process, say) holds the key.
	holding, release := make(chan struct{}), make(chan struct{})
	holderDone := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail.invoice", "order-9.invoice", testTTL, nil,
			func(context.Context) (map[string]any, error) {
				close(holding)
				<-release
				return map[string]any{"output": "em_elsewhere"}, nil
			})
		holderDone <- err
	}()
	<-holding

	id := b.insert(t, InvoiceArgs{OrderID: 9}, nil)
	snoozed := outs.waitFor(t, pgidemriver.ActionSnoozed)
	require.Equal(t, pgidem.OutcomeInProgress, snoozed.Outcome)
	parked := b.waitJob(t, id, rivertype.JobStateAvailable, rivertype.JobStateScheduled)
	require.Equal(t, 0, parked.Attempt, "a snooze gives the attempt back")
	require.Empty(t, parked.Errors)
	var meta struct {
		Snoozes int `json:"snoozes"`
	}
	require.NoError(t, json.Unmarshal(parked.Metadata, &meta))
	require.Positive(t, meta.Snoozes)

	close(release)
	require.NoError(t, <-holderDone)
	job := b.waitJob(t, id, rivertype.JobStateCompleted)
	require.Equal(t, 1, job.Attempt, "the snoozes used no attempt")
	require.Empty(t, job.Errors)
	require.Equal(t, 0, b.effects(t), "the worker never ran; the holder's result was replayed")
	require.JSONEq(t, `"em_elsewhere"`, string(job.Output()))
}

// Wait is bounded by WaitTimeout; then the job snoozes for the holder's remaining lease,
// clamped to SnoozeMax (a huge lease gives SnoozeMax, positive), and the worker does not run.
func TestWaitBoundedThenSnooze(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, &pgidemriver.Config{InFlight: pgidem.InFlightWait, WaitTimeout: 200 * time.Millisecond})
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts,
		lease_expires_at, expires_at) VALUES ('mail.invoice', 'order-5.invoice', 'in_progress', gen_random_uuid(), 1,
		now() + interval '10 years', now() + interval '10 years')`)
	require.NoError(t, err)

	var ran atomic.Bool
	err = mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":5}`), func(context.Context) error { ran.Store(true); return nil })
	var snooze *rivertype.JobSnoozeError
	require.ErrorAs(t, err, &snooze)
	require.Equal(t, pgidemriver.SnoozeMaxDefault, snooze.Duration)
	require.False(t, ran.Load())
	out := outs.list()
	require.Len(t, out, 1)
	require.True(t, out[0].Waited)
	require.Equal(t, pgidemriver.ActionSnoozed, out[0].Action)
}

// The middleware registered twice around one job (globally and on the worker) runs the
// worker once: the inner registration sees the outer reservation for the job and passes
// straight through, and only the outer one reports.
func TestDoubleRegistrationRunsOnce(t *testing.T) {
	t.Parallel()

	t.Run("Direct", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		mw, outs := b.invoiceMiddleware(t, nil)
		job := jobRow(1, "mail.invoice", `{"order_id":3}`)

		var runs atomic.Int32
		worker := func(ctx context.Context) error {
			_, key, ok := pgidem.KeyFromContext(ctx)
			require.True(t, ok)
			require.Equal(t, "order-3.invoice", key)
			runs.Add(1)
			return nil
		}
		err := mw.Work(b.ctx, job, func(ctx context.Context) error { return mw.Work(ctx, job, worker) })
		require.NoError(t, err)
		require.EqualValues(t, 1, runs.Load(), "the worker must run once, not be snoozed by its own reservation")
		out := outs.list()
		require.Len(t, out, 1, "only the outer registration reports")
		require.Equal(t, pgidemriver.ActionExecuted, out[0].Action)
		require.EqualValues(t, 1, mw.Stats().Executed)

		// Another job with the same key under the outer reservation is not passed through.
		other := jobRow(2, "mail.invoice", `{"order_id":3}`)
		err = mw.Work(b.ctx, jobRow(3, "mail.invoice", `{"order_id":30}`), func(ctx context.Context) error {
			return mw.Work(ctx, other, worker)
		})
		require.NoError(t, err, "the inner job replays order-3")
		require.EqualValues(t, 1, runs.Load())
	})

	t.Run("RiverClient", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		mw, outs := b.newMiddleware(t, nil)
		workers := river.NewWorkers()
		pgidemriver.AddWorker(workers, mw, &selfMiddlewareWorker{effectWorker: &effectWorker[InvoiceArgs]{pool: b.db.Pool}, mw: mw})
		b.startClient(t, riverConfig(t, workers, mw))

		id := b.insert(t, InvoiceArgs{OrderID: 11}, nil)
		b.waitJob(t, id, rivertype.JobStateCompleted)
		require.Equal(t, 1, b.effects(t))
		out := outs.list()
		require.Len(t, out, 1)
		require.Equal(t, pgidemriver.ActionExecuted, out[0].Action)
	})

	t.Run("ExcludedKind", func(t *testing.T) {
		// A skipped kind is reported once too, by the outer registration.
		t.Parallel()
		b := setup(t)
		mw, outs := b.newMiddleware(t, &pgidemriver.Config{ExcludeKinds: []string{"mail.invoice"}})
		job := jobRow(1, "mail.invoice", `{"order_id":3}`)
		var runs atomic.Int32
		err := mw.Work(b.ctx, job, func(ctx context.Context) error {
			return mw.Work(ctx, job, func(context.Context) error { runs.Add(1); return nil })
		})
		require.NoError(t, err)
		require.EqualValues(t, 1, runs.Load())
		out := outs.list()
		require.Len(t, out, 1, "only the outer registration reports")
		require.Equal(t, pgidemriver.ActionSkipped, out[0].Action)
		require.EqualValues(t, 1, mw.Stats().Skipped)
	})
}

// selfMiddlewareWorker also returns the middleware from its Middleware method.
type selfMiddlewareWorker struct {
	*effectWorker[InvoiceArgs]
	mw *pgidemriver.Middleware
}

func (w *selfMiddlewareWorker) Middleware(*rivertype.JobRow) []rivertype.WorkerMiddleware {
	return []rivertype.WorkerMiddleware{w.mw}
}

// The worker's context is cancelled by the job's context (River's JobTimeout, a client
// stopping), also after the reservation step's budget has passed.
func TestJobContextCancelsWorkerPastSQLTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, _ := b.invoiceMiddleware(t, &pgidemriver.Config{SQLTimeout: 200 * time.Millisecond})

	jobCtx, cancel := context.WithCancelCause(b.ctx)
	defer cancel(nil)
	stop := fmt.Errorf("client stopping")
	err := mw.Work(jobCtx, jobRow(1, "mail.invoice", `{"order_id":8}`), func(ctx context.Context) error {
		time.Sleep(400 * time.Millisecond)
		require.NoError(t, ctx.Err())
		cancel(stop)
		<-ctx.Done()
		return context.Cause(ctx)
	})
	require.ErrorIs(t, err, stop)
	_, err = b.coord.Lookup(b.ctx, "mail.invoice", "order-8.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
}

// A reservation step that exceeds Config.SQLTimeout fails the job with an error naming the
// field and matching context.DeadlineExceeded; the worker does not run and no reservation
// is left behind.
func TestSQLTimeoutBoundsReservation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.invoiceMiddleware(t, &pgidemriver.Config{SQLTimeout: time.Nanosecond})

	var ran atomic.Bool
	err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":4}`), func(context.Context) error { ran.Store(true); return nil })
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, "Config.SQLTimeout")
	require.False(t, ran.Load())
	require.Equal(t, pgidemriver.ActionError, outs.list()[0].Action)
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_record`).Scan(&n))
	require.Zero(t, n)
}

// A huge WaitTimeout or SQLTimeout ("as long as it takes") under InFlightWait does not
// wrap the reservation budget negative (a timer that fired at once would never start a
// worker): the budget saturates.
func TestHugeTimeoutsUnderWait(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]pgidemriver.Config{
		"WaitTimeout": {InFlight: pgidem.InFlightWait, WaitTimeout: math.MaxInt64},
		"SQLTimeout":  {InFlight: pgidem.InFlightWait, SQLTimeout: math.MaxInt64},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			mw, _ := b.invoiceMiddleware(t, &cfg)
			ran := false
			err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { ran = true; return nil })
			require.NoError(t, err)
			require.True(t, ran)
			require.EqualValues(t, 1, mw.Stats().Executed)
		})
	}
}
