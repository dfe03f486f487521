package pgidemriver_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

const shipmentsSchema = `CREATE TABLE shipments (id bigserial PRIMARY KEY, order_id bigint NOT NULL, job_id bigint NOT NULL)`

// ShipArgs ship an order: a database effect (a shipments row).
type ShipArgs struct {
	OrderID int64 `json:"order_id"`
}

func (ShipArgs) Kind() string { return "order.ship" }

// shipWorker writes the shipment, its pgidem record and the job's completion in one
// transaction: its own through WorkInTx, or, when begin is set, one it begins and commits
// around WorkTx (begin may be a pool's or a test transaction's Begin).
type shipWorker struct {
	river.WorkerDefaults[ShipArgs]
	coord *pgidem.Coordinator
	begin func(ctx context.Context) (pgx.Tx, error) // nil: WorkInTx
	opts  *pgidem.DoOpts                            // nil: the coordinator's
	inTx  func(ctx context.Context, jobID int64)    // nil: none; called inside the transaction after the shipment row
	errs  chan error                                // nil: none; receives each WorkTx error
}

func (w *shipWorker) Work(ctx context.Context, job *river.Job[ShipArgs]) error {
	key := fmt.Sprintf("order-%d.ship", job.Args.OrderID)
	fn := func(ctx context.Context, tx pgx.Tx) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, "INSERT INTO shipments (order_id, job_id) VALUES ($1, $2) RETURNING id", job.Args.OrderID, job.ID).Scan(&id)
		if err == nil && w.inTx != nil {
			w.inTx(ctx, job.ID)
		}
		return id, err
	}
	var err error
	if w.begin == nil {
		_, err = pgidemriver.WorkInTx(ctx, w.coord, job, "orders", key, testTTL, w.opts, fn)
	} else {
		err = w.workTx(ctx, job, key, fn)
	}
	if w.errs != nil {
		w.errs <- err
	}
	return err
}

// workTx is the pattern WorkTx's docs show: commit when ShouldCommit says so.
func (w *shipWorker) workTx(ctx context.Context, job *river.Job[ShipArgs], key string, fn func(context.Context, pgx.Tx) (int64, error)) error {
	tx, err := w.begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // a no-op after commit
	_, err = pgidemriver.WorkTx(ctx, w.coord, tx, job, "orders", key, testTTL, w.opts, fn)
	if !pgidemriver.ShouldCommit(err) {
		return err
	}
	if cerr := tx.Commit(ctx); cerr != nil {
		return cerr
	}
	return err
}

