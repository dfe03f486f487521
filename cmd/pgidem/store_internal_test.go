package main

import (
	"context"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// An interrupt that comes before the delete is sent (the pool's Acquire finds the context
// ended, and returns a bare context.Canceled) is not reported like a delete the server did
// not answer ("may or may not have been applied"): nothing was sent, so nothing was
// deleted, and forget says so.
func TestForgetInterruptedBeforeSending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, expires_at)
		VALUES ('mail', 'old-1', 'completed', gen_random_uuid(), 1, now() + interval '1 day')`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES ('billing', 'm-1', now() + interval '1 day')`)
	require.NoError(t, err)

	a := &app{env: env{stdout: io.Discard, stderr: io.Discard, getenv: func(string) string { return "" }}, databaseURL: db.URL}
	pool, err := a.connectPool(ctx) // connected: the interrupt comes after
	require.NoError(t, err)
	defer pool.Close()
	s := newStore(pool, "")
	interrupted, cancel := context.WithCancel(ctx)
	cancel()

	_, err = s.forget(interrupted, "mail", "old-1", false)
	require.EqualError(t, err, "pgidem: forget record: interrupted; nothing was deleted")
	_, err = s.inboxForget(interrupted, "billing", "m-1")
	require.EqualError(t, err, "pgidem: forget inbox row: interrupted; nothing was deleted")

	var records, inbox int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT (SELECT count(*) FROM pgidem_record), (SELECT count(*) FROM pgidem_inbox)").Scan(&records, &inbox))
	require.Equal(t, 1, records)
	require.Equal(t, 1, inbox)
}
