package pgidemwatermill

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// Every outcome pgidem reports has its own answer in the table.
func TestOutcomeRepliesCoverEveryOutcome(t *testing.T) {
	t.Parallel()
	for _, o := range []pgidem.Outcome{
		pgidem.OutcomeNone, pgidem.OutcomeExecuted, pgidem.OutcomeTakenOver, pgidem.OutcomeReconciled,
		pgidem.OutcomeReplayed, pgidem.OutcomeWaitedReplayed, pgidem.OutcomeStoredFailure,
		pgidem.OutcomeInProgress, pgidem.OutcomeFingerprintMismatch, pgidem.OutcomeLeaseLost,
		pgidem.OutcomeNotStored, pgidem.OutcomeFailOpen, pgidem.OutcomeInvalid, pgidem.OutcomeStoreError,
		pgidem.OutcomeParked,
	} {
		require.Contains(t, outcomeReplies, o, "outcome %v", o)
	}
}
