package migrations_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
)

func open(t *testing.T, url, schema string) *sql.DB {
	t.Helper()
	db, err := migrations.OpenDB(url, schema)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

func tableExists(t *testing.T, db *sql.DB, schema, table string) bool {
	t.Helper()
	var exists bool
	err := db.QueryRowContext(context.Background(),
		`SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = $1 AND tablename = $2)`,
		schema, table).Scan(&exists)
	require.NoError(t, err)
	return exists
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")

	applied, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	require.NotEmpty(t, applied)
	require.True(t, tableExists(t, db, "public", "pgidem_record"))
	require.True(t, tableExists(t, db, "public", migrations.VersionTable))
	require.False(t, tableExists(t, db, "public", "goose_db_version"), "must not touch goose's default table")

	again, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	require.Empty(t, again, "second Up applies nothing")

	status, err := migrations.Status(ctx, db, nil)
	require.NoError(t, err)
	for _, s := range status {
		require.Equal(t, "applied", string(s.State), s.Source.Path)
	}

	down, err := migrations.Down(ctx, db, nil)
	require.NoError(t, err)
	require.Len(t, down, len(applied))
	require.False(t, tableExists(t, db, "public", "pgidem_record"))

	reapplied, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	require.Len(t, reapplied, len(applied))
	require.True(t, tableExists(t, db, "public", "pgidem_record"))
}

func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)

	const n = 4
	var wg sync.WaitGroup
	counts := make([]int, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			db, err := migrations.OpenDB(tdb.URL, "")
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
	status, err := migrations.Status(ctx, open(t, tdb.URL, ""), nil)
	require.NoError(t, err)
	require.Equal(t, len(status), total, "each migration applied exactly once across callers")
}

func TestSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)

	t.Run("WrongSearchPathRefused", func(t *testing.T) {
		db := open(t, tdb.URL, "")
		_, err := migrations.Up(ctx, db, &migrations.Opts{Schema: "idem"})
		require.ErrorContains(t, err, "current schema")
		require.False(t, tableExists(t, db, "public", "pgidem_record"))
	})

	t.Run("OwnSchema", func(t *testing.T) {
		db := open(t, tdb.URL, "idem")
		_, err := migrations.Up(ctx, db, &migrations.Opts{Schema: "idem"})
		require.NoError(t, err)
		require.True(t, tableExists(t, db, "idem", "pgidem_record"))
		require.True(t, tableExists(t, db, "idem", migrations.VersionTable))
		require.False(t, tableExists(t, db, "public", "pgidem_record"))
	})
}
