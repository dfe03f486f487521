package pgidemriver

import "github.com/pgidem/pgidem/pgidem"

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
	// ActionCancelled: the effect failed permanently. The worker returned a
	// [pgidem.Permanent] error, now or on an earlier job with the key, possibly wrapped in
	// its own river.JobCancel. The failure was stored and the job cancelled with
	// river.JobCancel so River does not retry it. A key whose record is parked
	// ([pgidem.OutcomeParked]: holders kept dying until [pgidem.Config.MaxAttempts]) is
	// cancelled the same way, with the [*pgidem.ParkedError]: it needs an operator. When
	// the store kept failing, the job is
	// cancelled all the same but the failure is not stored ([Outcome.RecordNotCompleted]):
	// a later job with the key takes the record over once its lease ends and runs the
	// worker again.
	ActionCancelled Action = "cancelled"
	// ActionError: the middleware could not decide (invalid key, undecodable args, store
	// unreachable), or the write after the worker found the record taken over. In the
	// second case the worker succeeded, failed permanently, or returned an error, and its
	// outcome was not stored: the record is the new holder's. (The worker's own
	// river.JobSnooze or river.JobCancel pass through unchanged as [ActionReleased].) The error, matching
	// [pgidem.ErrLeaseLost] in that case (and wrapping the worker's), was returned to River,
	// which retries the job and replays or waits for the new holder's outcome.
	ActionError Action = "error"
	// ActionSkipped: the kind is excluded ([Config.ExcludeKinds], [SweepKind]); the
	// worker ran without a reservation.
	ActionSkipped Action = "skipped"
)

// facts is what the action table reads about one execution: pgidem's outcome and error,
// and what the worker did.
type facts struct {
	outcome     pgidem.Outcome // pgidem's outcome of the call ([pgidem.Result.Outcome])
	failed      bool           // pgidem returned an error
	started     bool           // the worker started (fn may be called and return at once when the budget ran out)
	succeeded   bool           // the worker started and returned nil
	permanent   bool           // the worker's error carries a [pgidem.PermanentError]
	control     bool           // the worker's error carries River's own river.JobSnooze or river.JobCancel
	stalled     bool           // pgidem cancelled the worker because its lease renewals stalled
	timedOut    bool           // the reservation step ran out of its budget (Config.SQLTimeout)
	notStorable bool           // the replayed stored failure is an effect whose output could not be stored
}

// reply is the form of the error River gets.
type reply int

const (
	replyWrapped        reply = iota // pgidem's error, prefixed with the job
	replyNil                         // nil: the job completes
	replyReplay                      // nil, and the replayed output is recorded with River
	replyError                       // pgidem's error unchanged: the worker's own, or pgidem's around it
	replyCancel                      // river.JobCancel wrapping pgidem's error
	replyCancelReplayed              // river.JobCancel saying the job replayed a stored failure
	replySnooze                      // river.JobSnooze with the holder's remaining lease, clamped
	replyLeaseLost                   // the worker's error, saying its lease was lost meanwhile
	replyStalled                     // the worker's error, saying pgidem cancelled it
	replyTimeout                     // the reservation step exceeded its budget
)

// verdict is what the middleware does with one execution.
type verdict struct {
	action                              Action
	reply                               reply
	outputNotStored, recordNotCompleted bool
}

// decide is the action table: it maps pgidem's outcome of the call, with what the worker
// did, to the middleware's [Action] and River's answer.
func decide(f facts) verdict {
	switch f.outcome {
	case pgidem.OutcomeReplayed, pgidem.OutcomeWaitedReplayed, pgidem.OutcomeReconciled:
		if f.failed { // the record's value does not decode: not an effect record of this middleware
			return notRun(f)
		}
		return verdict{action: ActionReplayed, reply: replyReplay}
	case pgidem.OutcomeStoredFailure:
		if f.notStorable { // an earlier execution ran the effect; only its output was lost
			return verdict{action: ActionReplayed, reply: replyNil, outputNotStored: true}
		}
		return verdict{action: ActionCancelled, reply: replyCancelReplayed}
	case pgidem.OutcomeParked: // the worker did not run; the key needs an operator
		return verdict{action: ActionCancelled, reply: replyCancel}
	case pgidem.OutcomeInProgress:
		return verdict{action: ActionSnoozed, reply: replySnooze}
	case pgidem.OutcomeExecuted, pgidem.OutcomeTakenOver, pgidem.OutcomeFailOpen:
		return ran(f)
	case pgidem.OutcomeNotStored:
		return notStored(f)
	case pgidem.OutcomeLeaseLost:
		return leaseLost(f)
	}
	// OutcomeInvalid, OutcomeFingerprintMismatch, OutcomeStoreError, OutcomeNone: the
	// worker did not run.
	return notRun(f)
}

// notRun is the verdict when the worker did not run and nothing was replayed.
func notRun(f facts) verdict {
	if f.timedOut {
		return verdict{action: ActionError, reply: replyTimeout}
	}
	return verdict{action: ActionError, reply: replyWrapped}
}

// ran is the verdict when pgidem ran fn and wrote what followed (or ran it unprotected).
func ran(f facts) verdict {
	switch {
	case !f.started:
		return notRun(f) // fn was called as the budget ran out: the worker never started
	case f.succeeded && f.failed:
		// The effect ran, but the store kept failing and the record is not completed: a
		// retry would take the reservation over once its lease ends and run the effect
		// again, so the job completes.
		return verdict{action: ActionExecuted, reply: replyNil, recordNotCompleted: true}
	case f.succeeded:
		return verdict{action: ActionExecuted, reply: replyNil}
	}
	return workerFailed(f)
}

// workerFailed is the verdict for a worker error whose record pgidem released, or stored
// as a permanent failure.
func workerFailed(f facts) verdict {
	switch {
	case f.control && f.permanent:
		return verdict{action: ActionCancelled, reply: replyError} // river.JobCancel(pgidem.Permanent(e)): stored
	case f.control:
		return verdict{action: ActionReleased, reply: replyError} // River's own control errors pass through
	case f.permanent:
		return verdict{action: ActionCancelled, reply: replyCancel} // the verdict stands: River does not retry
	case f.stalled:
		return verdict{action: ActionReleased, reply: replyStalled}
	}
	return verdict{action: ActionReleased, reply: replyError}
}

// notStored is the verdict when the worker ran and its output, or its permanent failure,
// could not be stored.
func notStored(f facts) verdict {
	if f.succeeded {
		// pgidem completed the record without the output (the effect is not repeated),
		// and River already holds the output in the job's metadata: the job completes.
		return verdict{action: ActionExecuted, reply: replyNil, outputNotStored: true}
	}
	v := workerFailed(f)
	v.recordNotCompleted = v.action == ActionCancelled // the failure stands without its record
	return v
}

// leaseLost is the verdict when the write after the worker found the record taken over:
// nothing of this execution was written, and the record is the new holder's.
func leaseLost(f facts) verdict {
	switch {
	case !f.started:
		return notRun(f)
	case f.succeeded, f.permanent && !f.control:
		// River's retry replays or waits for the new holder's outcome; the error makes
		// the anomaly visible on the job.
		return verdict{action: ActionError, reply: replyWrapped}
	case f.control && f.permanent:
		return verdict{action: ActionError, reply: replyError}
	case f.control:
		return verdict{action: ActionReleased, reply: replyError}
	}
	// Most likely the worker's context error (pgidem cancelled it as the lease ran out):
	// say so, or River's errors column would show a bare "context canceled" for what may
	// be an effect run twice.
	return verdict{action: ActionError, reply: replyLeaseLost}
}
