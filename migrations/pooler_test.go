package migrations_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/pgbouncer"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
)

// requireUnlocked checks that nothing holds a migration lock in the database: the lock
// table's row is free and no server connection (pooled ones included) holds an advisory
// lock.
func requireUnlocked(t *testing.T, db *sql.DB) {
	t.Helper()
	ctx := context.Background()
	_, _, held, err := migrations.LockHolder(ctx, db)
	require.NoError(t, err)
	require.False(t, held)
	var locked bool
	require.NoError(t, db.QueryRowContext(ctx, "SELECT locked FROM "+migrations.LockTable+" WHERE lock_id = $1", migrations.LockID).Scan(&locked))
	require.False(t, locked, "the lock row is released")
	var advisory int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`).Scan(&advisory))
	require.Zero(t, advisory, "no advisory lock left on a server connection")
}

// Four deploys migrating at once through PgBouncer in transaction pooling all succeed and
// apply each migration once; the lock is free afterwards; Down and Up work there too.
func TestPoolerConcurrentUp(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tdb := testdb.NewUnmigrated(t)
			url := pgbouncer.URL(t, tdb.URL, mode)

			const n = 4
			var wg sync.WaitGroup
			counts := make([]int, n)
			errs := make([]error, n)
			for i := range n {
				wg.Go(func() {
					db, err := migrations.OpenDB(url, "")
					if err != nil {
						errs[i] = err
						return
					}
					defer db.Close()
					res, err := migrations.Up(ctx, db, nil)
					counts[i], errs[i] = len(res), err
				})
			}
			wg.Wait()
			total := 0
			for i := range n {
				require.NoError(t, errs[i], "caller %d", i)
				total += counts[i]
			}
			direct := open(t, tdb.URL, "")
			status, err := migrations.Status(ctx, direct, nil)
			require.NoError(t, err)
			require.Equal(t, len(status), total, "each migration applied exactly once across callers")
			var rows, versions int
			require.NoError(t, direct.QueryRowContext(ctx, "SELECT count(*), count(DISTINCT version_id) FROM "+migrations.VersionTable+
				" WHERE version_id > 0").Scan(&rows, &versions))
			require.Equal(t, len(status), rows)
			require.Equal(t, len(status), versions)
			requireUnlocked(t, direct)

			pooled := open(t, url, "")
			down, err := migrations.Reset(ctx, pooled, nil)
			require.NoError(t, err)
			require.Len(t, down, total)
			again, err := migrations.Up(ctx, pooled, nil)
			require.NoError(t, err)
			require.Len(t, again, total)
			requireUnlocked(t, direct)
		})
	}
}

// While another run holds the migration lock, Up through PgBouncer gives up when its
// context's deadline passes, with an error naming the lock, while the holder still holds
// it. Once the holder releases it, nothing is left locked: a direct migration takes the
// lock at once.
func TestPoolerUpDeadlineWhileLockHeld(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	direct := open(t, tdb.URL, "")
	release, _ := holdLock(t, tdb.URL, "")

	pooled := open(t, pgbouncer.URL(t, tdb.URL, "exec"), "")
	deadline, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	applied, err := migrations.Up(deadline, pooled, nil)
	require.ErrorIs(t, err, migrations.ErrLockHeld)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, migrations.LockTable)
	require.Empty(t, applied)
	_, _, held, err := migrations.LockHolder(ctx, direct)
	require.NoError(t, err)
	require.True(t, held, "Up returned while the holder still held the lock")
	require.False(t, tableExists(t, direct, "public", "pgidem_record"), "nothing was migrated")

	release()
	requireUnlocked(t, direct)
	// "At once": well within the wait for a held lock (LockRetryAttempts seconds); the
	// bound only makes a lock left behind fail the test instead of hanging it.
	soon, cancelSoon := context.WithTimeout(ctx, time.Minute)
	defer cancelSoon()
	applied, err = migrations.Up(soon, direct, nil)
	require.NoError(t, err)
	require.NotEmpty(t, applied)
	requireUnlocked(t, direct)
}
