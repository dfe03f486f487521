package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pgidem/pgidem/pgidem"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestLab(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	rows, err := run(ctx, &out)
	require.NoError(t, err, out.String())
	t.Log("\n" + out.String())
	require.Len(t, rows, 8)

	byName := map[string]row{}
	for _, r := range rows {
		byName[r.Name] = r
	}
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
	require.Equal(t, "em_1", raise.Receipts["A"])
	require.Equal(t, "in progress, requeued", raise.Receipts["B"])
	require.Equal(t, "em_1 (replayed)", raise.Receipts["C"])

	require.Equal(t, 2, byName["key = job id"].Mails)
	require.Equal(t, 1, byName["key = order-9:invoice (no reserved chars)"].Mails)
	require.Equal(t, 1, byName["key = order-9.invoice"].Mails)
	invalid := byName[`key = "order-9\x00invoice" (invalid)`]
	require.ErrorIs(t, invalid.Err, pgidem.ErrInvalidKey)
	require.Equal(t, 0, invalid.Mails)
	require.Equal(t, 2, invalid.Unacked, "the jobs stay unacked and visible to be retried or dead-lettered")

	require.Equal(t, 3, strings.Count(out.String(), "scene "), "one heading per scene")
	require.Contains(t, out.String(), "{A: em_1, B: em_1} mails sent=1")
}
