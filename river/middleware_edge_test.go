package pgidemriver_test

// Edge cases of the middleware, most by calling Middleware.Work directly with a job row
// (real Postgres, no client) so that the interleaving is deterministic.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

func jobRow(id int64, kind, args string) *rivertype.JobRow {
	return &rivertype.JobRow{ID: id, Kind: kind, EncodedArgs: []byte(args), Attempt: 1, State: rivertype.JobStateRunning}
}

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
// pgidem.ErrLeaseLost and River's retry replays or waits for the new holder's outcome. It
// used to be cancelled, reported as a stored failure. The worker's own river.JobCancel
// still passes through unchanged.
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

// AliasedInvoiceArgs is InvoiceArgs after a kind rename: jobs inserted under the old kind
// are still worked by the same worker.
type AliasedInvoiceArgs struct {
	OrderID int64 `json:"order_id"`
}

func (AliasedInvoiceArgs) Kind() string          { return "mail.invoice_v2" }
func (AliasedInvoiceArgs) KindAliases() []string { return []string{"mail.invoice_v1"} }
func (a AliasedInvoiceArgs) IdempotencyKey() string {
	return fmt.Sprintf("order-%d.invoice", a.OrderID)
}

// Jobs inserted under a kind alias share the canonical kind's namespace, so one effect
// runs once whatever kind name its jobs were inserted under; ExcludeKinds with the
// canonical kind covers the aliases too.
func TestKindAliasSharesNamespace(t *testing.T) {
	t.Parallel()
	b := setup(t)

	t.Run("OneEffect", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(AliasedInvoiceArgs{})
		var runs atomic.Int32
		doInner := func(context.Context) error { runs.Add(1); return nil }
		require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice_v1", `{"order_id":9}`), doInner))
		require.NoError(t, mw.Work(b.ctx, jobRow(2, "mail.invoice_v2", `{"order_id":9}`), doInner))
		require.EqualValues(t, 1, runs.Load(), "one effect key, one effect, whatever kind name the job was inserted under")
		out := outs.list()
		require.Len(t, out, 2)
		require.Equal(t, "mail.invoice_v2", out[0].Namespace)
		require.Equal(t, pgidemriver.ActionReplayed, out[1].Action)
		_, err := b.coord.Lookup(b.ctx, "mail.invoice_v2", "order-9.invoice")
		require.NoError(t, err)
	})

	t.Run("JobIDFallback", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, nil)
		mw.Register(AliasedPlainArgs{})
		require.NoError(t, mw.Work(b.ctx, jobRow(3, "mail.plain_v1", `{}`), func(context.Context) error { return nil }))
		require.Equal(t, "mail.plain_v2", outs.list()[0].Namespace)
	})

	t.Run("ExcludeKinds", func(t *testing.T) {
		mw, outs := b.newMiddleware(t, &pgidemriver.Config{ExcludeKinds: []string{"mail.invoice_v2"}})
		mw.Register(AliasedInvoiceArgs{})
		require.NoError(t, mw.Work(b.ctx, jobRow(4, "mail.invoice_v1", `{"order_id":10}`), func(context.Context) error { return nil }))
		require.Equal(t, pgidemriver.ActionSkipped, outs.list()[0].Action)
	})
}

// AliasedPlainArgs name no effect and were renamed.
type AliasedPlainArgs struct{}

func (AliasedPlainArgs) Kind() string          { return "mail.plain_v2" }
func (AliasedPlainArgs) KindAliases() []string { return []string{"mail.plain_v1"} }

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
		// A skipped kind is reported once too (it used to be reported by both).
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

