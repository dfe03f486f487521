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

func TestConsumer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out bytes.Buffer
	got, err := run(ctx, &out)
	require.NoError(t, err, out.String())
	t.Log("\n" + out.String())

	require.Equal(t, sceneCounts{Deliveries: 3, LedgerRows: 1, MailsSent: 1, MailsReplayed: 0}, got.Redelivery,
		"three deliveries of one event: one ledger row, one mail")
	require.Equal(t, sceneCounts{Deliveries: 2, LedgerRows: 1, MailsSent: 1, MailsReplayed: 1}, got.CrashAfterMail,
		"crash after the mail: the row rolls back and is written once; the mail is replayed, not resent")
	require.Contains(t, out.String(), "deliveries=3 ledger rows=1 mails sent=1")
}
