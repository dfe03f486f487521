package pgbouncer_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/testdb"
)

// Two client connections through the PgBouncer take turns on one server connection, and
// a session setting does not outlive its transaction's server connection assignment: the
// pooler pools per transaction.
func TestTransactionPooling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	url := pgbouncer.URL(t, db.URL, "exec")

	a, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer a.Close(ctx)
	b, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer b.Close(ctx)

	var name string
	require.NoError(t, a.QueryRow(ctx, "SELECT current_database()").Scan(&name))
	require.Equal(t, db.Name, name, "the per-test database is reachable through the pooler")

	// One at a time, both clients are served by the server connection last used (LIFO).
	var pidA, pidB int
	require.NoError(t, a.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pidA))
	require.NoError(t, b.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pidB))
	require.Equal(t, pidA, pidB, "two clients share one server connection between transactions")

	// A transaction keeps its server connection to itself.
	tx, err := a.Begin(ctx)
	require.NoError(t, err)
	var inTx int
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&inTx))
	var other int
	require.NoError(t, b.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&other))
	require.NotEqual(t, inTx, other, "a client in a transaction holds its server connection")
	require.NoError(t, tx.Rollback(ctx))
}

// With pgx's default query mode, the statement cache of one client meets the prepared
// statements another client left on the shared server connection.
func TestDefaultQueryModeClashes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	url := pgbouncer.URL(t, db.URL, "")
	a, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer a.Close(ctx)
	b, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer b.Close(ctx)

	const q = "SELECT count(*) FROM pgidem_record WHERE namespace = $1"
	var n int
	require.NoError(t, a.QueryRow(ctx, q, "x").Scan(&n))
	err = b.QueryRow(ctx, q, "x").Scan(&n)
	require.Error(t, err)
	require.Contains(t, err.Error(), "already exists")
}
