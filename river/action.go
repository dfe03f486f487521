package pgidemriver

// Action is what the middleware did with one execution of a job.
type Action string

const (
	// ActionExecuted: the worker ran under a fresh (or taken-over) reservation and
	// succeeded; the record is completed and the job completes. This includes a worker
	// whose [RecordOutput] could not be stored in the record ([Outcome.OutputNotStored])
	// and one whose record could not be completed at all ([Outcome.RecordNotCompleted]):
	// its effect ran, so the job completes rather than retrying or being cancelled.
	ActionExecuted Action = "executed"
	// ActionReplayed: the key's effect had already completed; the worker did not run and
	// the job completes (its recorded output is the original run's, see [RecordOutput];
	// none when it could not be stored, [Outcome.OutputNotStored]).
	ActionReplayed Action = "replayed"
	// ActionSnoozed: another execution holds the key (in progress, lease alive); the job
	// was answered with river.JobSnooze, which does not use an attempt.
	ActionSnoozed Action = "snoozed"
	// ActionReleased: the worker returned an error or panicked; the reservation was
	// released and the error returned unchanged (a panic continues, for River to recover).
	// River's retry runs the worker again, unless the error is the worker's own
	// river.JobSnooze (River runs the job later) or river.JobCancel (River stops). An
	// error that matches [pgidem.ErrPermanent] only through a failure a nested pgidem call
	// replayed is such an error: it carries no [pgidem.Permanent] error, so nothing was
	// stored. (When the lease was lost meanwhile, only a panic or the worker's own
	// river.JobSnooze or river.JobCancel comes here, with nothing left to release: the
	// record is the new holder's. Any other worker error is then [ActionError].)
	ActionReleased Action = "released"
	// ActionCancelled: the effect failed permanently (the worker returned a
	// [pgidem.Permanent] error, now or on an earlier job with the key, possibly wrapped in
	// its own river.JobCancel); the failure was stored and the job cancelled with
	// river.JobCancel so River does not retry it. When the store kept failing, the job is
	// cancelled all the same but the failure is not stored ([Outcome.RecordNotCompleted]):
	// a later job with the key takes the record over once its lease ends and runs the
	// worker again.
	ActionCancelled Action = "cancelled"
	// ActionError: the middleware could not decide (invalid key, undecodable args, store
	// unreachable), or the write after the worker found the record taken over: the worker
	// succeeded, failed permanently, or returned an error (other than its own
	// river.JobSnooze or river.JobCancel, which pass through unchanged as [ActionReleased]),
	// and its outcome was not stored: the record is the new holder's. The error, matching
	// [pgidem.ErrLeaseLost] in that case (and wrapping the worker's), was returned to River,
	// which retries the job and replays or waits for the new holder's outcome.
	ActionError Action = "error"
	// ActionSkipped: the kind is excluded ([Config.ExcludeKinds], [SweepKind]); the
	// worker ran without a reservation.
	ActionSkipped Action = "skipped"
)
