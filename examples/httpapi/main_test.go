package main

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHTTPAPI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	got, err := run(ctx, &out)
	t.Log("\n" + out.String())
	require.NoError(t, err)

	lost := got.LostResponse
	require.Equal(t, 1, lost.Charges, "the retry with the key does not charge again")
	require.Equal(t, 1, lost.Payments)
	require.Regexp(t, `^lost (409 )+201$`, lost.Statuses, "lost, in progress until the first finished, then the replay")
	require.Contains(t, out.String(), "(Idempotent-Replayed: true)")

	require.Equal(t, sceneCounts{Requests: 1, Statuses: "422", Charges: 0, Payments: 0}, got.ReusedKey)

	require.Equal(t, sceneCounts{Requests: 2, Statuses: "lost 201", Charges: 2, Payments: 2}, got.NoKey,
		"without a key the retry charges the card again")

	require.Equal(t, sceneCounts{Requests: 2, Statuses: "lost 201", Charges: 1, Payments: 1}, got.FailAfterCharge,
		"the handler ran twice; its charge and its payment are replayed from their records")
}