// Every way of failing to find a valid key returns an error and never runs the worker
// unprotected.
func TestNoValidKeyNeverRunsWorker(t *testing.T) {
	t.Parallel()
	b := setup(t)
	keyed, _ := b.newMiddleware(t, nil)
	keyed.Register(InvoiceArgs{}, LongNamespaceArgs{})
	badFunc, _ := b.newMiddleware(t, &pgidemriver.Config{
		KeyFunc: func(job *rivertype.JobRow) (string, string, bool) { return "", "bad\x01key", true },
	})
	for _, tc := range []struct {
		name string
		mw   *pgidemriver.Middleware
		job  *rivertype.JobRow
		want error // nil: any error
	}{
		{"ArgsNotJSON", keyed, jobRow(1, "mail.invoice", `not json`), nil},
		{"ArgsWrongType", keyed, jobRow(2, "mail.invoice", `{"order_id":"seven"}`), nil},
		{"ArgsArray", keyed, jobRow(3, "mail.invoice", `[1,2]`), nil},
		{"NulKey", keyed, jobRow(4, "mail.invoice", `{"order_id":1,"nul_key":true}`), pgidem.ErrInvalidKey},
		{"LongNamespace", keyed, jobRow(5, "edge.longns", `{}`), pgidem.ErrInvalidKey},
		{"KeyFuncInvalid", badFunc, jobRow(6, "mail.plain", `{}`), pgidem.ErrInvalidKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ran atomic.Bool
			err := tc.mw.Work(b.ctx, tc.job, func(context.Context) error { ran.Store(true); return nil })
			require.Error(t, err)
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
			}
			require.False(t, ran.Load(), "never run the worker unprotected")
		})
	}
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_record`).Scan(&n))
	require.Zero(t, n)
}

// LongNamespaceArgs choose a namespace above the 64-byte limit.
type LongNamespaceArgs struct{}

func (LongNamespaceArgs) Kind() string                 { return "edge.longns" }
func (LongNamespaceArgs) IdempotencyKey() string       { return "k" }
func (LongNamespaceArgs) IdempotencyNamespace() string { return strings.Repeat("n", 65) }

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

// The job-id fallback is counted per execution and logged once per kind, under concurrent
// executions and concurrent Register calls (run with -race).
func TestJobIDFallbackConcurrent(t *testing.T) {
	t.Parallel()
	b := setup(t)
	logs := &fallbackLogCounter{}
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{Logger: slog.New(logs)})
	require.NoError(t, err)

	const kinds, perKind = 4, 8
	var wg sync.WaitGroup
	var runs atomic.Int32
	for i := range kinds * perKind {
		wg.Go(func() {
			job := jobRow(int64(i+1), fmt.Sprintf("edge.kind%d", i%kinds), `{}`)
			if err := mw.Work(b.ctx, job, func(context.Context) error { runs.Add(1); return nil }); err != nil {
				t.Error(err)
			}
		})
		wg.Go(func() { mw.Register(PlainArgs{}) })
	}
	wg.Wait()
	require.EqualValues(t, kinds*perKind, runs.Load())
	require.EqualValues(t, kinds*perKind, mw.Stats().JobIDKeys)
	require.EqualValues(t, kinds, logs.warnings.Load(), "logged once per kind")
}

type fallbackLogCounter struct{ warnings atomic.Int64 }

func (h *fallbackLogCounter) Enabled(context.Context, slog.Level) bool { return true }
func (h *fallbackLogCounter) Handle(_ context.Context, r slog.Record) error {
	if r.Level == slog.LevelWarn && strings.Contains(r.Message, "using the job id") {
		h.warnings.Add(1)
	}
	return nil
}
func (h *fallbackLogCounter) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *fallbackLogCounter) WithGroup(string) slog.Handler      { return h }

// failCompletions makes every completing write of a record fail, as a store outage that
// outlasts the finishing write's retries would.
// failCompletions makes every write that completes or fails a record fail, until the time
// in the one-row table outage (default: forever).
func failCompletions(t *testing.T, b *bundle) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `
CREATE TABLE outage (until timestamptz NOT NULL);
INSERT INTO outage VALUES ('infinity');
CREATE FUNCTION fail_completion() RETURNS trigger LANGUAGE plpgsql AS
	$$BEGIN IF clock_timestamp() < (SELECT until FROM outage) THEN RAISE EXCEPTION 'injected outage'; END IF; RETURN NEW; END$$;
