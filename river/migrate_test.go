package pgidemriver_test

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// MigrateRiver releases its lock and its extra connection when the migration fails, and
// when its context is cancelled while it waits for the lock.
func TestMigrateRiverReleasesLock(t *testing.T) {
	t.Parallel()
	b := setup(t)
	backends := func() int {
		var n int
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()`).Scan(&n))
		return n
	}
	lockFree := func() bool {
		conn, err := b.db.Pool.Acquire(b.ctx)
		require.NoError(t, err)
		defer conn.Release()
		var ok bool
		require.NoError(t, conn.QueryRow(b.ctx, `SELECT pg_try_advisory_lock($1)`, pgidemriver.MigrateLockID).Scan(&ok))
		if ok {
			_, err = conn.Exec(b.ctx, `SELECT pg_advisory_unlock($1)`, pgidemriver.MigrateLockID)
			require.NoError(t, err)
		}
		return ok
	}
	base := backends()

	// A failing migration (an unknown target version).
	_, err := pgidemriver.MigrateRiver(b.ctx, b.db.Pool, &pgidemriver.MigrateOpts{TargetVersion: 9999})
	require.Error(t, err)
	require.True(t, lockFree(), "the lock is released after a failed migration")

	// A caller cancelled while it waits for the lock.
	holder, err := b.db.Pool.Acquire(b.ctx)
	require.NoError(t, err)
	_, err = holder.Exec(b.ctx, `SELECT pg_advisory_lock($1)`, pgidemriver.MigrateLockID)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(b.ctx)
	done := make(chan error, 1)
	go func() { _, err := pgidemriver.MigrateRiver(ctx, b.db.Pool, nil); done <- err }()
	require.Eventually(t, func() bool {
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype = 'advisory' AND a.datname = current_database()`).Scan(&waiting)
		return err == nil && waiting == 1
	}, waitCap, pollInterval)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	_, err = holder.Exec(b.ctx, `SELECT pg_advisory_unlock($1)`, pgidemriver.MigrateLockID)
	require.NoError(t, err)
	holder.Release()

	_, err = pgidemriver.MigrateRiver(b.ctx, b.db.Pool, nil)
	require.NoError(t, err)
	require.True(t, lockFree())
	require.Eventually(t, func() bool { return backends() <= base+1 }, waitCap, pollInterval,
		"MigrateRiver's lock connections are closed")
}

// MigrateRiver takes its lock connection from the pool, so the pool's connect hooks apply
// to it, and takes it out of the pool, so a pool of one connection still migrates.
func TestMigrateRiverPoolConnection(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const appName = "pgidemriver_hooked"
	cfg, err := pgxpool.ParseConfig(b.db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, "SET application_name = '"+appName+"'")
		return err
	}
	pool, err := pgxpool.NewWithConfig(b.ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	// Hold the lock elsewhere, so MigrateRiver's lock connection can be seen waiting.
	holder, err := b.db.Pool.Acquire(b.ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(b.ctx, `SELECT pg_advisory_lock($1)`, pgidemriver.MigrateLockID)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { _, err := pgidemriver.MigrateRiver(b.ctx, pool, nil); done <- err }()
	require.Eventually(t, func() bool {
		var waiter string
		err := b.db.Pool.QueryRow(b.ctx, `SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype = 'advisory' AND a.datname = current_database()`).Scan(&waiter)
		return err == nil && waiter == appName
	}, waitCap, pollInterval, "the lock connection ran the pool's AfterConnect hook")
	_, err = holder.Exec(b.ctx, `SELECT pg_advisory_unlock($1)`, pgidemriver.MigrateLockID)
	require.NoError(t, err)
	require.NoError(t, <-done, "a pool of one connection migrates")

	// The lock connection was closed, not returned to the pool holding the lock.
	require.NoError(t, pool.AcquireFunc(b.ctx, func(conn *pgxpool.Conn) error {
		var ok bool
		if err := conn.QueryRow(b.ctx, `SELECT pg_try_advisory_lock($1)`, pgidemriver.MigrateLockID).Scan(&ok); err != nil {
			return err
		}
		require.True(t, ok)
		_, err := conn.Exec(b.ctx, `SELECT pg_advisory_unlock($1)`, pgidemriver.MigrateLockID)
		return err
	}))
}

// A nil pool is a caller's mistake, reported like the package's other nil arguments.
func TestMigrateRiverNilPool(t *testing.T) {
	t.Parallel()
	_, err := pgidemriver.MigrateRiver(context.Background(), nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	// A schema Postgres would truncate (so it would never be found again), or only white
	// space: refused before anything is created.
	b := setup(t)
	for _, schema := range []string{strings.Repeat("s", 64), "   ", "a\x00b", "a\nb", "\xff"} {
		_, err = pgidemriver.MigrateRiver(b.ctx, b.db.Pool, &pgidemriver.MigrateOpts{Schema: schema})
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "%q", schema)
	}
}

// A missing schema is created, once, by concurrent calls (River's migrator alone fails on
// it, and pgidem's CLI applied its own migrations before failing).
func TestMigrateRiverCreatesSchema(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const schema = "River Jobs"
	done := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := pgidemriver.MigrateRiver(b.ctx, b.db.Pool, &pgidemriver.MigrateOpts{Schema: schema})
			done <- err
		}()
	}
	require.NoError(t, <-done)
	require.NoError(t, <-done)
	var exists bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT to_regclass($1) IS NOT NULL`,
		pgx.Identifier{schema, "river_job"}.Sanitize()).Scan(&exists))
	require.True(t, exists)
}

// Another session creating the same schema at the same moment (pgidem's migrations.Up
// creates schemas under a lock of its own): MigrateRiver's CREATE SCHEMA IF NOT EXISTS
// waits for it and then fails with a unique violation, which it takes as "exists".
func TestMigrateRiverSchemaCreatedMeanwhile(t *testing.T) {
	t.Parallel()
	b := setup(t)
	const schema = "created meanwhile"
	other, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer other.Rollback(b.ctx) //nolint:errcheck // committed below
	_, err = other.Exec(b.ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := pgidemriver.MigrateRiver(b.ctx, b.db.Pool, &pgidemriver.MigrateOpts{Schema: schema})
		done <- err
	}()
	require.Eventually(t, func() bool { // MigrateRiver waits for the other transaction
		var waiting bool
		err := b.db.Pool.QueryRow(b.ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype = 'transactionid' AND a.datname = current_database())`).Scan(&waiting)
		return err == nil && waiting
	}, waitCap, pollInterval)
	require.NoError(t, other.Commit(b.ctx))
	require.NoError(t, <-done)
}

// TestMigrateRiverConcurrent: four deploys migrating River at once all succeed, and each
// migration is applied once.
func TestMigrateRiverConcurrent(t *testing.T) {
	t.Parallel()
	db := testdb.NewUnmigrated(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	applied := make([]int, 4)
	for i := range errs {
		wg.Go(func() {
			// A pool of its own per "deploy", like separate processes.
			pool, err := pgxpool.New(ctx, db.URL)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			res, err := pgidemriver.MigrateRiver(ctx, pool, nil)
			errs[i] = err
			if res != nil {
				applied[i] = len(res.Versions)
			}
		})
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "deploy %d", i)
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(db.Pool), nil)
	require.NoError(t, err)
	all := len(migrator.AllVersions())
	total := 0
	for _, n := range applied {
		total += n
	}
	require.Equal(t, all, total, "every migration applied by exactly one deploy")
	existing, err := migrator.ExistingVersions(ctx)
	require.NoError(t, err)
	require.Len(t, existing, all)
}
