package pgidemriver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// Middleware is a River worker middleware ([rivertype.WorkerMiddleware]) that runs each job
// under a pgidem reservation, so a job's effect happens once however often River delivers
// it. Create it with [NewMiddleware] and register the pointer in river.Config.Middleware
// (every worker) or return it from a worker's Middleware method (that worker only). The
// steps of each execution are under "Middleware: per execution" in the package
// documentation.
//
// Register it once per job. Registering it in both places (or two Middleware values) is
// safe. The outer registration decides: it reserves the key, or skips an excluded kind.
// An execution it already handles passes straight through the inner one to the worker, and
// only the outer registration reports an [Outcome] and counts in [Stats]. River runs a
// worker's own middleware outside the client's, so with two Middleware values the
// worker's decides.
//
// It is safe for concurrent use and may serve several clients.
type Middleware struct {
	river.MiddlewareDefaults

	coord     *pgidem.Coordinator
	config    Config
	startHook StartHook // config.Hook when it implements StartHook
	exclude   map[string]bool

	mu    sync.RWMutex
	kinds map[string]*kindInfo // registered args types by kind (and kind alias)

	fallbackLogged sync.Map // kind -> struct{}: job-id fallback already logged
	counts         counts
}

var _ rivertype.WorkerMiddleware = (*Middleware)(nil)

// Work implements [rivertype.WorkerMiddleware]; River calls it for every execution of a job.
// See [Middleware] for what it does. Its errors:
//   - the worker ran and failed: the worker's error, unchanged. It is wrapped in one
//     matching [pgidem.ErrLeaseLost] when the record was then found taken over, or in one
//     saying pgidem cancelled the worker when its lease renewals failed. The worker's own
//     river.JobSnooze or river.JobCancel is never wrapped.
//   - another execution holds the key: river.JobSnooze.
//   - a stored permanent failure: a river.JobCancel wrapping it.
//   - otherwise an error prefixed "pgidemriver: " wrapping pgidem's: [pgidem.ErrInvalidKey],
//     [pgidem.ErrStoreUnavailable], [pgidem.ErrLeaseLost], or a context error
//     (context.DeadlineExceeded when the reservation step exceeded [Config.SQLTimeout]).
//
// Cancelling ctx (River's job context) before the worker runs returns a context error and
// leaves no reservation; while the worker runs it cancels the worker's context.
//
// An outer pgidemriver Work may already handle job, when the middleware is registered
// twice, globally and on the worker. ctx shows it: the outer Work holds the reservation or
// skipped the excluded kind. Work then calls doInner(ctx) directly and reports nothing,
// since the outer Work reports the outcome. Safe for concurrent use.
func (m *Middleware) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	if id, ok := ctx.Value(handledJobKey{}).(int64); ok && id == job.ID {
		return doInner(ctx)
	}
	ctx = m.start(ctx, job)
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

// work runs one execution of job through pgidem and maps the outcome pgidem reports to
// River's answer with the action table ([decide]).
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
	reserveCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	e := &execution{ctx: ctx, job: job, doInner: doInner, out: out, cancel: cancel}
	e.timer = time.AfterFunc(m.reserveBudget(), func() { cancel(errReserveTimeout) })
	defer e.timer.Stop()

	opts := &pgidem.DoOpts{InFlight: m.config.InFlight, WaitTimeout: m.config.WaitTimeout, ReserveFirst: true}
	res, err := pgidem.DoResult(reserveCtx, m.coord, out.Namespace, out.Key, ttl, opts, e.run)
	out.Outcome, out.Waited, out.TookOver, out.Attempts, out.FailedOpen = res.Outcome, res.Waited, res.TookOver, res.Attempts, res.FailedOpen
	timedOut := ctx.Err() == nil && context.Cause(reserveCtx) == errReserveTimeout
	v := decide(e.facts(res.Outcome, err, timedOut))
	return m.answer(ctx, e, v, res, err)
}

// reserveBudget is how long the reservation step may take: Config.SQLTimeout, plus
// Config.WaitTimeout under InFlightWait.
func (m *Middleware) reserveBudget() time.Duration {
	if m.config.InFlight == pgidem.InFlightWait {
		// Saturating: a huge WaitTimeout ("as long as it takes") must not wrap negative,
		// which would fire the timer at once and never start a worker.
		return saturatingSum(m.config.SQLTimeout, m.config.WaitTimeout)
	}
	return m.config.SQLTimeout
}

// execution is one job execution under a reservation: the worker pgidem runs as fn, and
// what the worker did, as the middleware saw it.
type execution struct {
	ctx     context.Context // the job's context, as River gave it to the middleware
	job     *rivertype.JobRow
	doInner func(context.Context) error
	out     *Outcome
	timer   *time.Timer             // the reservation budget, stopped when the worker starts
	cancel  context.CancelCauseFunc // cancels the reservation step

	started   bool  // the worker started
	workerErr error // the worker's own error, as it returned it
	stalled   bool  // pgidem cancelled the worker: its lease renewals failed
}

// run is the fn given to pgidem.DoResult: it starts the worker unless the reservation
// budget ran out as the reservation was granted.
func (e *execution) run(fnCtx context.Context) (effectRecord, error) {
	if !e.timer.Stop() {
		// The budget ran out as the reservation was granted: do not start the worker on a
		// cancelled context; pgidem releases the reservation. Cancelling here too makes
		// the cause certain before pgidem returns, whether or not the timer's function
		// has run yet.
		e.cancel(errReserveTimeout)
		return effectRecord{}, errReserveTimeout
	}
	e.started = true
	e.out.Action = ActionReleased // what a panicking worker comes to; replaced by the table otherwise
	slot := &outputSlot{}
	workCtx := context.WithValue(fnCtx, outputSlotKey{}, slot)
	workCtx = context.WithValue(workCtx, handledJobKey{}, e.job.ID)
	if err := e.doInner(workCtx); err != nil {
		e.workerErr = err
		e.stalled = e.ctx.Err() == nil && errors.Is(context.Cause(fnCtx), pgidem.ErrLeaseLost)
		return effectRecord{}, err
	}
	return effectRecord{JobID: e.job.ID, Attempt: e.job.Attempt, Output: slot.get()}, nil
}