CREATE TRIGGER fail_completion BEFORE UPDATE ON pgidem_record
	FOR EACH ROW WHEN (NEW.status <> 'in_progress') EXECUTE FUNCTION fail_completion()`)
	require.NoError(t, err)
}

// When the record cannot be completed after the worker ran, the middleware says so: a
// successful worker is an executed outcome flagged RecordNotCompleted (the job completes;
// nothing was released), and a permanent failure still cancels the job but with an error
// saying the failure was not stored. Both used to be reported as if the record had been
// written (released; cancelled with the worker's error alone).
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
// retry: the job completes although its record could not be completed. It used to fail, and
// each retry took the record over when its lease ended and ran the effect again (three
// effects for one 3 s outage).
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

// A worker that panics (River recovers the panic around the middleware chain) still gets
// an outcome and a count: released, since pgidem released the reservation; a panic
// before the worker (in the key method) is an error outcome. Both panics continue.
func TestPanicOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, nil)
	mw.Register(InvoiceArgs{}, PanickyKeyArgs{})

	require.PanicsWithValue(t, "boom", func() {
		_ = mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { panic("boom") })
	})
	out := outs.waitFor(t, pgidemriver.ActionReleased)
	require.ErrorContains(t, out.Err, "panicked: boom")
	_, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-1.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "the reservation was released")

	require.PanicsWithValue(t, "no key", func() {
		_ = mw.Work(b.ctx, jobRow(2, "edge.panickykey", `{}`), func(context.Context) error { return nil })
	})
	outs.waitFor(t, pgidemriver.ActionError)
	stats := mw.Stats()
	require.EqualValues(t, 1, stats.Released)
	require.EqualValues(t, 1, stats.Errors)
}

// PanickyKeyArgs panic when asked for their key.
type PanickyKeyArgs struct{}

func (PanickyKeyArgs) Kind() string           { return "edge.panickykey" }
func (PanickyKeyArgs) IdempotencyKey() string { panic("no key") }

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
	// replayed (River's errors column used to read the same as the first job's).
	err = mw.Work(b.ctx, jobRow(2, "mail.invoice", `{"order_id":3}`), func(context.Context) error {
		t.Error("the worker ran on a replay")
		return nil
	})
	require.ErrorAs(t, err, &cancel)
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.ErrorContains(t, err, "replayed the failure an earlier execution stored for mail.invoice/order-3.invoice: declined")
}

// PtrTTLArgs implement TTLArgs (and KeyArgs) with pointer receivers.
type PtrTTLArgs struct {
	OrderID int64 `json:"order_id"`
}

func (PtrTTLArgs) Kind() string                   { return "mail.ptr_ttl" }
func (a *PtrTTLArgs) IdempotencyKey() string      { return fmt.Sprintf("order-%d.ptr", a.OrderID) }
func (*PtrTTLArgs) IdempotencyTTL() time.Duration { return 60 * 24 * time.Hour }

// A TTLArgs method with a pointer receiver sets the record's TTL, as one with a value
// receiver does (the key method works either way, so the TTL method must too).
func TestTTLArgsPointerReceiver(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, _ := b.newMiddleware(t, nil)
	mw.Register(PtrTTLArgs{})
	require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.ptr_ttl", `{"order_id":5}`), func(context.Context) error { return nil }))
	var ttl time.Duration
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT expires_at - completed_at FROM pgidem_record
		WHERE namespace = 'mail.ptr_ttl' AND key = 'order-5.ptr'`).Scan(&ttl))
	require.Equal(t, 60*24*time.Hour, ttl)
}

// RenamedAgainArgs replace AliasedInvoiceArgs' type for kind mail.invoice_v2 with one that
// no longer answers to the old alias and names its effect differently.
type RenamedAgainArgs struct {
	OrderID int64 `json:"order_id"`
}

func (RenamedAgainArgs) Kind() string { return "mail.invoice_v2" }
func (a RenamedAgainArgs) IdempotencyKey() string {
	return fmt.Sprintf("order-%d.invoice-again", a.OrderID)
}

// Registering a kind again replaces the earlier type with its aliases: a job of the old
// alias is no longer decoded as the old type, and CheckTTL reports the kind once.
func TestRegisterAgainDropsOldAliases(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, outs := b.newMiddleware(t, &pgidemriver.Config{TTL: time.Hour})
	mw.Register(AliasedInvoiceArgs{})
	mw.Register(RenamedAgainArgs{})
	require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice_v1", `{"order_id":9}`), func(context.Context) error { return nil }))
	out := outs.list()[0]
	require.Equal(t, pgidemriver.KeySourceJobID, out.KeySource, "the old alias is no longer a registered kind")
	require.Equal(t, "mail.invoice_v1", out.Namespace)

	warnings := mw.CheckTTL(b.ctx, nil)
	var kinds []string
	for _, w := range warnings {
		kinds = append(kinds, w.Kind)
	}
	require.Equal(t, []string{"mail.invoice_v2"}, kinds)
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

// NewMiddleware refuses invalid settings with an error naming the field and matching
// pgidem.ErrInvalidArgument, and fills the documented defaults.
func TestNewMiddlewareValidates(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for field, config := range map[string]*pgidemriver.Config{
		"Config.TTL":         {TTL: 30 * time.Second}, // below the coordinator's MinTTL (1 minute)
		"Config.InFlight":    {InFlight: pgidem.InFlightPolicy(9)},
		"Config.WaitTimeout": {WaitTimeout: -1},
		"Config.SnoozeMin":   {SnoozeMin: -1},
		"Config.SnoozeMax":   {SnoozeMin: time.Second, SnoozeMax: time.Millisecond},
		"Config.SQLTimeout":  {SQLTimeout: -1},
	} {
		mw, err := pgidemriver.NewMiddleware(b.coord, config)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, field)
		require.ErrorContains(t, err, field)
		require.Nil(t, mw)
	}
	_, err := pgidemriver.NewMiddleware(nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

	mw, err := pgidemriver.NewMiddleware(b.coord, nil)
	require.NoError(t, err)
	cfg := mw.Config()
	require.Equal(t, pgidemriver.TTLDefault, cfg.TTL)
	require.Equal(t, pgidem.InFlightRaise, cfg.InFlight)
	require.Equal(t, pgidemriver.SnoozeMinDefault, cfg.SnoozeMin)
	require.Equal(t, pgidemriver.SnoozeMaxDefault, cfg.SnoozeMax)
	require.Equal(t, pgidemriver.SQLTimeoutDefault, cfg.SQLTimeout)
	mw, err = pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{SnoozeMin: 10 * time.Second})
	require.NoError(t, err)
	require.Equal(t, 10*time.Second, mw.Config().SnoozeMax, "the default SnoozeMax is at least SnoozeMin")
}

