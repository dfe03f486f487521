package pgcluster_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgcluster"
)

// A cluster answers on its URL, keeps its data across a fast and an immediate restart
// (which ends the connections open before it), and refuses connections once stopped.
func TestClusterRestartAndStop(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := pgcluster.Start(t)
	conn, err := pgx.Connect(ctx, c.URL())
	require.NoError(t, err)
	_, err = conn.Exec(ctx, `CREATE TABLE kept (v int); INSERT INTO kept VALUES (7)`)
	require.NoError(t, err)
	var port int
	require.NoError(t, conn.QueryRow(ctx, `SELECT current_setting('port')::int`).Scan(&port))
	require.NotEqual(t, 5432, port, "the cluster is not the shared server")

	for _, mode := range []pgcluster.Mode{pgcluster.Fast, pgcluster.Immediate} {
		require.NoError(t, c.Restart(mode), mode)
		require.Error(t, conn.Ping(ctx), "%s: the connection made before the restart was ended", mode)
		require.NoError(t, conn.Close(ctx))
		conn, err = pgx.Connect(ctx, c.URL())
		require.NoError(t, err, mode)
		var v int
		require.NoError(t, conn.QueryRow(ctx, `SELECT v FROM kept`).Scan(&v), mode)
		require.Equal(t, 7, v, mode)
	}
	require.NoError(t, conn.Close(ctx))

	require.NoError(t, c.Stop())
	require.NoError(t, c.Stop(), "stopping a stopped cluster does nothing")
	require.Error(t, c.Shutdown(pgcluster.Fast), "Shutdown says the server was not running")
	_, err = pgx.Connect(ctx, c.URL())
	require.Error(t, err, "a stopped cluster refuses connections")
	require.NoError(t, c.Start())
	conn, err = pgx.Connect(ctx, c.URL())
	require.NoError(t, err, "started again")
	require.NoError(t, conn.Close(ctx))
}
