package pgidem

import "github.com/pgidem/pgidem/internal/protocol"

// Outcome says what a call did ([Result.Outcome]). Its values share their names with the
// matching event kinds ([EventKind]), so a metric label and a result read the same.
// Adapters (pgidemriver, pgidemhttp) map each outcome to their own action.
type Outcome = protocol.Outcome

// Outcomes of [DoResult], [DoTxResult] and [DoInTxResult]. A call that returns no error
// ends in Executed, TakenOver, Replayed, WaitedReplayed or FailOpen; the others come
// with an error.
const (
	// OutcomeNone: the call ended before the protocol reached an outcome, such as when
	// ctx ended first.
	OutcomeNone = protocol.OutcomeNone
	// OutcomeExecuted: fn ran under a fresh reservation. With fn's error, the record was
	// released (or, for a [Permanent] error, stored).
	OutcomeExecuted = protocol.OutcomeExecuted
	// OutcomeTakenOver: fn ran after taking over a dead holder's expired lease; the effect
	// may have run more than once (the record's attempts say so).
	OutcomeTakenOver = protocol.OutcomeTakenOver
	// OutcomeReconciled: the record showed an earlier attempt and [DoOpts.Reconcile]
	// found its effect done: the value it returned was stored and returned; fn did not run.
	OutcomeReconciled = protocol.OutcomeReconciled
	// OutcomeReplayed: the stored result was returned without running fn.
	OutcomeReplayed = protocol.OutcomeReplayed
	// OutcomeWaitedReplayed: the call waited for another holder ([InFlightWait]), then
	// replayed the result it stored.
	OutcomeWaitedReplayed = protocol.OutcomeWaitedReplayed
	// OutcomeStoredFailure: a stored [Permanent] failure was replayed as a
	// [*StoredFailureError]; fn did not run.
	OutcomeStoredFailure = protocol.OutcomeStoredFailure
	// OutcomeParked: the record is parked at the attempts cap ([Config.MaxAttempts]):
	// this call parked it or found it parked, and returned a [*ParkedError]; fn did not
	// run. Result.Replayed is set: the error comes from the record.
	OutcomeParked = protocol.OutcomeParked
	// OutcomeInProgress: another holder's reservation is live; the call returned an
	// [*InProgressError] and [Result.RetryAfter] holds its hint.
	OutcomeInProgress = protocol.OutcomeInProgress
	// OutcomeFingerprintMismatch: the key's record was made for a different payload
	// ([ErrFingerprintMismatch]); fn did not run.
	OutcomeFingerprintMismatch = protocol.OutcomeFingerprintMismatch
	// OutcomeLeaseLost: fn ran, and the write after it found the reservation taken over
	// ([ErrLeaseLost]); the effect may have run more than once.
	OutcomeLeaseLost = protocol.OutcomeLeaseLost
	// OutcomeNotStored: fn ran, and its value ([ErrResultNotStorable]) or permanent failure
	// ([*FailureNotStoredError]) could not be stored.
	OutcomeNotStored = protocol.OutcomeNotStored
	// OutcomeFailOpen: fn ran unprotected because the store could not be reached
	// ([Config.FailOpen]).
	OutcomeFailOpen = protocol.OutcomeFailOpen
	// OutcomeInvalid: the input was refused ([ErrInvalidKey], [ErrInvalidTTL],
	// [ErrInvalidArgument]); fn did not run.
	OutcomeInvalid = protocol.OutcomeInvalid
	// OutcomeStoreError: the store failed before fn ran ([ErrStoreUnavailable]); fn did
	// not run.
	OutcomeStoreError = protocol.OutcomeStoreError
)
