package main_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

func TestStats(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)

	t.Run("Empty", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "stats"))
		require.Regexp(t, `^table pgidem_record: 0 records \(0 expired, not swept\), \d+ kB\n`+
			`table pgidem_inbox: 0 messages \(0 expired, not swept\), \d+ kB\n$`, out)
	})

	insert(t, db.Pool, "pgidem_record", standardFixtures()...)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO pgidem_inbox (consumer, message_id, expires_at)
		VALUES ('billing', 'm-1', now() + interval '1 day'), ('billing', 'm-2', now() - interval '1 day')`)
	require.NoError(t, err)

	t.Run("Table", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "stats"))
		lines := strings.Split(out, "\n")
		require.Equal(t, []string{"NAMESPACE", "IN", "PROGRESS", "COMPLETED", "FAILED", "PARKED", "LEASE", "EXPIRED", "TOOK", "OVER",
			"EXPIRED", "OLDEST", "IN", "PROGRESS", "AGE", "LEASE"}, strings.Fields(lines[0]))
		require.Equal(t, []string{"invoices", "2", "1", "0", "0", "1", "1", "0", "order-7.invoice", "4h0m", "expired", "1h0m", "ago"}, strings.Fields(lines[1]))
		require.Equal(t, []string{"mail", "0", "1", "1", "0", "0", "0", "1", "-", "-", "-"}, strings.Fields(lines[2]))
		require.Regexp(t, `\ntable pgidem_record: 5 records \(1 expired, not swept\), \d+ kB\n`+
			`table pgidem_inbox: 2 messages \(1 expired, not swept\), \d+ kB\n$`, out)
	})

	t.Run("JSON", func(t *testing.T) {
		var stats struct {
			Namespaces []struct {
				Namespace        string `json:"namespace"`
				InProgress       int64  `json:"in_progress"`
				Completed        int64  `json:"completed"`
				Failed           int64  `json:"failed"`
				LeaseExpired     int64  `json:"lease_expired"`
				TookOver         int64  `json:"took_over"`
				Expired          int64  `json:"expired"`
				OldestInProgress *struct {
					Key                   string  `json:"key"`
					LeaseRemainingSeconds float64 `json:"lease_remaining_seconds"`
				} `json:"oldest_in_progress"`
			} `json:"namespaces"`
			Table struct {
				Table     string `json:"table"`
				Rows      int64  `json:"rows"`
				Expired   int64  `json:"expired"`
				SizeBytes int64  `json:"size_bytes"`
			} `json:"table"`
			Inbox *struct {
				Table   string `json:"table"`
				Rows    int64  `json:"rows"`
				Expired int64  `json:"expired"`
			} `json:"inbox"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "stats", "--json"))), &stats))
		require.Len(t, stats.Namespaces, 2)
		inv := stats.Namespaces[0]
		require.Equal(t, "invoices", inv.Namespace)
		require.Equal(t, []int64{2, 1, 0, 1, 1, 0}, []int64{inv.InProgress, inv.Completed, inv.Failed, inv.LeaseExpired, inv.TookOver, inv.Expired})
		require.NotNil(t, inv.OldestInProgress)
		require.Equal(t, "order-7.invoice", inv.OldestInProgress.Key)
		require.Less(t, inv.OldestInProgress.LeaseRemainingSeconds, float64(0))
		require.Nil(t, stats.Namespaces[1].OldestInProgress)
		require.Equal(t, int64(5), stats.Table.Rows)
		require.Equal(t, int64(1), stats.Table.Expired)
		require.Equal(t, "pgidem_record", stats.Table.Table)
		require.Positive(t, stats.Table.SizeBytes)
		require.NotNil(t, stats.Inbox)
		require.Equal(t, "pgidem_inbox", stats.Inbox.Table)
		require.Equal(t, []int64{2, 1}, []int64{stats.Inbox.Rows, stats.Inbox.Expired})
	})

	// A parked record counts under PARKED and in the table's rows.
	t.Run("Parked", func(t *testing.T) {
		parkRecord(t, db, "refunds", "order-3.refund", 2)
		out := requireOK(t, cli(t, db.URL, "stats"))
		lines := strings.Split(out, "\n")
		require.Equal(t, []string{"refunds", "0", "0", "0", "1", "0", "1", "0", "-", "-", "-"}, strings.Fields(lines[3]))
		require.Regexp(t, `\ntable pgidem_record: 6 records \(1 expired, not swept\)`, out)
		var stats struct {
			Namespaces []struct {
				Namespace string `json:"namespace"`
				Parked    int64  `json:"parked"`
			} `json:"namespaces"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "stats", "--json"))), &stats))
		require.Len(t, stats.Namespaces, 3)
		require.Equal(t, "refunds", stats.Namespaces[2].Namespace)
		require.Equal(t, []int64{0, 0, 1}, []int64{stats.Namespaces[0].Parked, stats.Namespaces[1].Parked, stats.Namespaces[2].Parked})
	})
}

// TestStatsWithoutInbox covers a database holding only the record table (migrations
// vendored selectively): stats reports no inbox instead of failing.
func TestStatsWithoutInbox(t *testing.T) {
	t.Parallel()
	db := upTo(t, 1)

	out := requireOK(t, cli(t, db.URL, "stats"))
	require.Regexp(t, `^table pgidem_record: 0 records \(0 expired, not swept\), \d+ kB\n$`, out)
	var stats map[string]any
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "stats", "--json"))), &stats))
	require.Contains(t, stats, "inbox")
	require.Nil(t, stats["inbox"])
}
