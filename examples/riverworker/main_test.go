package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pgidem/pgidem/pgidem"
)

// TestMain doubles as the crash child of scene 1: run re-executes os.Executable(), which
// under go test is this test binary, with childEnv set.
func TestMain(m *testing.M) {
	if spec := os.Getenv(childEnv); spec != "" {
		runChild(spec)
		return
	}
	goleak.VerifyTestMain(m)
}

func TestRiverWorker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rows, err := run(ctx, &out)
	t.Log("\n" + out.String())
	require.NoError(t, err)
	require.Len(t, rows, 9)

	byName := map[string]Row{}
	for _, r := range rows {
		byName[r.Name] = r
	}
	invoices := byName["two jobs for order 7"]
	require.Equal(t, 1, invoices.Mails)
	require.Equal(t, 1, invoices.Invoices)
	require.EqualValues(t, 3, invoices.Swept)

	plain, keyed := byName["plain handler"], byName["handler under an idempotency key = job id"]
	require.Equal(t, 2, plain.Deliveries)
	require.Equal(t, 2, plain.Mails)
	require.Equal(t, 2, keyed.Deliveries)
	require.Equal(t, 1, keyed.Mails)

	wait := byName["in_flight=wait"]
	require.Equal(t, 1, wait.Mails)
	require.Equal(t, map[string]string{"A": "em_1", "B": "em_1"}, wait.Receipts)

	raise := byName["in_flight=raise"]
	require.Equal(t, 1, raise.Mails)
	require.Equal(t, map[string]string{"A": "em_1", "B": "in progress, snoozed", "C": "em_1 (replayed)"}, raise.Receipts)

	require.Equal(t, 2, byName["key = job id"].Mails)
	require.Equal(t, 1, byName["key = order-9:invoice (no reserved chars)"].Mails)
	require.Equal(t, 1, byName["key = order-9.invoice"].Mails)
	invalid := byName[`key = "order-9\x00invoice" (invalid)`]
	require.ErrorIs(t, invalid.Err, pgidem.ErrInvalidKey)
	require.Equal(t, 0, invalid.Mails)
	require.Equal(t, 2, invalid.Unfinished, "the jobs are not completed: River retries, then discards them")

	require.Equal(t, 3, strings.Count(out.String(), "scene "), "one heading per scene")
	require.Contains(t, out.String(), "{A: em_1, B: em_1} mails sent=1")
}
