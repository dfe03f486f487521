package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// record is a pgidem_record row inserted with plain SQL; times are relative to the
// database clock and far from any boundary.
type record struct {
	namespace, key, status string
	attempts               int
	result                 *string
	// lease is the lease left of an in-progress record (negative: run out).
	lease time.Duration
	// ttl is the time left before the record expires (negative: expired).
	ttl time.Duration
	// age is how long ago the record was created.
	age time.Duration
}

func insertRecords(t *testing.T, pool *pgxpool.Pool, table string, records ...record) {
	t.Helper()
	for _, r := range records {
		_, err := pool.Exec(context.Background(), `
			INSERT INTO `+table+` (namespace, key, status, owner, attempts, result,
				lease_expires_at, expires_at, created_at, updated_at, completed_at)
			VALUES ($1, $2, $3, gen_random_uuid(), $4, $5::jsonb,
				CASE WHEN $3 = 'in_progress' THEN now() + make_interval(secs => $6) END,
				now() + make_interval(secs => $7), now() - make_interval(secs => $8), now() - make_interval(secs => $8),
				CASE WHEN $3 <> 'in_progress' THEN now() - make_interval(secs => $8) END)`,
			r.namespace, r.key, r.status, max(r.attempts, 1), r.result, r.lease.Seconds(), r.ttl.Seconds(), r.age.Seconds())
		require.NoError(t, err, "insert %s/%s", r.namespace, r.key)
	}
}

func ptr(s string) *string { return &s }

// incident is a small set of records: a double-run invoice, a live and a dead holder, an
// expired failure, a completed receipt.
func incident() []record {
	return []record{
		{namespace: "invoices", key: "order-9", status: "completed", attempts: 2, result: ptr(`{"id": 1}`), ttl: 23 * time.Hour, age: 2 * time.Hour},
		{namespace: "invoices", key: "order-10", status: "in_progress", lease: time.Hour, ttl: 24 * time.Hour, age: time.Hour},
		{namespace: "invoices", key: "order-7", status: "in_progress", lease: -time.Hour, ttl: -time.Minute, age: 4 * time.Hour},
		{namespace: "mail", key: "order-9", status: "failed", ttl: -time.Hour, age: 25 * time.Hour},
		{namespace: "mail", key: "order-8", status: "completed", result: ptr(`null`), ttl: time.Hour, age: 3 * time.Hour},
	}
}

func keys(records []store.ListedRecord) []string {
	out := make([]string, 0, len(records))
	for _, r := range records {
		out = append(out, r.Namespace+"/"+r.Key)
	}
	return out
}

func TestListRecords(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insertRecords(t, db.Pool, "pgidem_record", incident()...)
	s := store.New("")
	list := func(f *store.RecordFilter) ([]string, bool) {
		t.Helper()
		records, more, err := s.ListRecords(ctx, db.Pool, f)
		require.NoError(t, err)
		return keys(records), more
	}

	all, more := list(&store.RecordFilter{})
	require.Equal(t, []string{"invoices/order-10", "invoices/order-9", "mail/order-8", "invoices/order-7", "mail/order-9"}, all, "newest first")
	require.False(t, more)

	got, _ := list(&store.RecordFilter{Namespace: "mail"})
	require.Equal(t, []string{"mail/order-8", "mail/order-9"}, got)
	got, _ = list(&store.RecordFilter{Status: store.StatusInProgress})
	require.Equal(t, []string{"invoices/order-10", "invoices/order-7"}, got)
	got, _ = list(&store.RecordFilter{Namespace: "invoices", Status: store.StatusCompleted})
	require.Equal(t, []string{"invoices/order-9"}, got)
	got, _ = list(&store.RecordFilter{MinAttempts: 2})
	require.Equal(t, []string{"invoices/order-9"}, got)
	got, _ = list(&store.RecordFilter{Sweepable: true})
	require.Equal(t, []string{"invoices/order-7", "mail/order-9"}, got, "past the TTL, and not under a live lease")
	got, _ = list(&store.RecordFilter{Namespace: "nobody"})
	require.Empty(t, got)

	t.Run("Limit", func(t *testing.T) {
		got, more := list(&store.RecordFilter{Limit: 2})
		require.Equal(t, all[:2], got)
		require.True(t, more)
		got, more = list(&store.RecordFilter{Limit: 5})
		require.Equal(t, all, got)
		require.False(t, more, "exactly the limit matches")
		got, more = list(&store.RecordFilter{Limit: 2, Values: true})
		require.Equal(t, all[:2], got)
		require.False(t, more, "with values, no record beyond the limit is read")
	})

	t.Run("Values", func(t *testing.T) {
		records, _, err := s.ListRecords(ctx, db.Pool, &store.RecordFilter{MinAttempts: 2})
		require.NoError(t, err)
		require.Len(t, records, 1)
		require.Nil(t, records[0].Result, "without Values no result is read")
		records, _, err = s.ListRecords(ctx, db.Pool, &store.RecordFilter{MinAttempts: 2, Values: true})
		require.NoError(t, err)
		require.Len(t, records, 1)
		require.JSONEq(t, `{"id": 1}`, string(records[0].Result))
		require.Nil(t, records[0].Failure)
	})

	t.Run("Verdicts", func(t *testing.T) {
		records, _, err := s.ListRecords(ctx, db.Pool, &store.RecordFilter{Namespace: "invoices"})
		require.NoError(t, err)
		byKey := map[string]store.ListedRecord{}
		for _, r := range records {
			byKey[r.Key] = r
		}
		live, dead, done := byKey["order-10"], byKey["order-7"], byKey["order-9"]
		require.True(t, live.Live())
		require.False(t, live.Expired)
		require.True(t, dead.LeaseExpired)
		require.True(t, dead.Expired)
		require.Equal(t, store.StatusCompleted, done.Status)
		require.Equal(t, 2, done.Attempts)
		require.True(t, done.Owner.Valid)
		require.False(t, done.LeaseExpires.Valid)
		require.True(t, done.CompletedAt.Valid)
		require.InDelta(t, time.Hour.Seconds(), live.LeaseExpires.Time.Sub(live.DBNow).Seconds(), 60, "DBNow is the database clock")
		require.InDelta(t, (2 * time.Hour).Seconds(), done.DBNow.Sub(done.CreatedAt).Seconds(), 60)
	})
}

