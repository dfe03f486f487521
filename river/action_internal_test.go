package pgidemriver

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// The action table maps every pgidem outcome, with what the worker did, to one verdict.
// The integration tests (middleware_test.go, lease_test.go, store_failure_test.go) hold
// the same cases against real Postgres and River; this table holds the mapping itself.
func TestDecide(t *testing.T) {
	t.Parallel()
	var (
		succeeded = facts{started: true, succeeded: true}
		failed    = facts{started: true, failed: true}
		permanent = facts{started: true, failed: true, permanent: true}
		control   = facts{started: true, failed: true, control: true}
		cancelled = facts{started: true, failed: true, control: true, permanent: true} // river.JobCancel(pgidem.Permanent(e))
		stalled   = facts{started: true, failed: true, stalled: true}
		notBegun  = facts{failed: true}                 // fn returned as the budget ran out
		timedOut  = facts{failed: true, timedOut: true} // the reservation step ran out of time
	)
	with := func(f facts, o pgidem.Outcome) facts { f.outcome = o; return f }
	for _, tc := range []struct {
		name string
		in   facts
		want verdict
	}{
		{"Replayed", facts{outcome: pgidem.OutcomeReplayed}, verdict{action: ActionReplayed, reply: replyReplay}},
		{"WaitedReplayed", facts{outcome: pgidem.OutcomeWaitedReplayed}, verdict{action: ActionReplayed, reply: replyReplay}},
		{"ReplayNotDecodable", facts{outcome: pgidem.OutcomeReplayed, failed: true}, verdict{action: ActionError, reply: replyWrapped}},
		{"StoredFailure", facts{outcome: pgidem.OutcomeStoredFailure, failed: true}, verdict{action: ActionCancelled, reply: replyCancelReplayed}},
		{"Parked", facts{outcome: pgidem.OutcomeParked, failed: true}, verdict{action: ActionCancelled, reply: replyCancel}},
		{"StoredOutputNotStorable", facts{outcome: pgidem.OutcomeStoredFailure, failed: true, notStorable: true},
			verdict{action: ActionReplayed, reply: replyNil, outputNotStored: true}},
		{"InProgress", facts{outcome: pgidem.OutcomeInProgress, failed: true}, verdict{action: ActionSnoozed, reply: replySnooze}},
		{"InProgressAsBudgetEnds", facts{outcome: pgidem.OutcomeInProgress, failed: true, timedOut: true}, verdict{action: ActionSnoozed, reply: replySnooze}},

		{"ExecutedSucceeded", with(succeeded, pgidem.OutcomeExecuted), verdict{action: ActionExecuted, reply: replyNil}},
		{"TakenOverSucceeded", with(succeeded, pgidem.OutcomeTakenOver), verdict{action: ActionExecuted, reply: replyNil}},
		{"FailOpenSucceeded", with(succeeded, pgidem.OutcomeFailOpen), verdict{action: ActionExecuted, reply: replyNil}},
		{"ExecutedRecordNotCompleted", facts{outcome: pgidem.OutcomeExecuted, started: true, succeeded: true, failed: true},
			verdict{action: ActionExecuted, reply: replyNil, recordNotCompleted: true}},
		{"ExecutedWorkerError", with(failed, pgidem.OutcomeExecuted), verdict{action: ActionReleased, reply: replyError}},
		{"TakenOverWorkerError", with(failed, pgidem.OutcomeTakenOver), verdict{action: ActionReleased, reply: replyError}},
		{"FailOpenWorkerError", with(failed, pgidem.OutcomeFailOpen), verdict{action: ActionReleased, reply: replyError}},
		{"ExecutedPermanent", with(permanent, pgidem.OutcomeExecuted), verdict{action: ActionCancelled, reply: replyCancel}},
		{"FailOpenPermanent", with(permanent, pgidem.OutcomeFailOpen), verdict{action: ActionCancelled, reply: replyCancel}},
		{"ExecutedWorkerSnoozeOrCancel", with(control, pgidem.OutcomeExecuted), verdict{action: ActionReleased, reply: replyError}},
		{"ExecutedCancelPermanent", with(cancelled, pgidem.OutcomeExecuted), verdict{action: ActionCancelled, reply: replyError}},
		{"ExecutedStalled", with(stalled, pgidem.OutcomeExecuted), verdict{action: ActionReleased, reply: replyStalled}},
		{"ExecutedWorkerNotStarted", with(notBegun, pgidem.OutcomeExecuted), verdict{action: ActionError, reply: replyWrapped}},
		{"ExecutedBudgetRanOut", with(timedOut, pgidem.OutcomeExecuted), verdict{action: ActionError, reply: replyTimeout}},

		{"NotStoredOutput", facts{outcome: pgidem.OutcomeNotStored, started: true, succeeded: true, failed: true},
			verdict{action: ActionExecuted, reply: replyNil, outputNotStored: true}},
		{"NotStoredPermanent", with(permanent, pgidem.OutcomeNotStored),
			verdict{action: ActionCancelled, reply: replyCancel, recordNotCompleted: true}},
		{"NotStoredCancelPermanent", with(cancelled, pgidem.OutcomeNotStored),
			verdict{action: ActionCancelled, reply: replyError, recordNotCompleted: true}},

		{"LeaseLostSucceeded", facts{outcome: pgidem.OutcomeLeaseLost, started: true, succeeded: true, failed: true},
			verdict{action: ActionError, reply: replyWrapped}},
		{"LeaseLostPermanent", with(permanent, pgidem.OutcomeLeaseLost), verdict{action: ActionError, reply: replyWrapped}},
		{"LeaseLostCancelPermanent", with(cancelled, pgidem.OutcomeLeaseLost), verdict{action: ActionError, reply: replyError}},
		{"LeaseLostWorkerSnoozeOrCancel", with(control, pgidem.OutcomeLeaseLost), verdict{action: ActionReleased, reply: replyError}},
		{"LeaseLostWorkerError", with(failed, pgidem.OutcomeLeaseLost), verdict{action: ActionError, reply: replyLeaseLost}},
		{"LeaseLostStalledWorker", with(stalled, pgidem.OutcomeLeaseLost), verdict{action: ActionError, reply: replyLeaseLost}},
		{"LeaseLostBudgetRanOut", with(timedOut, pgidem.OutcomeLeaseLost), verdict{action: ActionError, reply: replyTimeout}},

		{"Invalid", facts{outcome: pgidem.OutcomeInvalid, failed: true}, verdict{action: ActionError, reply: replyWrapped}},
		{"FingerprintMismatch", facts{outcome: pgidem.OutcomeFingerprintMismatch, failed: true}, verdict{action: ActionError, reply: replyWrapped}},
		{"StoreError", facts{outcome: pgidem.OutcomeStoreError, failed: true}, verdict{action: ActionError, reply: replyWrapped}},
		{"None", facts{outcome: pgidem.OutcomeNone, failed: true}, verdict{action: ActionError, reply: replyWrapped}},
		{"NoneBudgetRanOut", with(timedOut, pgidem.OutcomeNone), verdict{action: ActionError, reply: replyTimeout}},
		{"StoreErrorBudgetRanOut", with(timedOut, pgidem.OutcomeStoreError), verdict{action: ActionError, reply: replyTimeout}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, decide(tc.in))
		})
	}
}