// state reads the three things WorkTx commits together.
func (b *bundle) shipState(t *testing.T, jobID int64) (shipments int, record bool, jobState rivertype.JobState) {
	t.Helper()
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT
		(SELECT count(*) FROM shipments),
		EXISTS (SELECT 1 FROM pgidem_record WHERE namespace = 'orders' AND key = 'order-9.ship' AND status = 'completed'),
		(SELECT state::text FROM river_job WHERE id = $1)`, jobID).Scan(&shipments, &record, &jobState))
	return shipments, record, jobState
}

// shipModes are the two ways of running shipWorker: WorkInTx, and WorkTx in a transaction
// the worker begins on the pool.
var shipModes = []struct {
	name  string
	begin func(b *bundle) func(context.Context) (pgx.Tx, error)
}{
	{"WorkInTx", func(*bundle) func(context.Context) (pgx.Tx, error) { return nil }},
	{"WorkTx", func(b *bundle) func(context.Context) (pgx.Tx, error) { return b.db.Pool.Begin }},
}

// TestWorkTx: after success the business row, the record and the job's completion are
// all present (with WorkInTx and with WorkTx in the worker's own transaction); after a
// worker process is SIGKILLed mid-transaction all three are absent, and the rescued retry
// makes them present exactly once.
func TestWorkTx(t *testing.T) {
	t.Parallel()

	for _, mode := range shipModes {
		t.Run("Success"+mode.name, func(t *testing.T) {
			t.Parallel()
			testWorkTxSuccess(t, mode.begin)
		})
		t.Run("JobNoLongerRunning"+mode.name, func(t *testing.T) {
			t.Parallel()
			testWorkTxJobNoLongerRunning(t, mode.begin, rivertype.JobStateDiscarded)
		})
	}

	// A parallel execution snoozed the job (river.JobSnooze writes it scheduled) while
	// this one was in its transaction: River runs it again, so it is no error to log.
	t.Run("JobSnoozedMeanwhile", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
		require.NoError(t, err)
		var logs syncBuffer
		coord, err := pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{Lease: testLease, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		require.NoError(t, err)
		errs := make(chan error, 4)
		var snoozed atomic.Bool
		workers := river.NewWorkers()
		river.AddWorker(workers, &shipWorker{coord: coord, begin: b.db.Pool.Begin, errs: errs, inTx: func(ctx context.Context, jobID int64) {
			if snoozed.CompareAndSwap(false, true) {
				_, err := b.db.Pool.Exec(ctx, "UPDATE river_job SET state = 'scheduled', scheduled_at = now() + interval '200 milliseconds' WHERE id = $1", jobID)
				require.NoError(t, err)
			}
		}})
		b.startClient(t, riverConfig(t, workers))
		id := b.insert(t, ShipArgs{OrderID: 9}, nil)
		require.ErrorIs(t, <-errs, pgidemriver.ErrJobNotRunning)
		b.waitJob(t, id, rivertype.JobStateCompleted)
		shipments, record, _ := b.shipState(t, id)
		require.Equal(t, 1, shipments)
		require.True(t, record)
		require.NotContains(t, logs.String(), "will not run again")
	})

	// Parked as pending meanwhile: River does not run it again by itself either.
	t.Run("JobPendingMeanwhile", func(t *testing.T) {
		t.Parallel()
		testWorkTxJobNoLongerRunning(t, shipModes[1].begin, rivertype.JobStatePending)
	})

	t.Run("CrashMidTransaction", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
		require.NoError(t, err)
		id := b.insert(t, ShipArgs{OrderID: 9}, nil)

		runChildUntil(t, b.db.URL, "in tx")
		shipments, record, state := b.shipState(t, id)
		require.Zero(t, shipments, "the shipment rolled back with the killed session")
		require.False(t, record, "no record")
		require.Equal(t, rivertype.JobStateRunning, state, "no completion: River still thinks it runs")

		workers := river.NewWorkers()
		river.AddWorker(workers, &shipWorker{coord: b.coord})
		cfg := riverConfig(t, workers)
		cfg.JobTimeout = 500 * time.Millisecond
		cfg.RescueStuckJobsAfter = time.Second
		b.waitRunningFor(t, id, cfg.RescueStuckJobsAfter+200*time.Millisecond)
		b.startClient(t, cfg)
		job := b.waitJob(t, id, rivertype.JobStateCompleted)
		// The crashed attempt counted; a loaded machine may need a third past the short
		// JobTimeout, which changes nothing below: the shipment is written once.
		require.GreaterOrEqual(t, job.Attempt, 2)
		shipments, record, _ = b.shipState(t, id)
		require.Equal(t, 1, shipments)
		require.True(t, record)
	})
}

func testWorkTxSuccess(t *testing.T, begin func(b *bundle) func(context.Context) (pgx.Tx, error)) {
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
	require.NoError(t, err)
	workers := river.NewWorkers()
	river.AddWorker(workers, &shipWorker{coord: b.coord, begin: begin(b)})
	b.startClient(t, riverConfig(t, workers))

	id := b.insert(t, ShipArgs{OrderID: 9}, nil)
	second := b.insert(t, ShipArgs{OrderID: 9}, nil) // a second job for the same shipment
	b.waitJob(t, id, rivertype.JobStateCompleted)
	b.waitJob(t, second, rivertype.JobStateCompleted)
	shipments, record, state := b.shipState(t, id)
	require.Equal(t, 1, shipments, "one shipment for two jobs")
	require.True(t, record)
	require.Equal(t, rivertype.JobStateCompleted, state)
}

// testWorkTxJobNoLongerRunning: River's rescuer discards (or makes retryable) a job that
// still runs, or someone parks it (pending); WorkTx must not commit the effect without the
// completion River then refuses, and says at error that the job will not run again.
func testWorkTxJobNoLongerRunning(t *testing.T, begin func(b *bundle) func(context.Context) (pgx.Tx, error), state rivertype.JobState) {
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
	require.NoError(t, err)
	errs := make(chan error, 1)
	var logs syncBuffer
	coord, err := pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{Lease: testLease, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	workers := river.NewWorkers()
	river.AddWorker(workers, &shipWorker{coord: coord, begin: begin(b), errs: errs, inTx: func(ctx context.Context, jobID int64) {
		_, err := b.db.Pool.Exec(ctx, `UPDATE river_job SET state = $2::text::river_job_state,
			finalized_at = CASE WHEN $2::text = 'discarded' THEN now() END WHERE id = $1`, jobID, string(state))
		require.NoError(t, err)
	}})
	b.startClient(t, riverConfig(t, workers))

	id := b.insert(t, ShipArgs{OrderID: 9}, nil)
	select {
	case err := <-errs:
		require.ErrorIs(t, err, pgidemriver.ErrJobNotRunning)
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not run")
	}
	shipments, record, jobState := b.shipState(t, id)
	require.Zero(t, shipments, "the shipment rolled back")
	require.False(t, record, "no record")
	require.Equal(t, state, jobState)
	// River drops the error of a job it no longer runs: the log is where this shows.
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "will not run again")
}

// WorkInTx keeps a fresh permanent failure although fn's error wraps pgidem errors of its
// own (a nested call's replayed failure, a store error, a refusal, an in-progress answer):
// whether the failure was stored is pgidem's answer, not a guess from fn's error chain, so
// the next job replays the failure instead of running fn again.
func TestWorkInTxKeepsFreshFailure(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for i, inner := range []error{
		&pgidem.StoredFailureError{Namespace: "streets", Key: "s-1", Message: "no such street"},
		&pgidem.StoreError{Op: "lookup", Err: errors.New("injected")},
		// A nested call's refusal or in-progress answer, judged permanent by fn: these used
		// to be taken for WorkTx's own (returned as is, or snoozed), and the stored failure
		// rolled back, so River retried fn until it discarded the job.
		pgidem.ErrInvalidArgument,
		&pgidem.InProgressError{Namespace: "streets", Key: "s-1", RetryAfter: time.Second},
	} {
		key := fmt.Sprintf("order-%d.ship", 30+i)
		runs := 0
		for job := range 2 {
			// The permanent path never reaches the job's completion, so a job row is not
			// needed: WorkInTx is called directly.
			j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: int64(100*i + job), Kind: "order.ship", State: rivertype.JobStateRunning}}
			_, err := pgidemriver.WorkInTx(b.ctx, b.coord, j, "orders", key, testTTL, nil,
				func(context.Context, pgx.Tx) (int, error) {
					runs++
					return 0, pgidem.Permanent(fmt.Errorf("validate address: %w", inner))
				})
			var cancel *river.JobCancelError
			require.ErrorAs(t, err, &cancel, "case %d job %d", i, job)
			require.ErrorIs(t, err, pgidem.ErrPermanent, "case %d job %d", i, job)
		}
		require.Equal(t, 1, runs, "case %d: the second job replays the stored failure", i)
		rec, err := b.coord.Lookup(b.ctx, "orders", key)
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusFailed, rec.Status, "case %d", i)
	}
}

// fn's error that matches pgidem.ErrPermanent only through a failure a nested pgidem call
// replayed is an ordinary error: DoTx stores nothing, WorkTx returns it unchanged (not a
// JobCancel, which would make River drop the job while nothing was stored), ShouldCommit
// says roll back, and the next job runs fn again.
func TestWorkTxNestedReplayedFailureIsOrdinary(t *testing.T) {
	t.Parallel()
	b := setup(t)
	replayed := &pgidem.StoredFailureError{Namespace: "streets", Key: "s-2", Message: "no such street"}
	runs := 0
	for job := range 2 {
		j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: int64(200 + job), Kind: "order.ship", State: rivertype.JobStateRunning}}
		_, err := pgidemriver.WorkInTx(b.ctx, b.coord, j, "orders", "order-50.ship", testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) {
				runs++
				return 0, fmt.Errorf("validate address: %w", replayed)
			})
		require.ErrorIs(t, err, replayed, "job %d", job)
		var cancel *river.JobCancelError
		require.False(t, errors.As(err, &cancel), "job %d: not cancelled", job)
		require.False(t, pgidemriver.ShouldCommit(err), "job %d", job)
	}
	require.Equal(t, 2, runs, "nothing was stored, so the second job runs fn again")
	_, err := b.coord.Lookup(b.ctx, "orders", "order-50.ship")
	require.ErrorIs(t, err, pgidem.ErrNotFound)
}

// A fn that ends the transaction it was given has its Permanent error refused with the
// transaction: WorkTx says roll back (pgidem.ErrInvalidArgument), not commit and cancel,
// since fn's writes may already be in tx and nothing was recorded.
func TestWorkTxFnEndingTxRollsBack(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer tx.Rollback(b.ctx) //nolint:errcheck // the test's own
	j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: 300, Kind: "order.ship", State: rivertype.JobStateRunning}}
	_, err = pgidemriver.WorkTx(b.ctx, b.coord, tx, j, "orders", "order-60.ship", testTTL, nil,
		func(ctx context.Context, tx pgx.Tx) (int, error) {
			if err := tx.Rollback(ctx); err != nil {
				return 0, err
			}
			return 0, pgidem.Permanent(errors.New("out of stock"))
		})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorIs(t, err, pgidem.ErrPermanent, "fn's error is attached")
	require.False(t, errors.As(err, new(*river.JobCancelError)), "not cancelled: %v", err)
	require.False(t, pgidemriver.ShouldCommit(err))
}

func TestShouldCommit(t *testing.T) {
	t.Parallel()
	declined := pgidem.Permanent(errors.New("declined"))
	for _, c := range []struct {
		err  error
		want bool
	}{
		{nil, true},
		{river.JobCancel(declined), true},
		{fmt.Errorf("work: %w", river.JobCancel(errors.New("gone"))), true},
		{errors.New("timeout"), false},
		{declined, false}, // WorkTx never returns a bare Permanent error: it cancels
		{river.JobSnooze(time.Second), false},
		{&pgidem.StoredFailureError{Message: "nested"}, false},
	} {
		require.Equal(t, c.want, pgidemriver.ShouldCommit(c.err), "%v", c.err)
	}
}

// A replayed result that no longer decodes into T is not a stored failure: WorkTx returns
// it as an ordinary error (River retries), not a JobCancel.
func TestWorkTxReplayNotDecodable(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := pgidem.Do(b.ctx, b.coord, "orders", "order-60.ship", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: 300, Kind: "order.ship", State: rivertype.JobStateRunning}}
	_, err = pgidemriver.WorkInTx(b.ctx, b.coord, j, "orders", "order-60.ship", testTTL, nil,
		func(context.Context, pgx.Tx) (string, error) { t.Error("fn ran"); return "", nil })
	require.ErrorIs(t, err, pgidem.ErrReplayNotDecodable)
	var cancel *river.JobCancelError
	require.False(t, errors.As(err, &cancel))
	require.False(t, pgidemriver.ShouldCommit(err))

	// A decoder (the user's UnmarshalJSON) whose error wraps a pgidem verdict of its own:
	// still a result that does not decode, not DoTx's in-flight answer: a snooze would use
	// no attempt, so River would never give up on the job.
	_, err = pgidemriver.WorkInTx(b.ctx, b.coord, j, "orders", "order-60.ship", testTTL, nil,
		func(context.Context, pgx.Tx) (pickyReceipt, error) { t.Error("fn ran"); return pickyReceipt{}, nil })
	require.ErrorIs(t, err, pgidem.ErrReplayNotDecodable)
	require.False(t, errors.As(err, new(*river.JobSnoozeError)), "not snoozed: %v", err)
	require.False(t, pgidemriver.ShouldCommit(err))
}

// pickyReceipt refuses every stored value, with an error wrapping a pgidem type (one its
// own lookup returned, say).
type pickyReceipt struct{ ID int }

func (*pickyReceipt) UnmarshalJSON([]byte) error {
	return fmt.Errorf("receipt: validating: %w", &pgidem.InProgressError{Namespace: "other", Key: "k"})
}

// WorkTx under the middleware's own key is refused at once with pgidem's typed error and
// a hint at the fix; pgidem decides (so a coordinator on another named schema is not
// refused).
func TestWorkTxMiddlewareKey(t *testing.T) {
	t.Parallel()
	b := setup(t)
	mw, _ := b.invoiceMiddleware(t, nil)
	runs := 0
	err := mw.Work(b.ctx, jobRow(1, "mail.invoice", `{"order_id":70}`), func(ctx context.Context) error {
		j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: 1, Kind: "mail.invoice", State: rivertype.JobStateRunning}}
		_, err := pgidemriver.WorkInTx(ctx, b.coord, j, "mail.invoice", "order-70.invoice", testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) { runs++; return 1, nil })
		return err
	})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorContains(t, err, "Config.ExcludeKinds")
	require.Zero(t, runs)
}

// WorkInTx begins its transaction READ WRITE: on a pool whose sessions default to read-only
// transactions, the shipment, the record and the job's completion still commit together.
// No job fails with "the transaction is read-only".
func TestWorkInTxOnReadOnlyDefaultPool(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, shipmentsSchema)
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	readOnly, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(readOnly.Close)
	coord, err := pgidem.NewCoordinator(readOnly, &pgidem.Config{Lease: testLease, Logger: testLogger(t)})
	require.NoError(t, err)

	errs := make(chan error, 10)
	workers := river.NewWorkers()
	river.AddWorker(workers, &shipWorker{coord: coord, errs: errs})
	b.startClient(t, riverConfig(t, workers))
	id := b.insert(t, ShipArgs{OrderID: 9}, nil)
	select {
	case err := <-errs:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the job did not run")
	}
	b.waitJob(t, id, rivertype.JobStateCompleted)
	shipments, record, state := b.shipState(t, id)
	require.Equal(t, 1, shipments)
	require.True(t, record)
	require.Equal(t, rivertype.JobStateCompleted, state)
}

// sliceErr is an error whose values == cannot compare.
type sliceErr []error

func (e sliceErr) Error() string   { return "several" }
func (e sliceErr) Unwrap() []error { return e }

// codeErr is a comparable struct type whose field may hold a value == cannot compare.
type codeErr struct{ err error }

func (e codeErr) Error() string { return "code: " + e.err.Error() }
func (e codeErr) Unwrap() error { return e.err }

// fn's own errors are told from pgidem's even when == cannot compare them: an ordinary one
// comes back unchanged (the comparison does not panic), and a Permanent one inside
// such an error is stored and cancels the job whatever else it wraps.
func TestWorkTxUncomparableFnErrors(t *testing.T) {
	t.Parallel()
	b := setup(t)
	job := func(id int64) *river.Job[ShipArgs] {
		return &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: id, Kind: "order.ship", State: rivertype.JobStateRunning}}
	}

	ordinary := codeErr{err: sliceErr{errors.New("a"), errors.New("b")}}
	_, err := pgidemriver.WorkInTx(b.ctx, b.coord, job(400), "orders", "order-70.ship", testTTL, nil,
		func(context.Context, pgx.Tx) (int, error) { return 0, ordinary })
	require.Equal(t, ordinary.Error(), err.Error())
	require.False(t, pgidemriver.ShouldCommit(err))

	for i, inner := range []error{pgidem.ErrInvalidArgument, &pgidem.InProgressError{Namespace: "s", Key: "k", RetryAfter: time.Second}} {
		key := fmt.Sprintf("order-%d.ship", 71+i)
		_, err := pgidemriver.WorkInTx(b.ctx, b.coord, job(int64(401+i)), "orders", key, testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) {
				return 0, sliceErr{pgidem.Permanent(errors.New("declined")), inner}
			})
		require.ErrorAs(t, err, new(*river.JobCancelError), "case %d: %v", i, err)
		rec, err := b.coord.Lookup(b.ctx, "orders", key)
		require.NoError(t, err, "case %d: the failure was stored and kept", i)
		require.Equal(t, pgidem.StatusFailed, rec.Status)
	}
}

// A Permanent failure pgidem could not store cancels the job like a stored one, also when
// fn's error wraps a refusal or an in-progress answer of a nested call, which are not
// taken for WorkTx's own (returned bare, or snoozed).
func TestWorkTxFailureNotStored(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := b.db.Pool.Exec(b.ctx, `
CREATE FUNCTION refuse_failed() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RAISE EXCEPTION 'injected'; END$$;
CREATE TRIGGER refuse_failed BEFORE INSERT OR UPDATE ON pgidem_record
	FOR EACH ROW WHEN (NEW.status = 'failed') EXECUTE FUNCTION refuse_failed()`)
	require.NoError(t, err)
	for i, inner := range []error{errors.New("plain"), pgidem.ErrInvalidArgument, &pgidem.InProgressError{Namespace: "s", Key: "k", RetryAfter: time.Second}} {
		tx, err := b.db.Pool.Begin(b.ctx)
		require.NoError(t, err)
		j := &river.Job[ShipArgs]{JobRow: &rivertype.JobRow{ID: int64(500 + i), Kind: "order.ship", State: rivertype.JobStateRunning}}
		_, err = pgidemriver.WorkTx(b.ctx, b.coord, tx, j, "orders", fmt.Sprintf("order-%d.ship", 80+i), testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) {
				return 0, pgidem.Permanent(fmt.Errorf("validate: %w", inner))
			})
		require.NoError(t, tx.Rollback(b.ctx))
		require.ErrorAs(t, err, new(*pgidem.FailureNotStoredError), "case %d", i)
		require.ErrorAs(t, err, new(*river.JobCancelError), "case %d: %v", i, err)
	}
}