// The records ListRecords calls sweepable are exactly those the sweep statement deletes.
func TestListRecordsSweepableMatchesSweep(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insertRecords(t, db.Pool, "pgidem_record", incident()...)
	// A dead holder's record within its TTL: taken over by the next call, not swept.
	insertRecords(t, db.Pool, "pgidem_record", record{namespace: "mail", key: "dead-holder", status: "in_progress", lease: -time.Second, ttl: time.Hour})
	s := store.New("")
	sweepable, _, err := s.ListRecords(ctx, db.Pool, &store.RecordFilter{Sweepable: true})
	require.NoError(t, err)
	require.Len(t, sweepable, 2)
	rows, err := db.Pool.Query(ctx, "WITH swept AS ("+s.SweepRecords+" RETURNING namespace, key, created_at) SELECT namespace, key FROM swept ORDER BY created_at DESC", 100)
	require.NoError(t, err)
	var swept []string
	for rows.Next() {
		var namespace, key string
		require.NoError(t, rows.Scan(&namespace, &key))
		swept = append(swept, namespace+"/"+key)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, keys(sweepable), swept)
}

func TestListInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, payload, received_at, expires_at) VALUES
		('billing', 'm-1', '{"n": 1}', now() - interval '3 hours', now() + interval '1 day'),
		('billing', 'm-2', NULL, now() - interval '2 hours', now() - interval '1 hour'),
		('shipping', 'm-1', '[]', now() - interval '1 hour', now() + interval '1 day')`)
	require.NoError(t, err)
	s := store.New("")
	list := func(f *store.InboxFilter) ([]string, bool) {
		t.Helper()
		rows, more, err := s.ListInbox(ctx, db.Pool, f)
		require.NoError(t, err)
		var out []string
		for _, r := range rows {
			out = append(out, r.Consumer+"/"+r.MessageID)
		}
		return out, more
	}

	got, more := list(&store.InboxFilter{})
	require.Equal(t, []string{"shipping/m-1", "billing/m-2", "billing/m-1"}, got, "newest first")
	require.False(t, more)
	got, _ = list(&store.InboxFilter{Consumer: "billing"})
	require.Equal(t, []string{"billing/m-2", "billing/m-1"}, got)
	got, _ = list(&store.InboxFilter{MessageID: "m-1"})
	require.Equal(t, []string{"shipping/m-1", "billing/m-1"}, got)
	got, _ = list(&store.InboxFilter{Expired: true})
	require.Equal(t, []string{"billing/m-2"}, got)
	got, more = list(&store.InboxFilter{Limit: 1})
	require.Equal(t, []string{"shipping/m-1"}, got)
	require.True(t, more)
	got, more = list(&store.InboxFilter{Limit: 3})
	require.Len(t, got, 3)
	require.False(t, more)

	rows, _, err := s.ListInbox(ctx, db.Pool, &store.InboxFilter{Consumer: "billing"})
	require.NoError(t, err)
	require.True(t, rows[0].Expired)
	require.Nil(t, rows[0].Payload)
	require.False(t, rows[1].Expired)
	require.JSONEq(t, `{"n": 1}`, string(rows[1].Payload))
	require.InDelta(t, (3 * time.Hour).Seconds(), rows[1].DBNow.Sub(rows[1].ReceivedAt).Seconds(), 60)
}
