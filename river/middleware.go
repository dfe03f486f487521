package pgidemriver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// Middleware is a River worker middleware ([rivertype.WorkerMiddleware]) that runs each job
// under a pgidem reservation, so a job's effect happens once however often River delivers
// it. Create it with [NewMiddleware] and register the pointer in river.Config.Middleware
// (every worker) or return it from a worker's Middleware method (that worker only).
// Register it once per job; registering it in both places (or two Middleware values) is
// safe: the outer registration decides (reserves the key, or skips an excluded kind), an
// execution it already handles passes straight through the inner one to the worker, and
// only the outer registration reports an [Outcome] and counts in [Stats]. River runs a
// worker's own middleware outside the client's, so with two Middleware values the
// worker's decides.
//
// Per execution, in order:
//  1. Key: the args' [KeyArgs] key (decoded from the job's encoded args), else
//     [Config.KeyFunc], else the job id ([KeySourceJobID]). Namespace: [NamespaceArgs],
//     else the canonical kind of the registered args type (the job kind when the type is
//     not registered).
//  2. Reserve the key ([pgidem.DoResult]) within [Config.SQLTimeout], with
//     [pgidem.DoOpts.ReserveFirst]: most jobs name a new key, so the reserving insert is
//     the first statement (it returns a completed record itself when there is one).
//  3. Completed before: return nil without running the worker (replay).
//     In progress elsewhere: snooze or wait ([Config.InFlight]).
//     Otherwise: run the worker (doInner) while a heartbeat renews the lease for as long
//     as it runs — also past JobTimeout and for jobs without a timeout — so the rescuer's
//     duplicate finds it in progress rather than taking over.
//  4. Worker returns nil: the record completes (when it cannot, the job completes all the
//     same: [Outcome.RecordNotCompleted]). Worker returns an error: the record is
//     released and the error returned unchanged (snooze and cancel errors included), so
//     River retries; when the release finds the record taken over, the error is wrapped
//     in one matching [pgidem.ErrLeaseLost] ([ActionError]), and when pgidem cancelled the
//     worker because its renewals failed (the record not taken over) in one that says so,
//     except the worker's own river.JobSnooze or river.JobCancel, which pass through
//     unchanged. A
//     [pgidem.Permanent] error is stored and the job cancelled. Renewals that stall until a
//     tenth of a lease before it ends, or a renewal that finds the record taken over,
//     cancel the worker's context with cause [pgidem.ErrLeaseLost], however long the
//     worker has run (the cause alone does not prove a takeover).
//
// It is safe for concurrent use and may serve several clients.
type Middleware struct {
	river.MiddlewareDefaults

	coord   *pgidem.Coordinator
	config  Config
	exclude map[string]bool

	mu    sync.RWMutex
	kinds map[string]*kindInfo // registered args types by kind (and kind alias)

	fallbackLogged sync.Map // kind -> struct{}: job-id fallback already logged
	counts         struct {
		executed, replayed, snoozed, released, cancelled, errors, skipped, waited, jobIDKeys, failedOpen, recordNotCompleted atomic.Int64
	}
}

var _ rivertype.WorkerMiddleware = (*Middleware)(nil)

// Work implements [rivertype.WorkerMiddleware]; River calls it for every execution of a job.
// See [Middleware] for what it does. The error it returns is the worker's, unchanged, when
// the worker ran and failed (wrapped in one matching [pgidem.ErrLeaseLost] when the record
// was then found taken over, or in one saying pgidem cancelled the worker when its lease
// renewals failed, except its own river.JobSnooze or river.JobCancel);
// river.JobSnooze when another execution holds the key; a
// river.JobCancel wrapping a stored permanent failure; otherwise an error prefixed
// "pgidemriver: " wrapping pgidem's ([pgidem.ErrInvalidKey], [pgidem.ErrStoreUnavailable],
// [pgidem.ErrLeaseLost], a context error — context.DeadlineExceeded when the reservation
// step exceeded [Config.SQLTimeout]).
//
// Cancelling ctx (River's job context) before the worker runs returns a context error and
// leaves no reservation; while the worker runs it cancels the worker's context.
//
// When ctx shows that an outer pgidemriver Work already handles job (holds its
// reservation, or skipped its excluded kind) — the middleware is registered twice,
// globally and on the worker — Work calls doInner(ctx) directly and reports nothing: the
// outer Work reports the outcome. Safe for concurrent use.
func (m *Middleware) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	if id, ok := ctx.Value(handledJobKey{}).(int64); ok && id == job.ID {
		return doInner(ctx)
	}
	out := &Outcome{Job: job}
	defer func() {
		// A panic (River recovers it around the middleware chain) still gets its outcome:
		// released when the worker panicked (pgidem released the reservation), an error
		// when the key could not be found.
		if p := recover(); p != nil {
			if out.Action != ActionReleased {
				out.Action = ActionError
			}
			out.Err = fmt.Errorf("pgidemriver: job %d (%s) panicked: %v", job.ID, job.Kind, p)
			m.report(ctx, out)
			panic(p)
		}
	}()
	out.Err = m.work(ctx, job, doInner, out)
	m.report(ctx, out)
	return out.Err
}

