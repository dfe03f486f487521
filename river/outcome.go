package pgidemriver

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// Outcome describes one execution of a job through the middleware, for a [Hook].
type Outcome struct {
	// Job is the job row as River handed it to the middleware. Do not modify it.
	Job *rivertype.JobRow
	// Namespace and Key are the record's; empty when the key could not be determined.
	Namespace, Key string
	// KeySource says where Key came from.
	KeySource KeySource
	// Action is what the middleware did, and so what River got: a River-level summary
	// of Outcome and the worker's own result.
	Action Action
	// Outcome is pgidem's outcome of the execution's call ([pgidem.Result.Outcome]), in
	// the vocabulary of pgidem's results and events: [pgidem.OutcomeExecuted] or
	// [pgidem.OutcomeTakenOver] when the worker ran, [pgidem.OutcomeReplayed],
	// [pgidem.OutcomeInProgress] for a snoozed job, and so on. [pgidem.OutcomeNone] when
	// pgidem reached no outcome: the kind is excluded ([ActionSkipped]), the key could not
	// be determined, the context ended first, or the worker panicked.
	Outcome pgidem.Outcome
	// Waited is true when the execution waited for another holder ([pgidem.InFlightWait]).
	Waited bool
	// TookOver is true when the execution took over a reservation whose holder stopped
	// renewing its lease (a crashed worker): the effect may have run twice.
	TookOver bool
	// Attempts is the record's attempt count (see [pgidem.Result.Attempts]).
	Attempts int
	// FailedOpen is true when the worker ran without a reservation: the store was
	// unreachable and the coordinator fails open ([pgidem.Config.FailOpen]). No record
	// exists. Action is [ActionExecuted] (the worker succeeded), [ActionReleased] (it
	// failed) or [ActionCancelled] (it failed with a [pgidem.Permanent] error) as for a
	// reserved run. But nothing was completed, released or stored: a later job with the
	// key runs the worker again.
	FailedOpen bool
	// Output is the JSON output the effect recorded with [RecordOutput] (the original run's
	// on a replay), nil when none. With OutputNotStored it is this run's output, which the
	// record lacks; nil on a replay of such a record.
	Output json.RawMessage
	// OutputNotStored is true when the effect succeeded but the output it recorded with
	// [RecordOutput] could not be stored in the pgidem record (pgidem's
	// [pgidem.ErrResultNotStorable]: a string with a NUL character, or too large). The
	// record is completed without it, so the effect is not repeated, and the job completes
	// ([ActionExecuted]); replays of the key complete without output ([ActionReplayed]).
	OutputNotStored bool
	// RecordNotCompleted is true when the worker finished but pgidem could not complete
	// its record because the store kept failing through pgidem's finishing retries
	// ([pgidem.ErrStoreUnavailable]). A worker that succeeded completes its job all the
	// same ([ActionExecuted], logged at error): its effect ran, and a retry of the job
	// would take the reservation over once its lease ends and run the effect again. A
	// worker that failed permanently has its job cancelled ([ActionCancelled]) without the
	// failure stored. The record stays in progress
	// until then; another job with the key that comes later takes it over
	// ([Outcome.TookOver]) and runs the effect again. (A lease lost to a takeover is
	// different: the job fails with [pgidem.ErrLeaseLost], and its retry replays or waits
	// for the new holder's outcome.)
	RecordNotCompleted bool
	// Snooze is the delay given to river.JobSnooze for [ActionSnoozed].
	Snooze time.Duration
	// Err is the error returned to River, nil on success. For a panic (which continues to
	// River) it is an error describing the panic.
	Err error
}

// Hook receives an [Outcome] for every job execution the middleware handles, for metrics
// and tracing. OnOutcome is called synchronously on the job's goroutine, from many
// goroutines at once: it must be fast and safe for concurrent use. A panic in OnOutcome
// is recovered and logged at error ([Config.Logger]); the job's outcome stands.
type Hook interface {
	OnOutcome(ctx context.Context, outcome *Outcome)
}

// StartHook is implemented by a [Hook] that also sees each execution start, to open a span
// around it (package pgidemotel does). [NewMiddleware] checks [Config.Hook] for it once.
type StartHook interface {
	Hook
	// OnJobStart is called on the job's goroutine when the middleware takes up an
	// execution, before it finds the key; excluded kinds ([ActionSkipped]) included. Each
	// call is followed by one [Hook.OnOutcome]. An inner registration that passes the job
	// through calls neither. The context it returns is the execution's from then on:
	// pgidem's call, the worker and OnOutcome receive it or one derived from it. Return ctx
	// itself to add nothing. Calls are concurrent; a panic is recovered and logged at
	// error ([Config.Logger]), and the execution goes on with ctx.
	OnJobStart(ctx context.Context, job *rivertype.JobRow) context.Context
}

// HookFunc adapts a function to [Hook].
type HookFunc func(ctx context.Context, outcome *Outcome)

// OnOutcome calls f(ctx, outcome).
func (f HookFunc) OnOutcome(ctx context.Context, outcome *Outcome) { f(ctx, outcome) }

