package store_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

func TestReadAndForgetRecord(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insertRecords(t, db.Pool, "pgidem_record", incident()...)
	s := store.New("")

	r, err := s.ReadRecord(ctx, db.Pool, "invoices", "order-9")
	require.NoError(t, err)
	require.Equal(t, store.StatusCompleted, r.Status)
	require.JSONEq(t, `{"id": 1}`, string(r.Result))
	_, err = s.ReadRecord(ctx, db.Pool, "invoices", "order-404")
	require.True(t, store.IsNoRows(err), "%v", err)

	// A live holder's record is refused without force, and returned as it stands.
	r, deleted, err := s.ForgetRecord(ctx, db.Pool, "invoices", "order-10", false)
	require.NoError(t, err)
	require.False(t, deleted)
	require.True(t, r.Live())
	require.InDelta(t, time.Hour.Seconds(), r.RetryAfter().Seconds(), 60)
	_, err = s.ReadRecord(ctx, db.Pool, "invoices", "order-10")
	require.NoError(t, err, "still there")

	r, deleted, err = s.ForgetRecord(ctx, db.Pool, "invoices", "order-10", true)
	require.NoError(t, err)
	require.True(t, deleted, "force deletes a live record")
	require.Equal(t, store.StatusInProgress, r.Status)

	// A dead holder's record and a finished one are deleted without force.
	for _, key := range []string{"order-7", "order-9"} {
		r, deleted, err = s.ForgetRecord(ctx, db.Pool, "invoices", key, false)
		require.NoError(t, err)
		require.True(t, deleted, key)
		_, err = s.ReadRecord(ctx, db.Pool, "invoices", key)
		require.True(t, store.IsNoRows(err), "%s: %v", key, err)
	}
	require.Equal(t, 2, r.Attempts)

	_, _, err = s.ForgetRecord(ctx, db.Pool, "invoices", "order-404", true)
	require.True(t, store.IsNoRows(err), "%v", err)
}

func TestReadAndForgetInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, payload, expires_at)
		VALUES ('billing', 'm-1', '{"n": 1}', now() + interval '1 day')`)
	require.NoError(t, err)
	s := store.New("")

	r, err := s.ReadInbox(ctx, db.Pool, "billing", "m-1")
	require.NoError(t, err)
	require.Equal(t, "m-1", r.MessageID)
	require.JSONEq(t, `{"n": 1}`, string(r.Payload))
	require.False(t, r.Expired)
	_, err = s.ReadInbox(ctx, db.Pool, "billing", "m-2")
	require.True(t, store.IsNoRows(err), "%v", err)

	r, err = s.ForgetInbox(ctx, db.Pool, "billing", "m-1")
	require.NoError(t, err)
	require.Equal(t, "billing", r.Consumer)
	_, err = s.ForgetInbox(ctx, db.Pool, "billing", "m-1")
	require.True(t, store.IsNoRows(err), "deleted: %v", err)
}

func TestStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	s := store.New("")
	stats, err := s.RecordStats(ctx, db.Pool)
	require.NoError(t, err)
	require.Empty(t, stats)

	insertRecords(t, db.Pool, "pgidem_record", incident()...)
	_, err = db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at)
		VALUES ('billing', 'm-1', now() + interval '1 day'), ('billing', 'm-2', now() - interval '1 second')`)
	require.NoError(t, err)
	stats, err = s.RecordStats(ctx, db.Pool)
	require.NoError(t, err)
	require.Len(t, stats, 2)
	invoices, mail := stats[0], stats[1]
	require.Equal(t, "invoices", invoices.Namespace)
	require.Equal(t, []int64{2, 1, 0, 1, 1, 1}, []int64{invoices.InProgress, invoices.Completed, invoices.Failed,
		invoices.LeaseExpired, invoices.TookOver, invoices.Sweepable})
	require.NotNil(t, invoices.Oldest)
	require.Equal(t, "order-7", invoices.Oldest.Key, "the longest-running holder, dead or alive")
	require.InDelta(t, (4 * time.Hour).Seconds(), invoices.DBNow.Sub(invoices.Oldest.CreatedAt).Seconds(), 60)
	require.InDelta(t, -time.Hour.Seconds(), invoices.Oldest.LeaseExpiresAt.Sub(invoices.DBNow).Seconds(), 60)
	require.Equal(t, "mail", mail.Namespace)
	require.Equal(t, []int64{0, 1, 1, 0, 0, 1}, []int64{mail.InProgress, mail.Completed, mail.Failed,
		mail.LeaseExpired, mail.TookOver, mail.Sweepable})
	require.Nil(t, mail.Oldest)

	rows, expired, err := s.InboxStats(ctx, db.Pool)
	require.NoError(t, err)
	require.Equal(t, []int64{2, 1}, []int64{rows, expired})

	bytes, pretty, err := s.RecordTableSize(ctx, db.Pool)
	require.NoError(t, err)
	require.Positive(t, bytes)
	require.NotEmpty(t, pretty)
	bytes, _, err = s.InboxTableSize(ctx, db.Pool)
	require.NoError(t, err)
	require.Positive(t, bytes)
}

func TestCatalog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)

	record, inbox, err := store.New("").TablesExist(ctx, db.Pool)
	require.NoError(t, err)
	require.True(t, record)
	require.True(t, inbox)
	record, inbox, err = store.New("elsewhere").TablesExist(ctx, db.Pool)
	require.NoError(t, err, "a missing schema is no error")
	require.False(t, record)
	require.False(t, inbox)

	exists, err := store.SchemaExists(ctx, db.Pool, "public")
	require.NoError(t, err)
	require.True(t, exists)
	exists, err = store.SchemaExists(ctx, db.Pool, "PUBLIC")
	require.NoError(t, err)
	require.False(t, exists, "compared exactly")

	current, ok, err := store.CurrentSchema(ctx, db.Pool.QueryRow)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, "public", current)

	others, err := store.OtherInstalls(ctx, db.Pool)
	require.NoError(t, err)
	require.Empty(t, others, "installed in the current schema only")
	_, err = db.Pool.Exec(ctx, `CREATE SCHEMA tenant; CREATE TABLE tenant.pgidem_record (LIKE public.pgidem_record)`)
	require.NoError(t, err)
	others, err = store.OtherInstalls(ctx, db.Pool)
	require.NoError(t, err)
	require.Equal(t, []string{"tenant"}, others)
	record, inbox, err = store.New("tenant").TablesExist(ctx, db.Pool)
	require.NoError(t, err)
	require.True(t, record)
	require.False(t, inbox)
}

func TestMigrationLockHolder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	const lockID int64 = 0x7067696465_6d74 // both halves of the bigint matter
	_, held, err := store.MigrationLockHolder(ctx, db.Pool.QueryRow, lockID)
	require.NoError(t, err)
	require.False(t, held)

	conn, err := db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var pid int
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid() FROM (SELECT pg_advisory_lock($1)) l", lockID).Scan(&pid))
	defer func() {
		_, err := conn.Exec(ctx, "SELECT pg_advisory_unlock($1)", lockID)
		require.NoError(t, err)
	}()
	holder, held, err := store.MigrationLockHolder(ctx, db.Pool.QueryRow, lockID)
	require.NoError(t, err)
	require.True(t, held)
	require.Equal(t, pid, holder)
	_, held, err = store.MigrationLockHolder(ctx, db.Pool.QueryRow, lockID+1)
	require.NoError(t, err)
	require.False(t, held, "another lock")
}
