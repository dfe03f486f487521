package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pgidem/pgidem/pgidem"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The card is charged once: worker 2 finds worker 1's charge at the provider and records
// it instead of charging again.
func TestReconcile(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	res, err := run(ctx, &out)
	require.NoError(t, err, out.String())
	t.Log("\n" + out.String())
	require.Equal(t, 1, res.Charges)
	require.Equal(t, "ch_1_4200", res.ChargeID)
	require.Equal(t, pgidem.OutcomeReconciled, res.Outcome)
}