// Stats are cumulative counts of the middleware's outcomes since it was created.
type Stats struct {
	// Executed, Replayed, Snoozed, Released, Cancelled, Errors and Skipped count
	// executions by [Action].
	Executed, Replayed, Snoozed, Released, Cancelled, Errors, Skipped int64
	// Waited counts executions that waited for another holder.
	Waited int64
	// JobIDKeys counts executions keyed by the job id ([KeySourceJobID]).
	JobIDKeys int64
	// FailedOpen counts executions whose worker ran without a reservation because the
	// store was unreachable and the coordinator fails open ([Outcome.FailedOpen]).
	FailedOpen int64
	// RecordNotCompleted counts executions whose record the store failed to complete
	// ([Outcome.RecordNotCompleted]): a worker that succeeded (these count in Executed
	// too) or one whose Permanent failure could not be stored (these count in Cancelled).
	RecordNotCompleted int64
	// Outcomes counts executions by pgidem's outcome of their call ([Outcome.Outcome]), in
	// the vocabulary of pgidem's results and events. Skipped executions are not counted;
	// executions that reached no outcome count under [pgidem.OutcomeNone]. Nil before the
	// first execution that is not skipped; a new map on every call of [Middleware.Stats].
	Outcomes map[pgidem.Outcome]int64
}

// counts are the middleware's cumulative counts behind [Stats].
type counts struct {
	executed, replayed, snoozed, released, cancelled, errors, skipped, waited, jobIDKeys, failedOpen, recordNotCompleted atomic.Int64

	mu       sync.Mutex
	outcomes map[pgidem.Outcome]int64 // by pgidem's outcome; nil until the first
}

// outcomesCopy returns a copy of the counts by pgidem's outcome, nil when there are none.
func (c *counts) outcomesCopy() map[pgidem.Outcome]int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.outcomes == nil {
		return nil
	}
	return maps.Clone(c.outcomes)
}

// Stats returns the middleware's cumulative counts. Safe for concurrent use.
func (m *Middleware) Stats() Stats {
	c := &m.counts
	return Stats{
		Executed: c.executed.Load(), Replayed: c.replayed.Load(), Snoozed: c.snoozed.Load(),
		Released: c.released.Load(), Cancelled: c.cancelled.Load(), Errors: c.errors.Load(),
		Skipped: c.skipped.Load(), Waited: c.waited.Load(), JobIDKeys: c.jobIDKeys.Load(),
		FailedOpen:         c.failedOpen.Load(),
		RecordNotCompleted: c.recordNotCompleted.Load(),
		Outcomes:           c.outcomesCopy(),
	}
}

// report counts out in Stats and hands it to the Hook. A panic in the Hook is logged and
// goes no further: a metrics bug must neither count the execution twice (Work's recover
// would take it for the job's panic) nor make River retry a job whose effect is recorded.
func (m *Middleware) report(ctx context.Context, out *Outcome) {
	m.record(out)
	if m.config.Hook == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			m.hookPanicked(ctx, "pgidemriver: Hook.OnOutcome panicked; the job's outcome stands", out.Job, p,
				slog.String("action", string(out.Action)))
		}
	}()
	m.config.Hook.OnOutcome(ctx, out)
}

// start hands job to the [StartHook], if there is one, and returns the context the
// execution goes on with: the one OnJobStart returned, or ctx when it returned nil or
// panicked (logged, like a panic in OnOutcome).
func (m *Middleware) start(ctx context.Context, job *rivertype.JobRow) (started context.Context) {
	if m.startHook == nil {
		return ctx
	}
	defer func() {
		if p := recover(); p != nil {
			m.hookPanicked(ctx, "pgidemriver: Hook.OnJobStart panicked; the job goes on", job, p)
			started = ctx
		}
	}()
	if started = m.startHook.OnJobStart(ctx, job); started == nil {
		return ctx
	}
	return started
}

// hookPanicked logs the panic p of a Hook method with msg.
func (m *Middleware) hookPanicked(ctx context.Context, msg string, job *rivertype.JobRow, p any, attrs ...any) {
	m.config.Logger.ErrorContext(ctx, msg, append([]any{slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind)},
		append(attrs, slog.Any("panic", p), slog.String("stack", string(debug.Stack())))...)...)
}

func (m *Middleware) record(out *Outcome) {
	c := &m.counts
	switch out.Action {
	case ActionExecuted:
		c.executed.Add(1)
	case ActionReplayed:
		c.replayed.Add(1)
	case ActionSnoozed:
		c.snoozed.Add(1)
	case ActionReleased:
		c.released.Add(1)
	case ActionCancelled:
		c.cancelled.Add(1)
	case ActionSkipped:
		c.skipped.Add(1)
	default:
		c.errors.Add(1)
	}
	if out.Waited {
		c.waited.Add(1)
	}
	if out.KeySource == KeySourceJobID {
		c.jobIDKeys.Add(1)
	}
	if out.FailedOpen {
		c.failedOpen.Add(1)
	}
	if out.RecordNotCompleted {
		c.recordNotCompleted.Add(1)
	}
	if out.Action != ActionSkipped {
		c.mu.Lock()
		if c.outcomes == nil {
			c.outcomes = map[pgidem.Outcome]int64{}
		}
		c.outcomes[out.Outcome]++
		c.mu.Unlock()
	}
}
