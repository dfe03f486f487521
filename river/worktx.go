package pgidemriver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// ErrJobNotRunning is matched (errors.Is) by the error of [WorkTx], [WorkInTx] and their
// Result forms when the job was no longer running at completion: its transaction must not
// (WorkTx) or did not (WorkInTx) commit.
var ErrJobNotRunning = errors.New("pgidemriver: job is no longer running")

// WorkTx makes a job's database effect exactly-once in the caller's transaction tx: it runs
// fn under (namespace, key) with [pgidem.DoTxResult] — fn's writes and the key's completed
// record — and marks the job completed in tx with river.JobCompleteTx. The caller commits.
// It is [WorkTxResult] without the detail; see there.
func WorkTx[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, tx pgx.Tx, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	res, err := WorkTxResult(ctx, c, tx, job, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// WorkTxResult runs a job's database effect and its completion in the caller's
// transaction tx and reports how the value was obtained. It runs fn under (namespace, key)
// with [pgidem.DoTxResult], then marks the job completed in tx with river.JobCompleteTx.
// Call it from a River worker's Work with the job River passed in. Commit tx when
// [ShouldCommit] says so, otherwise roll it back, and return its error from Work as is.
// The package documentation has an example and the guarantees ("Database effects:
// WorkTx"). [WorkInTx] is this with the transaction begun and ended for you.
//
// Errors (tx holds nothing to keep unless noted):
//   - an invalid key or TTL, as for [pgidem.DoTxResult]; a nil coordinator, tx or job, or
//     the key the [Middleware] holds for the job: [pgidem.ErrInvalidArgument]. fn does not run.
//   - fn's error, unchanged: fn's writes are undone and River retries the job (unless it
//     is fn's own river.JobSnooze or river.JobCancel, which River honours).
//   - a replayed result that does not decode into T: [pgidem.ErrReplayNotDecodable];
//     River retries, and a deploy that restores the type lets the job replay.
//   - the key held by another transaction: river.JobSnooze (no attempt used), the
//     retry-after clamped to [SnoozeMinDefault] and [SnoozeMaxDefault].
//   - a [pgidem.Permanent] error in fn's chain: the failure is written in tx and a
//     river.JobCancel wrapping it returned; commit tx, and River stops. Later jobs with the
//     key, and failures replayed or not stored, return the same with nothing to write.
//   - the job no longer running at completion: [ErrJobNotRunning]; roll back (see "WorkTx
//     and a job no longer running" in the package documentation).
//   - a database error: a [*pgidem.StoreError]; a failed completion: an error prefixed
//     "pgidemriver: ". River retries. Cancelling ctx returns ctx's error.
//
// tx must be on the coordinator's database and under READ COMMITTED. Because tx is the
// caller's, rivertest.Worker can test the worker: the job, rows and record roll back with
// the test's transaction. Safe for concurrent use on different transactions; a pgx.Tx
// itself is not.
func WorkTxResult[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, tx pgx.Tx, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (pgidem.Result[T], error) {
	res, _, err := workTx(ctx, c, tx, job, namespace, key, ttl, opts, fn)
	return res, err
}

// ShouldCommit reports whether a worker commits the transaction it gave [WorkTx] or
// [WorkTxResult] after they returned err. It is true for nil, and for an error wrapping a
// river.JobCancelError: a permanent failure written in the transaction or replayed, or fn's
// own cancel. River will not run that job again, and the transaction holds what should
// stay (the job's completion, the stored failure, the worker's own writes). False for any
// other error: roll back, and River runs the job again. Safe for concurrent use.
func ShouldCommit(err error) bool {
	return err == nil || errors.As(err, new(*river.JobCancelError))
}

// workTx is WorkTxResult. freshFailure reports that fn's permanent failure was written in
// tx just now, so committing tx keeps it. It is told from a replayed one, and from one that
// could not be stored, by pgidem's outcome, never by what fn's error may wrap.
func workTx[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, tx pgx.Tx, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (res pgidem.Result[T], freshFailure bool, err error) {
	if c == nil || tx == nil || job == nil {
		return res, false, invalid("WorkTx: coordinator, transaction and job must not be nil")
	}
	// fnErr is what fn itself returned, so that fn's own error is told from pgidem's by
	// where it came from, not by what it wraps: fn may wrap any pgidem sentinel.
	var fnErr error
	res, err = pgidem.DoTxResult(ctx, c, tx, namespace, key, ttl, opts, func(ctx context.Context, tx pgx.Tx) (T, error) {
		v, err := fn(ctx, tx)
		fnErr = err
		return v, err
	})
	if err != nil {
		freshFailure = (res.Outcome == pgidem.OutcomeExecuted || res.Outcome == pgidem.OutcomeTakenOver) &&
			sameError(err, fnErr) && errors.As(err, new(*pgidem.PermanentError))
		return res, freshFailure, txAnswer(ctx, job.JobRow, namespace, key, res.Outcome, res.RetryAfter, err, fnErr)
	}

	completed, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
	if err != nil {
		return res, false, fmt.Errorf("pgidemriver: WorkTx: complete job %d: %w", job.ID, err)
	}
	if completed.State != rivertype.JobStateCompleted {
		// River leaves a job that is no longer running as it is and returns it without an
		// error: the rescuer made it retryable or discarded it meanwhile. Committing would
		// keep the effect without the completion.
		if !runsAgain(completed.State) {
			// Discarded (the rescuer, on the last attempt) or cancelled: River runs it no
			// more and drops this error. Only the log can tell that its effect is rolled
			// back and will not run unless the job is retried by hand.
			c.Config().Logger.ErrorContext(ctx, "pgidemriver: WorkTx: job is no longer running and will not run again; its effect is rolled back",
				slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind), slog.String("state", string(completed.State)),
				slog.String("namespace", namespace), slog.String("key", key))
		}
		return res, false, fmt.Errorf("pgidemriver: WorkTx: job %d is %s, no longer running; roll back: %w",
			job.ID, completed.State, ErrJobNotRunning)
	}
	return res, false, nil
}

// txAnswer is WorkTx's action table: it maps the outcome of a DoTx call that returned err
// (fnErr is what fn returned, nil when it did not run or succeeded) to River's answer.
// Only a river.JobCancel error tells the worker to commit ([ShouldCommit]).
func txAnswer(ctx context.Context, job *rivertype.JobRow, namespace, key string, outcome pgidem.Outcome, retryAfter time.Duration, err, fnErr error) error {
	switch outcome {
	case pgidem.OutcomeExecuted, pgidem.OutcomeTakenOver:
		// fn ran. Its own error, unchanged: an ordinary one (fn's writes undone), or a
		// Permanent one whose failure DoTx has written in tx (River stops). Anything else
		// is pgidem's (a store error, fn ending tx itself): River retries.
		if sameError(err, fnErr) && errors.As(err, new(*pgidem.PermanentError)) {
			return river.JobCancel(err)
		}
		return err
	case pgidem.OutcomeNotStored:
		if fnErr != nil {
			// fn's Permanent error, which pgidem could not store: the verdict stands, so
			// River stops, with nothing in tx to keep.
			return river.JobCancel(err)
		}
		return err // fn's value could not be stored; its writes are undone: River retries
	case pgidem.OutcomeStoredFailure:
		return river.JobCancel(err) // the key's stored failure, replayed: River stops
	case pgidem.OutcomeParked:
		// The key is parked (DoTx parked it in tx, or found it parked): River stops, and
		// the worker commits tx, which keeps the park.
		return river.JobCancel(err)
	case pgidem.OutcomeInProgress:
		// Another transaction holds the key. Clamped like the middleware's snooze: never a
		// busy loop, never a whole lease.
		return river.JobSnooze(min(max(retryAfter, SnoozeMinDefault), SnoozeMaxDefault))
	case pgidem.OutcomeInvalid:
		if ns, k, ok := pgidem.KeyFromContext(ctx); ok && ns == namespace && k == key && errors.Is(err, pgidem.ErrInvalidArgument) {
			// pgidem refused the key it holds for the middleware: say how to fix it.
			return fmt.Errorf("pgidemriver: WorkTx: %s/%s is the key the middleware already reserved for job %d; "+
				"add kind %q to Config.ExcludeKinds or use another namespace: %w", namespace, key, job.ID, job.Kind, err)
		}
	}
	// A replayed result that does not decode (pgidem.ErrReplayNotDecodable: a deploy that
	// fixes the type lets the job replay), a fingerprint mismatch, a store error, a
	// context error: River retries.
	return err
}

// runsAgain reports whether River works a job in state again by itself: a retryable or
// available job (the rescuer's) and a scheduled one (a snooze, river.JobSnooze, of a
// parallel execution). Not a pending job: River leaves it parked until a user moves it.
func runsAgain(state rivertype.JobState) bool {
	switch state {
	case rivertype.JobStateRetryable, rivertype.JobStateAvailable, rivertype.JobStateScheduled:
		return true
	}
	return false
}

// sameError reports whether err is fnErr itself, as DoTx returns fn's error unchanged.
// Values that == cannot compare (a slice, or a struct holding one, behind the interface)
// are the same when they are of one type and deeply equal: DoTx creates no value of fn's
// error types.
func sameError(err, fnErr error) bool {
	if err == nil || fnErr == nil {
		return false
	}
	a, b := reflect.ValueOf(err), reflect.ValueOf(fnErr)
	if a.Comparable() && b.Comparable() {
		return err == fnErr
	}
	return a.Type() == b.Type() && reflect.DeepEqual(err, fnErr)
}

// WorkInTx makes a job's database effect exactly-once in a transaction of its own: it
// begins a transaction on the coordinator's pool (READ COMMITTED, READ WRITE), runs
// [WorkTx] in it and commits. It is [WorkInTxResult] without the detail; see there.
func WorkInTx[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	res, err := WorkInTxResult(ctx, c, job, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// WorkInTxResult is [WorkTxResult] in a transaction of its own. The transaction is begun on
// the coordinator's pool: READ COMMITTED, and READ WRITE even where the pool's sessions
// default to read-only transactions. It is committed when WorkTxResult returns nil or a
// fresh [pgidem.Permanent] failure; the stored failure is kept and the river.JobCancel
// error still returned. On any other error it is rolled back, so nothing of fn's survives.
// Call it from a River worker's Work and return its error as is.
//
// Its errors are WorkTxResult's, and a failed begin or commit returns an error prefixed
// "pgidemriver: " (River retries). A connection lost during COMMIT leaves it uncertain
// whether it committed; if it did, the retry replays.
//
// rivertest.Worker cannot work a worker that uses WorkInTx: its own transaction does not
// see the job in the test's uncommitted transaction (see "Testing workers" in the package
// documentation). Use [WorkTx] there.
//
// Cancelling ctx aborts the transaction. Safe for concurrent use.
func WorkInTxResult[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (pgidem.Result[T], error) {
	var res pgidem.Result[T]
	if c == nil || job == nil {
		return res, invalid("WorkInTx: coordinator and job must not be nil")
	}
	tx, err := c.Pool().BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return res, fmt.Errorf("pgidemriver: WorkInTx: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after commit

	res, freshFailure, err := workTx(ctx, c, tx, job, namespace, key, ttl, opts, fn)
	switch {
	case err == nil:
	case freshFailure:
		// fn's permanent failure, written in tx: commit it, so later jobs replay it.
		if cerr := tx.Commit(ctx); cerr != nil {
			return res, fmt.Errorf("pgidemriver: WorkInTx: commit stored failure: %w", cerr)
		}
		return res, err
	default:
		return res, err
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("pgidemriver: WorkInTx: commit: %w", err)
	}
	return res, nil
}