// effectRecord is the JSON stored as the record's result: which job performed the effect
// and what it recorded as output.
type effectRecord struct {
	JobID   int64           `json:"job_id"`
	Attempt int             `json:"attempt"`
	Output  json.RawMessage `json:"output,omitempty"`
}

// handledJobKey marks a context whose worker an outer pgidemriver Work handles (runs under
// its reservation, or skipped as excluded); the value is the job id (int64).
type handledJobKey struct{}

// errReserveTimeout is the cause with which the reservation step is cancelled when it
// exceeds its budget (Config.SQLTimeout, plus WaitTimeout under Wait).
var errReserveTimeout = errors.New("pgidemriver: reservation step timed out")

func (m *Middleware) work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error, out *Outcome) error {
	info := m.kind(job.Kind)
	if m.exclude[job.Kind] || (info != nil && m.exclude[info.kind]) {
		out.Action = ActionSkipped
		return doInner(context.WithValue(ctx, handledJobKey{}, job.ID))
	}
	ttl, err := m.resolve(ctx, job, info, out)
	if err != nil {
		out.Action = ActionError
		return err
	}

	// The reservation (and, under Wait, the wait) is bounded; the worker is not. pgidem
	// derives fn's context from the one given to DoResult, so that context must not carry
	// a deadline: the budget is a timer that cancels it, stopped as soon as the worker
	// starts. From then on fn's context is cancelled only by the job's context or by
	// pgidem with cause ErrLeaseLost.
	budget := m.config.SQLTimeout
	if m.config.InFlight == pgidem.InFlightWait {
		// Saturating: a huge WaitTimeout ("as long as it takes") must not wrap negative,
		// which would fire the timer at once and never start a worker.
		budget = saturatingSum(budget, m.config.WaitTimeout)
	}
	reserveCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	timer := time.AfterFunc(budget, func() { cancel(errReserveTimeout) })
	defer timer.Stop()

	ran, succeeded := false, false // the worker started; it returned nil
	opts := &pgidem.DoOpts{InFlight: m.config.InFlight, WaitTimeout: m.config.WaitTimeout, ReserveFirst: true}
	var workerErr error // the worker's own error, as it returned it
	stalled := false    // pgidem cancelled the worker: its lease renewals failed
	res, err := pgidem.DoResult(reserveCtx, m.coord, out.Namespace, out.Key, ttl, opts,
		func(fnCtx context.Context) (effectRecord, error) {
			if !timer.Stop() {
				// The budget ran out as the reservation was granted: do not start the
				// worker on a cancelled context; pgidem releases the reservation.
				return effectRecord{}, errReserveTimeout
			}
			ran = true
			out.Action = ActionReleased // what a panicking worker comes to; replaced below otherwise
			slot := &outputSlot{}
			workCtx := context.WithValue(fnCtx, outputSlotKey{}, slot)
			workCtx = context.WithValue(workCtx, handledJobKey{}, job.ID)
			if err := doInner(workCtx); err != nil {
				workerErr = err
				stalled = ctx.Err() == nil && errors.Is(context.Cause(fnCtx), pgidem.ErrLeaseLost)
				return effectRecord{}, err
			}
			succeeded = true
			return effectRecord{JobID: job.ID, Attempt: job.Attempt, Output: slot.get()}, nil
		})
	out.Waited, out.TookOver, out.Attempts, out.FailedOpen = res.Waited, res.TookOver, res.Attempts, res.FailedOpen

	var (
		inProgress *pgidem.InProgressError
		snoozeErr  *river.JobSnoozeError
		cancelErr  *river.JobCancelError
		stored     *pgidem.StoredFailureError
	)
	// pgidem's verdict that a permanent failure was not stored is the top-level error; one
	// the worker returned itself (from a call of its own) says nothing about this record.
	notStored, _ := err.(*pgidem.FailureNotStoredError)
	if own, ok := workerErr.(*pgidem.FailureNotStoredError); ok && own == notStored {
		notStored = nil
	}
	failureLeaseLost := notStored != nil && res.LeaseLost // pgidem's verdict on its own write
	// A failure is permanent by pgidem's rule: the worker's error carries a
	// [pgidem.PermanentError] (and pgidem stored it), or the record replayed a stored
	// failure. A worker error that merely matches ErrPermanent through a nested call's
	// replayed *StoredFailureError released the record like any other error, so River
	// retries the job.
	permanent := errors.As(workerErr, new(*pgidem.PermanentError)) || (!ran && errors.Is(err, pgidem.ErrPermanent))
	switch {
	case err == nil && res.Replayed:
		out.Action = ActionReplayed
		out.Output = res.Value.Output
		if len(out.Output) > 0 {
			// The replayed job carries the original run's output, as if it had run.
			if err := river.RecordOutput(ctx, out.Output); err != nil {
				m.config.Logger.WarnContext(ctx, "pgidemriver: could not record replayed output",
					slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind), slog.String("error", err.Error()))
			}
		}
		return nil
	case err == nil:
		out.Action = ActionExecuted
		out.Output = res.Value.Output
		return nil
	case succeeded && errors.Is(err, pgidem.ErrResultNotStorable) && !errors.Is(err, pgidem.ErrLeaseLost):
		// The worker succeeded and its effect ran; only its recorded output could not be
		// stored. pgidem completed the record without it (the effect is not repeated), and
		// River already holds the output in the job's metadata, so the job completes.
		out.Action = ActionExecuted
		out.OutputNotStored = true
		out.Output = res.Value.Output
		m.config.Logger.WarnContext(ctx, "pgidemriver: job output not storable in the idempotency record; "+
			"the job completes and replays of its key carry no output",
			slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind),
			slog.String("namespace", out.Namespace), slog.String("key", out.Key), slog.String("error", err.Error()))
		return nil
	case !ran && errors.As(err, &stored) && stored.NotStorable:
		// An earlier execution ran the effect and only its output was lost: a replay.
		out.Action = ActionReplayed
		out.OutputNotStored = true
		return nil
	case ran && (errors.As(err, &snoozeErr) || errors.As(err, &cancelErr)):
		switch {
		case failureLeaseLost:
			out.Action = ActionError // nothing stored: the record is another holder's
		case permanent:
			out.Action = ActionCancelled // river.JobCancel(pgidem.Permanent(e)): stored as failed
			out.RecordNotCompleted = notStored != nil
		default:
			out.Action = ActionReleased
		}
		return err // River's own control errors pass through unchanged
	case permanent && !failureLeaseLost:
		// Stored (or replayed), or the store failed to store it: the worker's verdict
		// stands either way, so River does not retry this job.
		out.Action = ActionCancelled
		out.RecordNotCompleted = notStored != nil
		if !ran {
			// Say in River's errors column that this job only replayed the failure.
			err = fmt.Errorf("pgidemriver: job %d (%s): replayed the failure an earlier execution stored for %s/%s: %w",
				job.ID, job.Kind, out.Namespace, out.Key, err)
		}
		return river.JobCancel(err)
	case succeeded && !errors.Is(err, pgidem.ErrLeaseLost):
		// The worker succeeded and its effect ran, but the store kept failing, so its
		// record could not be completed. A retry of this job would find the reservation in
		// progress until its lease ends, then take it over and run the effect again, so
		// the job completes. pgidem logged the store error.
		out.Action = ActionExecuted
		out.RecordNotCompleted = true
		out.Output = res.Value.Output
		m.config.Logger.ErrorContext(ctx, "pgidemriver: job succeeded but its idempotency record could not be completed; "+
			"the job completes, and a later job with the key takes the record over when its lease ends",
			slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind),
			slog.String("namespace", out.Namespace), slog.String("key", out.Key), slog.String("error", err.Error()))
		return nil
	case succeeded || failureLeaseLost:
		// The lease was lost while the worker ran (pgidem's answer: the worker succeeded
		// or failed permanently, and its outcome could not be written): nothing was
		// completed (the record is another holder's now), and River's retry replays or
		// waits for that holder's outcome. The error makes the anomaly visible on the job.
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): %w", job.ID, job.Kind, err)
	case ran && res.LeaseLost:
		// The worker failed (most likely with its context's error, which pgidem cancelled
		// as the lease ran out) and pgidem then found the record taken over: say so, or
		// River's errors column would show a bare "context canceled" for what may be an
		// effect run twice. Nothing was released: the record is the new holder's.
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): the worker stopped after its reservation's lease was lost (%w); it returned: %w",
			job.ID, job.Kind, pgidem.ErrLeaseLost, err)
	case ran && stalled:
		// pgidem cancelled the worker because its lease could not be renewed in time (a
		// slow or unreachable store, a starved pool), and then released the record, which
		// nobody had taken over: say so, or River's errors column would show a bare
		// "context canceled". Not a lost lease (it matches nothing of pgidem's).
		out.Action = ActionReleased
		return fmt.Errorf("pgidemriver: job %d (%s): pgidem cancelled the worker because its lease could not be renewed in time; the record was released, and River retries the job; the worker returned: %w",
			job.ID, job.Kind, err)
	case ran:
		out.Action = ActionReleased
		return err // the worker's error, unchanged
	case errors.As(err, &inProgress):
		out.Action = ActionSnoozed
		out.Snooze = min(max(inProgress.RetryAfter, m.config.SnoozeMin), m.config.SnoozeMax)
		return river.JobSnooze(out.Snooze)
	case ctx.Err() == nil && context.Cause(reserveCtx) == errReserveTimeout:
		out.Action = ActionError
		limit := fmt.Sprintf("Config.SQLTimeout %s", m.config.SQLTimeout)
		if m.config.InFlight == pgidem.InFlightWait {
			limit += fmt.Sprintf(" + Config.WaitTimeout %s", m.config.WaitTimeout)
		}
		return fmt.Errorf("pgidemriver: job %d (%s): reservation exceeded %s: %w", job.ID, job.Kind, limit, context.DeadlineExceeded)
	default:
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): %w", job.ID, job.Kind, err)
	}
}