// The worker's own error may carry pgidem's errors from calls of its own (a nested Do that
// lost its lease, a WorkTx whose failure was not stored); they say nothing about the
// middleware's record. A permanent failure the middleware stored cancels the job and is
// not flagged RecordNotCompleted. It used to be retried as a lost lease, or flagged.
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
// the middleware's reservation is released and the error returned unchanged. It used to
// be taken for the middleware's own lost lease (ActionError, wrapped).
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
// own JobCancel passes through as a release). Both used to be reported cancelled, and the
// plain error was turned into a JobCancel, while the record was released.
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

// A worker that stops on its cancelled context after the lease was lost (returning
// ctx.Err(), as most workers do) fails its job with an error naming the lost lease, and
// the outcome is an error, not a release. River's errors column used to show a bare
// "context canceled", and the outcome counted as an ordinary release.
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
// it (River's errors column used to show a bare "context canceled"). (A check of the
// context's cause used to report a lost lease here.)
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

// workUntilCancelled works a mail.invoice job for orderID whose worker waits for its
// context to end and returns its error. running closes when the worker starts, cancelled
// when its context ended; errCh receives Work's error.
func workUntilCancelled(b *bundle, mw *pgidemriver.Middleware, orderID int) (running, cancelled chan struct{}, errCh chan error) {
	running, cancelled, errCh = make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		errCh <- mw.Work(b.ctx, jobRow(1, "mail.invoice", fmt.Sprintf(`{"order_id":%d}`, orderID)), func(ctx context.Context) error {
			close(running)
			defer close(cancelled)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(15 * testLease): // failure cap, not a timing assertion
				return errors.New("never cancelled")
			}
		})
	}()
	return running, cancelled, errCh
}

// A huge WaitTimeout or SQLTimeout ("as long as it takes") under InFlightWait used to wrap
// the reservation budget negative: the timer fired at once, no worker ever started, and
// every job failed. The budget now saturates.
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

// A Hook that panics is a metrics bug, not the job's: the panic is logged, the execution is
// counted once, and the job's result stands (it used to be counted as executed and as an
// error, and River got a panic for a job whose effect was recorded).
func TestHookPanicIsContained(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var logs syncBuffer
	var calls []pgidemriver.Action
	mw, err := pgidemriver.NewMiddleware(b.coord, &pgidemriver.Config{
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Hook: pgidemriver.HookFunc(func(_ context.Context, o *pgidemriver.Outcome) {
			calls = append(calls, o.Action)
			panic("metrics exporter bug")
		}),
	})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{})
	for range 2 {
		require.NotPanics(t, func() {
			require.NoError(t, mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":1}`), func(context.Context) error { return nil }))
		})
	}
	require.Equal(t, []pgidemriver.Action{pgidemriver.ActionExecuted, pgidemriver.ActionReplayed}, calls)
	stats := mw.Stats()
	require.EqualValues(t, 1, stats.Executed)
	require.EqualValues(t, 1, stats.Replayed)
	require.Zero(t, stats.Errors)
	require.Contains(t, logs.String(), "Hook.OnOutcome panicked")
	require.Contains(t, logs.String(), "metrics exporter bug")
}
