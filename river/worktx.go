package pgidemriver

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// ErrJobNotRunning is matched (errors.Is) by the error of [WorkTx] and [WorkTxResult] when
// the job was no longer running at completion, so its transaction was rolled back.
var ErrJobNotRunning = errors.New("pgidemriver: job is no longer running")

// WorkTx makes a job's database effect exactly-once: in one transaction on the
// coordinator's pool it runs fn under (namespace, key) with [pgidem.DoTxResult] — fn's
// writes and the key's completed record — and marks the job completed with
// river.JobCompleteTx, then commits. It is [WorkTxResult] without the detail; see there.
func WorkTx[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (T, error) {
	res, err := WorkTxResult(ctx, c, job, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// WorkTxResult runs a job's database effect and its completion in one transaction and
// reports how the value was obtained. Call it from a River worker's Work with the job
// River passed in, and return its error as is.
//
// Business rows, the pgidem record and the job's completed state commit together or not at
// all. River completes jobs asynchronously in batches after Work returns; a process that
// dies in between gets the job again — here the completion is already committed with the
// effect, so that redelivery cannot happen, and a crash anywhere before the commit leaves
// none of the three (the retry runs fn again). A redelivery that does reach a committed key
// (the rescuer's duplicate, a second job for the same effect) replays the stored value,
// without running fn, and completes its own job in the same way.
//
// namespace, key, ttl and opts follow [pgidem.DoTxResult]: an invalid key or TTL returns
// its error and nothing runs. The key must differ from the one the [Middleware] reserved
// for the same job — DoTx would find that reservation in progress — so exclude the kind
// from the middleware ([Config.ExcludeKinds]) or use another namespace; the same key
// returns an error at once.
//
// Errors, with the transaction rolled back unless noted:
//   - fn's error, unchanged: fn's writes are undone and River retries the job.
//   - another transaction holds the key (after the wait of [pgidem.InFlightWait], or at
//     once under [pgidem.InFlightRaise]): river.JobSnooze with the retry-after hint
//     clamped to [SnoozeMinDefault] and [SnoozeMaxDefault], which uses no attempt; the next
//     delivery replays.
//   - a [pgidem.Permanent] error from fn: the failure is stored and committed (fn's writes
//     are undone) and river.JobCancel wrapping it is returned, so River stops; later jobs
//     with the key replay the failure and are cancelled too.
//   - the job is no longer running when WorkTx completes it (River's rescuer made it
//     retryable or discarded it meanwhile, or it was cancelled; river.JobCompleteTx then
//     changes nothing): an error matching [ErrJobNotRunning], so the effect is not
//     committed without the completion; wherever River runs the job next, the effect runs
//     there.
//   - a database error: a [*pgidem.StoreError]; a failed begin, job completion or commit:
//     an error prefixed "pgidemriver: ". River retries.
//
// Cancelling ctx aborts the transaction. Safe for concurrent use.
func WorkTxResult[TArgs river.JobArgs, T any](ctx context.Context, c *pgidem.Coordinator, job *river.Job[TArgs], namespace, key string, ttl time.Duration, opts *pgidem.DoOpts, fn func(ctx context.Context, tx pgx.Tx) (T, error)) (pgidem.Result[T], error) {
	var res pgidem.Result[T]
	if c == nil || job == nil {
		return res, errors.New("pgidemriver: WorkTx: coordinator and job must not be nil")
	}
	if ns, k, ok := pgidem.KeyFromContext(ctx); ok && ns == namespace && k == key {
		return res, fmt.Errorf("pgidemriver: WorkTx: %s/%s is the key the middleware already reserved for job %d; "+
			"add kind %q to Config.ExcludeKinds or use another namespace", namespace, key, job.ID, job.Kind)
	}

	tx, err := c.Pool().BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return res, fmt.Errorf("pgidemriver: WorkTx: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after commit

	res, err = pgidem.DoTxResult(ctx, c, tx, namespace, key, ttl, opts, fn)
	var inProgress *pgidem.InProgressError
	switch {
	case err == nil:
	case errors.As(err, &inProgress):
		// Clamped like the middleware's snooze: never a busy loop, never a whole lease.
		return res, river.JobSnooze(min(max(inProgress.RetryAfter, SnoozeMinDefault), SnoozeMaxDefault))
	case errors.Is(err, pgidem.ErrPermanent):
		var stored *pgidem.StoredFailureError
		if !errors.As(err, &stored) && !errors.Is(err, pgidem.ErrStoreUnavailable) {
			// A fresh permanent failure, stored in tx: commit it. (One that could not be
			// stored matches ErrStoreUnavailable; tx then holds nothing worth committing.)
			if cerr := tx.Commit(ctx); cerr != nil {
				return res, fmt.Errorf("pgidemriver: WorkTx: commit stored failure: %w", cerr)
			}
		}
		return res, river.JobCancel(err)
	default:
		return res, err
	}

	completed, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job)
	if err != nil {
		return res, fmt.Errorf("pgidemriver: WorkTx: complete job %d: %w", job.ID, err)
	}
	if completed.State != rivertype.JobStateCompleted {
		// River leaves a job that is no longer running as it is and returns it without an
		// error: the rescuer made it retryable or discarded it meanwhile, or it was
		// cancelled. Committing would keep the effect without the completion.
		return res, fmt.Errorf("pgidemriver: WorkTx: job %d is %s, no longer running; rolled back: %w",
			job.ID, completed.State, ErrJobNotRunning)
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("pgidemriver: WorkTx: commit: %w", err)
	}
	return res, nil
}
