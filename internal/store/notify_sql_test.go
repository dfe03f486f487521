package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/internal/testdb"
)

// A finishing statement notifies a key only while a session holds the key's interest
// lock, and the notification names the key on the schema's channel.
func TestFinishNotifiesOnlyWaitedKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	sql := store.New("")
	listener, err := pgx.ConnectConfig(ctx, db.Pool.Config().ConnConfig.Copy())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, listener.Close(ctx)) })
	_, err = listener.Exec(ctx, `LISTEN "pgidem"`)
	require.NoError(t, err)

	// complete reserves key and completes it, returning whether it notified.
	complete := func(key string) bool {
		t.Helper()
		var owner [16]byte // any token: one per key
		_, err := db.Pool.Exec(ctx, sql.Reserve, "mail", key, owner, nil, time.Minute.Microseconds(), time.Hour.Microseconds())
		require.NoError(t, err)
		var notified bool
		require.NoError(t, db.Pool.QueryRow(ctx, sql.Complete, "mail", key, owner, "completed", "1", nil,
			time.Hour.Microseconds()).Scan(&notified))
		return notified
	}
	var pid uint32
	require.NoError(t, listener.QueryRow(ctx, store.BackendPID).Scan(&pid))
	lock := func(stmt, key string) {
		t.Helper()
		var same bool
		require.NoError(t, listener.QueryRow(ctx, stmt, []string{"mail"}, []string{key}, pid).Scan(&same))
		require.True(t, same)
	}

	require.False(t, complete("nobody-waits"))
	lock(store.LockInterest, "waited")
	require.True(t, complete("waited"))
	n, err := listener.WaitForNotification(ctx)
	require.NoError(t, err)
	require.Equal(t, "pgidem", n.Channel)
	require.Equal(t, store.NotifyPayload("mail", "waited"), n.Payload)

	long := strings.Repeat("k", store.MaxNotifyPayload)
	lock(store.LockInterest, long)
	require.False(t, complete(long), "a payload the server would refuse is not sent")
	lock(store.UnlockInterest, long)
	lock(store.LockInterest, "given-up")
	lock(store.UnlockInterest, "given-up")
	require.False(t, complete("given-up"), "an unlocked key is not notified")
	lock(store.UnlockInterest, "waited")

	var locks int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'
		AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&locks))
	require.Zero(t, locks, "the finishing statement's try holds nothing")

	// In another session (as behind a transaction-pooling proxy) the statements lock nothing.
	var same bool
	require.NoError(t, db.Pool.QueryRow(ctx, store.LockInterest, []string{"mail"}, []string{"elsewhere"}, pid).Scan(&same))
	require.False(t, same)
	require.False(t, complete("elsewhere"))
}

// A schema whose channel name would be too long notifies nothing; its statements still run.
func TestChannelTooLong(t *testing.T) {
	t.Parallel()
	require.Equal(t, "pgidem", store.Channel(""))
	require.Equal(t, "pgidem.billing", store.Channel("billing"))
	long := strings.Repeat("s", 60)
	require.Empty(t, store.Channel(long))
	require.Empty(t, store.Channel(`odd\name`), "a backslash would change the literal under standard_conforming_strings off")
	require.NotContains(t, store.New(long).Complete, "pg_notify")
	require.Contains(t, store.New("billing").Complete, `pg_notify('pgidem.billing'`)
}