// facts gathers what the action table reads: pgidem's outcome and error, and what the
// worker did. The worker's error is classified by what it carries itself, never by what
// pgidem wrapped around it.
func (e *execution) facts(outcome pgidem.Outcome, err error, timedOut bool) facts {
	var stored *pgidem.StoredFailureError
	return facts{
		outcome:     outcome,
		failed:      err != nil,
		started:     e.started,
		succeeded:   e.started && e.workerErr == nil,
		permanent:   errors.As(e.workerErr, new(*pgidem.PermanentError)),
		control:     errors.As(e.workerErr, new(*river.JobSnoozeError)) || errors.As(e.workerErr, new(*river.JobCancelError)),
		stalled:     e.stalled,
		timedOut:    timedOut,
		notStorable: errors.As(err, &stored) && stored.NotStorable,
	}
}

// answer applies the verdict v: it fills the execution's [Outcome], logs what needs an
// operator's eye, and returns the error River gets (nil to complete the job).
func (m *Middleware) answer(ctx context.Context, e *execution, v verdict, res pgidem.Result[effectRecord], err error) error {
	out, job := e.out, e.job
	out.Action, out.OutputNotStored, out.RecordNotCompleted = v.action, v.outputNotStored, v.recordNotCompleted
	if v.action == ActionExecuted || v.action == ActionReplayed {
		out.Output = res.Value.Output
	}
	m.logVerdict(ctx, out, err)
	switch v.reply {
	case replyNil:
		return nil
	case replyReplay:
		m.recordReplayedOutput(ctx, out)
		return nil
	case replyError:
		return err // the worker's error, or pgidem's around it, unchanged
	case replyCancel:
		return river.JobCancel(err)
	case replyCancelReplayed:
		// Say in River's errors column that this job only replayed the failure.
		return river.JobCancel(fmt.Errorf("pgidemriver: job %d (%s): replayed the failure an earlier execution stored for %s/%s: %w",
			job.ID, job.Kind, out.Namespace, out.Key, err))
	case replySnooze:
		out.Snooze = min(max(res.RetryAfter, m.config.SnoozeMin), m.config.SnoozeMax)
		return river.JobSnooze(out.Snooze)
	case replyLeaseLost:
		return fmt.Errorf("pgidemriver: job %d (%s): the worker stopped after its reservation's lease was lost (%w); it returned: %w",
			job.ID, job.Kind, pgidem.ErrLeaseLost, err)
	case replyStalled:
		return fmt.Errorf("pgidemriver: job %d (%s): pgidem cancelled the worker because its lease could not be renewed in time; the record was released, and River retries the job; the worker returned: %w",
			job.ID, job.Kind, err)
	case replyTimeout:
		return m.timeoutError(job)
	}
	return fmt.Errorf("pgidemriver: job %d (%s): %w", job.ID, job.Kind, err)
}

// timeoutError is the error of a reservation step that exceeded its budget.
func (m *Middleware) timeoutError(job *rivertype.JobRow) error {
	limit := fmt.Sprintf("Config.SQLTimeout %s", m.config.SQLTimeout)
	if m.config.InFlight == pgidem.InFlightWait {
		limit += fmt.Sprintf(" + Config.WaitTimeout %s", m.config.WaitTimeout)
	}
	return fmt.Errorf("pgidemriver: job %d (%s): reservation exceeded %s: %w", job.ID, job.Kind, limit, context.DeadlineExceeded)
}

// recordReplayedOutput records a replayed job's output with River, as if it had run.
func (m *Middleware) recordReplayedOutput(ctx context.Context, out *Outcome) {
	if len(out.Output) == 0 {
		return
	}
	if err := river.RecordOutput(ctx, out.Output); err != nil {
		m.config.Logger.WarnContext(ctx, "pgidemriver: could not record replayed output",
			slog.Int64("job_id", out.Job.ID), slog.String("job_kind", out.Job.Kind), slog.String("error", err.Error()))
	}
}

// logVerdict logs a worker whose effect ran but whose record lacks its output, or was not
// completed at all; err is pgidem's.
func (m *Middleware) logVerdict(ctx context.Context, out *Outcome, err error) {
	if out.Action != ActionExecuted {
		return
	}
	attrs := []any{slog.Int64("job_id", out.Job.ID), slog.String("job_kind", out.Job.Kind),
		slog.String("namespace", out.Namespace), slog.String("key", out.Key)}
	switch {
	case out.OutputNotStored:
		m.config.Logger.WarnContext(ctx, "pgidemriver: job output not storable in the idempotency record; "+
			"the job completes and replays of its key carry no output", append(attrs, slog.String("error", err.Error()))...)
	case out.RecordNotCompleted:
		// A retry of this job would find the reservation in progress until its lease
		// ends, then take it over and run the effect again, so the job completes. pgidem
		// logged the store error.
		m.config.Logger.ErrorContext(ctx, "pgidemriver: job succeeded but its idempotency record could not be completed; "+
			"the job completes, and a later job with the key takes the record over when its lease ends",
			append(attrs, slog.String("error", err.Error()))...)
	}
}
