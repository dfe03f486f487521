package protocol

// Outcome says what a call did. Its values share their names with the matching event
// kinds ([EventKind]).
type Outcome string

// The outcomes of a call. A call that returns no error ends in Executed, TakenOver,
// Replayed, WaitedReplayed or FailOpen; an error comes with any outcome.
const (
	// OutcomeNone: the call ended before the protocol reached an outcome (a nil argument,
	// a context that ended).
	OutcomeNone Outcome = ""
	// OutcomeExecuted: fn ran under a fresh reservation (its error, if any, is returned
	// and the record released, unless it was a permanent failure, now stored).
	OutcomeExecuted Outcome = "executed"
	// OutcomeTakenOver: fn ran after taking over a holder's expired lease; the effect may
	// have run more than once.
	OutcomeTakenOver Outcome = "taken_over"
	// OutcomeReconciled: a holder whose record showed an earlier attempt asked the
	// reconcile hook, which found the effect done; its value was stored and fn did not run.
	OutcomeReconciled Outcome = "reconciled"
	// OutcomeReplayed: a stored result was returned without running fn.
	OutcomeReplayed Outcome = "replayed"
	// OutcomeWaitedReplayed: the call waited for another holder, then replayed its result.
	OutcomeWaitedReplayed Outcome = "waited_replayed"
	// OutcomeStoredFailure: a stored permanent failure was replayed as an error.
	OutcomeStoredFailure Outcome = "stored_failure"
	// OutcomeParked: the record is parked at the attempts cap (this call parked it, or
	// found it parked); the call returned a ParkedError and fn did not run.
	OutcomeParked Outcome = "parked"
	// OutcomeInProgress: another holder's reservation is live; the call gave up with an
	// InProgressError (at once, or after waiting).
	OutcomeInProgress Outcome = "in_progress"
	// OutcomeFingerprintMismatch: the key's record was made for a different payload.
	OutcomeFingerprintMismatch Outcome = "fingerprint_mismatch"
	// OutcomeLeaseLost: fn ran, and the write after it found the reservation taken over.
	OutcomeLeaseLost Outcome = "lease_lost"
	// OutcomeNotStored: fn ran, and its value or permanent failure could not be stored.
	OutcomeNotStored Outcome = "not_stored"
	// OutcomeFailOpen: fn ran unprotected because the store could not be reached.
	OutcomeFailOpen Outcome = "fail_open"
	// OutcomeInvalid: the call's input was refused; fn did not run.
	OutcomeInvalid Outcome = "invalid_key"
	// OutcomeStoreError: the store failed before fn ran; fn did not run.
	OutcomeStoreError Outcome = "store_error"
)

// FailureOutcome is the outcome of a call that ended with err before fn ran
// (OutcomeNone for an error that is none of the protocol's).
func FailureOutcome(err error) Outcome { return failureOutcome(err) }

// Ran reports whether fn ran under the outcome.
func (o Outcome) Ran() bool {
	switch o {
	case OutcomeExecuted, OutcomeTakenOver, OutcomeLeaseLost, OutcomeNotStored, OutcomeFailOpen:
		return true
	}
	return false
}
