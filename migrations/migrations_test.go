package migrations_test

import (
	"context"
	"database/sql"
	"io/fs"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
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

// holdLock takes pgidem's migration lock as another deploy would (goose's table locker on
// migrations.LockTable and LockID, renewing its lease), through a *sql.DB of one
// connection whose backend pid it returns; release frees it (at the latest at cleanup).
func holdLock(t *testing.T, url, schema string) (release func(), pid int) {
	t.Helper()
	ctx := context.Background()
	db := open(t, url, schema)
	db.SetMaxOpenConns(1)
	require.NoError(t, db.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	locker, err := lock.NewPostgresTableLocker(lock.WithTableName(migrations.LockTable), lock.WithTableLockID(migrations.LockID))
	require.NoError(t, err)
	require.NoError(t, locker.Lock(ctx, db))
	var once sync.Once
	release = func() { once.Do(func() { require.NoError(t, locker.Unlock(ctx, db)) }) }
	t.Cleanup(release)
	return release, pid
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

	// Down rolls back one migration, like goose's Down: the latest.
	down, err := migrations.Down(ctx, db, nil)
	require.NoError(t, err)
	require.Len(t, down, 1)
	require.Equal(t, applied[len(applied)-1].Source.Version, down[0].Source.Version)
	require.True(t, tableExists(t, db, "public", "pgidem_record"), "one step back keeps the records")

	// Reset rolls back the rest.
	down, err = migrations.Reset(ctx, db, nil)
	require.NoError(t, err)
	require.Len(t, down, len(applied)-1)
	require.False(t, tableExists(t, db, "public", "pgidem_record"))
	down, err = migrations.Down(ctx, db, nil)
	require.NoError(t, err)
	require.Empty(t, down, "nothing left to roll back")

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

// TestConcurrentUpWithSchema starts several Up calls at once on a database without the
// schema: all succeed, though each must create the schema first (CREATE SCHEMA IF NOT
// EXISTS alone fails with a unique violation when two run at once), and each migration is
// applied once.
func TestConcurrentUpWithSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	files, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	for round := range 3 {
		tdb := testdb.NewUnmigrated(t)
		const n = 8
		var wg sync.WaitGroup
		counts := make([]int, n)
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() {
				db, err := migrations.OpenDB(tdb.URL, "idem")
				if err != nil {
					errs[i] = err
					return
				}
				defer db.Close()
				res, err := migrations.Up(ctx, db, &migrations.Opts{Schema: "idem"})
				counts[i], errs[i] = len(res), err
			})
		}
		wg.Wait()
		total := 0
		for i, err := range errs {
			require.NoError(t, err, "round %d caller %d", round, i)
			total += counts[i]
		}
		require.Equal(t, len(files), total, "round %d: each migration applied exactly once across callers", round)
	}
}

// Another session creating Opts.Schema at the same moment without LockID (River's
// migrator, an operator): Up's CREATE SCHEMA IF NOT EXISTS waits for it and then fails with
// a unique violation, after which Up finds the schema and goes on. It used to fail.
func TestUpSchemaCreatedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	const schema = "created meanwhile"
	other, err := tdb.Pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx) //nolint:errcheck // committed below
	_, err = other.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)

	done := make(chan error, 1)
	go func() {
		_, err := migrations.Up(ctx, open(t, tdb.URL, schema), &migrations.Opts{Schema: schema})
		done <- err
	}()
	require.Eventually(t, func() bool { // Up waits for the other transaction
		var waiting bool
		err := tdb.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
			WHERE NOT l.granted AND l.locktype = 'transactionid' AND a.datname = current_database())`).Scan(&waiting)
		return err == nil && waiting
	}, 30*time.Second, 5*time.Millisecond)
	require.NoError(t, other.Commit(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(time.Minute):
		t.Fatal("Up did not return")
	}
	require.True(t, tableExists(t, open(t, tdb.URL, ""), schema, "pgidem_record"))
}

// TestSchemaNotCreated checks that only Up creates Opts.Schema, and only when it can use
// it: Status, Down and NewProvider report a missing schema, and Up refusing a connection
// whose current schema is another leaves nothing behind.
func TestSchemaNotCreated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)

	_, err := migrations.Status(ctx, open(t, tdb.URL, "typo"), &migrations.Opts{Schema: "typo"})
	require.ErrorContains(t, err, `schema "typo" does not exist`)
	_, err = migrations.Down(ctx, open(t, tdb.URL, "typo2"), &migrations.Opts{Schema: "typo2"})
	require.ErrorContains(t, err, `schema "typo2" does not exist`)
	_, err = migrations.NewProvider(ctx, open(t, tdb.URL, "typo3"), &migrations.Opts{Schema: "typo3"})
	require.ErrorContains(t, err, `schema "typo3" does not exist`)

	_, err = migrations.Up(ctx, open(t, tdb.URL, ""), &migrations.Opts{Schema: "refused"})
	require.ErrorContains(t, err, "current schema")

	var schemas []string
	require.NoError(t, tdb.Pool.QueryRow(ctx, `SELECT coalesce(array_agg(nspname::text ORDER BY nspname), '{}')
		FROM pg_namespace WHERE nspname IN ('typo', 'typo2', 'typo3', 'refused')`).Scan(&schemas))
	require.Empty(t, schemas)
	require.False(t, tableExists(t, open(t, tdb.URL, ""), "public", migrations.VersionTable))

	// An existing schema is fine for Status (goose creates its version table there).
	_, err = tdb.Pool.Exec(ctx, "CREATE SCHEMA idem")
	require.NoError(t, err)
	status, err := migrations.Status(ctx, open(t, tdb.URL, "idem"), &migrations.Opts{Schema: "idem"})
	require.NoError(t, err)
	require.NotEmpty(t, status)
}

// TestInstalledElsewhereOnSearchPath covers the default search_path "$user", public when a
// schema named after the role appears after pgidem was installed in public: every function
// refuses, naming public, instead of installing pgidem a second time in the new schema.
func TestInstalledElsewhereOnSearchPath(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	_, err := migrations.Up(ctx, open(t, tdb.URL, ""), nil)
	require.NoError(t, err)

	var user string
	require.NoError(t, tdb.Pool.QueryRow(ctx, "SELECT current_user").Scan(&user))
	_, err = tdb.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{user}.Sanitize())
	require.NoError(t, err)

	db := open(t, tdb.URL, "")
	again, err := migrations.Up(ctx, db, nil)
	require.ErrorContains(t, err, `pgidem is installed in schema "public"`)
	require.ErrorContains(t, err, `migrations.OpenDB(connString, "public")`)
	require.Empty(t, again)
	require.False(t, tableExists(t, db, user, migrations.VersionTable))
	require.False(t, tableExists(t, db, user, "pgidem_record"))
	_, err = migrations.Status(ctx, db, nil)
	require.ErrorContains(t, err, `pgidem is installed in schema "public"`)
	_, err = migrations.Down(ctx, db, nil)
	require.ErrorContains(t, err, `pgidem is installed in schema "public"`)
	require.True(t, tableExists(t, db, "public", "pgidem_record"), "Down refused")

	// Pointing at the installation works.
	again, err = migrations.Up(ctx, open(t, tdb.URL, "public"), &migrations.Opts{Schema: "public"})
	require.NoError(t, err)
	require.Empty(t, again, "pgidem is already installed in public")
}

// TestSchemaNameValidation rejects schema names Postgres would truncate or cannot store,
// before touching the database.
func TestSchemaNameValidation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	for _, tc := range []struct {
		name, schema, want string
	}{
		{"TooLong", strings.Repeat("s", migrations.SchemaMaxLen+1), "Postgres truncates identifiers to 63 bytes"},
		{"NUL", "id\x00em", "control character"},
		{"Blank", "  ", "only white space"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := migrations.OpenDB(tdb.URL, tc.schema)
			require.ErrorContains(t, err, tc.want)
			require.ErrorIs(t, err, migrations.ErrInvalidArgument)
			_, err = migrations.Up(ctx, open(t, tdb.URL, ""), &migrations.Opts{Schema: tc.schema})
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, "Opts.Schema")
			require.ErrorIs(t, err, migrations.ErrInvalidArgument)
			_, err = migrations.Status(ctx, open(t, tdb.URL, ""), &migrations.Opts{Schema: tc.schema})
			require.ErrorContains(t, err, tc.want)
			require.ErrorIs(t, err, migrations.ErrInvalidArgument)
		})
	}
	// The longest name works, unchanged.
	longest := strings.Repeat("s", migrations.SchemaMaxLen)
	_, err := migrations.Up(ctx, open(t, tdb.URL, longest), &migrations.Opts{Schema: longest})
	require.NoError(t, err)
	require.True(t, tableExists(t, open(t, tdb.URL, ""), longest, "pgidem_record"))
}

// TestAppliedAtUTC checks that Status reports when migrations were applied on a server
// whose TimeZone is not UTC: OpenDB's sessions write and read goose's timestamp without
// time zone in UTC.
func TestAppliedAtUTC(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	_, err := tdb.Pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{tdb.Name}.Sanitize()+" SET timezone = 'Asia/Tokyo'")
	require.NoError(t, err)
	// Also in the connection string: OpenDB's UTC wins over both.
	url := tdb.URL + "&TimeZone=America/Los_Angeles"
	if !strings.Contains(tdb.URL, "?") {
		url = tdb.URL + "?TimeZone=America/Los_Angeles"
	}
	db := open(t, url, "")
	_, err = migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	status, err := migrations.Status(ctx, db, nil)
	require.NoError(t, err)
	for _, s := range status {
		require.WithinDuration(t, time.Now(), s.AppliedAt, time.Minute, s.Source.Path)
	}
}

// Status, Down and Installed on a database where pgidem was never installed report that
// and create nothing; goose's own Status creates the version table.
func TestNotInstalledCreatesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	installed, err := migrations.Installed(ctx, db, nil)
	require.NoError(t, err)
	require.False(t, installed)
	status, err := migrations.Status(ctx, db, nil)
	require.NoError(t, err)
	require.NotEmpty(t, status)
	for _, s := range status {
		require.Equal(t, goose.StatePending, s.State)
	}
	for _, rollback := range []func(context.Context, *sql.DB, *migrations.Opts) ([]*goose.MigrationResult, error){migrations.Down, migrations.Reset} {
		results, err := rollback(ctx, db, nil)
		require.NoError(t, err)
		require.Empty(t, results)
		require.False(t, tableExists(t, db, "public", migrations.VersionTable))
	}

	_, err = migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	installed, err = migrations.Installed(ctx, db, nil)
	require.NoError(t, err)
	require.True(t, installed)
	status, err = migrations.Status(ctx, db, nil)
	require.NoError(t, err)
	require.Equal(t, goose.StateApplied, status[len(status)-1].State)
}

// While another deploy holds pgidem's migration lock for longer than the database's
// statement_timeout, Up waits for it with and without Opts.Schema. With a schema, Up
// used to wait in a blocking lock that statement_timeout cancelled, even for a schema
// that already existed.
func TestUpWaitsForLockUnderStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, schema := range []string{"", "idem"} {
		t.Run("schema="+schema, func(t *testing.T) {
			t.Parallel()
			tdb := testdb.NewUnmigrated(t)
			_, err := migrations.Up(ctx, open(t, tdb.URL, schema), &migrations.Opts{Schema: schema})
			require.NoError(t, err)
			_, err = tdb.Pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{tdb.Name}.Sanitize()+" SET statement_timeout = '1s'")
			require.NoError(t, err)

			release, _ := holdLock(t, tdb.URL, schema)
			done := make(chan struct{})
			go func() {
				defer close(done)
				time.Sleep(3 * time.Second) // a long migration elsewhere
				release()
			}()
			_, err = migrations.Up(ctx, open(t, tdb.URL, schema), &migrations.Opts{Schema: schema})
			<-done
			require.NoError(t, err)
		})
	}
}

// Arguments no call can use return an error matching ErrInvalidArgument, before anything
// runs: a nil db, a negative DownTo version.
func TestInvalidArguments(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, err := migrations.Up(ctx, nil, nil)
	require.ErrorIs(t, err, migrations.ErrInvalidArgument)
	_, err = migrations.Status(ctx, nil, nil)
	require.ErrorIs(t, err, migrations.ErrInvalidArgument)
	tdb := testdb.NewUnmigrated(t)
	_, err = migrations.DownTo(ctx, open(t, tdb.URL, ""), nil, -1)
	require.ErrorIs(t, err, migrations.ErrInvalidArgument)
	installed, err := migrations.Installed(ctx, open(t, tdb.URL, ""), nil)
	require.NoError(t, err)
	require.False(t, installed, "nothing ran")
}

func TestCheckSchemaName(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"idem\tstore", "a\x00b", "\xff", "   ", "$user", strings.Repeat("s", migrations.SchemaMaxLen+1)} {
		require.Error(t, migrations.CheckSchemaName(bad), "%q", bad)
	}
	for _, good := range []string{"", "idem", "Idem Store", `q"x`, "$USER", "$user2", strings.Repeat("s", migrations.SchemaMaxLen)} {
		require.NoError(t, migrations.CheckSchemaName(good), "%q", good)
	}
}

// A role without USAGE on Opts.Schema is told so: the connection then has no current
// schema, and the error used to advise opening the database with OpenDB, which it was.
func TestSchemaWithoutUsage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	_, err := migrations.Up(ctx, open(t, tdb.URL, "idem"), &migrations.Opts{Schema: "idem"})
	require.NoError(t, err)
	role := "nousage_" + strings.TrimPrefix(tdb.Name, "pgidem_test_")
	_, err = tdb.Pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := tdb.Pool.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
		require.NoError(t, err)
	})
	require.True(t, strings.HasPrefix(tdb.URL, "postgres://postgres@"), tdb.URL)
	url := strings.Replace(tdb.URL, "postgres://postgres@", "postgres://"+role+"@", 1)
	db := open(t, url, "idem")
	_, err = migrations.Status(ctx, db, &migrations.Opts{Schema: "idem"})
	require.ErrorContains(t, err, "USAGE")
	_, err = migrations.Up(ctx, db, &migrations.Opts{Schema: "idem"})
	require.ErrorContains(t, err, "USAGE")
	require.NoError(t, db.Close()) // before the role is dropped
}

// pgidem's files copied into the application's own migrations (docs/migrations.md) create
// pgidem's tables without pgidem's version table. Every function here then refuses with
// ErrManagedElsewhere and creates nothing: Up used to fail on the existing tables after
// creating the version table, and Installed and Status said nothing was applied. A
// version table left holding only goose's version-0 row (by such a failed Up) changes
// nothing.
func TestManagedByAnotherTool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	app, err := goose.NewProvider(goose.DialectPostgres, db, migrations.FS(), goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	_, err = app.Up(ctx)
	require.NoError(t, err)

	check := func() {
		t.Helper()
		_, err := migrations.Installed(ctx, db, nil)
		require.ErrorIs(t, err, migrations.ErrManagedElsewhere)
		require.ErrorContains(t, err, `schema "public"`)
		_, err = migrations.Status(ctx, db, nil)
		require.ErrorIs(t, err, migrations.ErrManagedElsewhere)
		for _, run := range []func(context.Context, *sql.DB, *migrations.Opts) ([]*goose.MigrationResult, error){migrations.Up, migrations.Down, migrations.Reset} {
			results, err := run(ctx, db, nil)
			require.ErrorIs(t, err, migrations.ErrManagedElsewhere)
			require.Empty(t, results)
		}
		require.True(t, tableExists(t, db, "public", "pgidem_record"), "nothing rolled back")
	}
	check()
	require.False(t, tableExists(t, db, "public", migrations.VersionTable), "nothing created")

	_, err = db.ExecContext(ctx, `CREATE TABLE `+migrations.VersionTable+` (id serial PRIMARY KEY, version_id bigint NOT NULL, is_applied boolean NOT NULL, tstamp timestamp DEFAULT now());
		INSERT INTO `+migrations.VersionTable+` (version_id, is_applied) VALUES (0, true)`)
	require.NoError(t, err)
	check()
}

// With RefuseDataLoss, the check covers exactly the migrations that are rolled back, in
// goose's order (the most recently applied first), and the check and the rollback hold
// the lock together. The pgidem command's check used to count down from the highest
// version before taking the lock, so an out-of-order history or a second rollback racing
// it dropped pgidem_inbox with its rows.
func TestRefuseDataLoss(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	guarded := &migrations.Opts{RefuseDataLoss: true}
	addInboxRow := func(t *testing.T, db *sql.DB) {
		t.Helper()
		_, err := db.ExecContext(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES ('c', 'm', now() + interval '1 day')`)
		require.NoError(t, err)
	}

	t.Run("OutOfOrder", func(t *testing.T) {
		t.Parallel()
		db := open(t, testdb.NewUnmigrated(t).URL, "")
		_, err := migrations.Up(ctx, db, nil)
		require.NoError(t, err)
		p, err := migrations.NewProvider(ctx, db, nil)
		require.NoError(t, err)
		_, err = p.ApplyVersion(ctx, 2, false) // rolled back and applied again: the latest applied
		require.NoError(t, err)
		_, err = p.ApplyVersion(ctx, 2, true)
		require.NoError(t, err)
		addInboxRow(t, db)

		results, err := migrations.Down(ctx, db, guarded)
		require.ErrorIs(t, err, migrations.ErrDataLoss)
		require.ErrorContains(t, err, "pgidem_inbox (1 row)")
		require.Empty(t, results)
		require.True(t, tableExists(t, db, "public", "pgidem_inbox"))
	})

	t.Run("ConcurrentRollbacks", func(t *testing.T) {
		t.Parallel()
		tdb := testdb.NewUnmigrated(t)
		db := open(t, tdb.URL, "")
		_, err := migrations.Up(ctx, db, nil)
		require.NoError(t, err)
		// The view's migration (version 3) is the latest applied, the inbox's below it.
		_, err = migrations.DownTo(ctx, db, nil, 3)
		require.NoError(t, err)
		addInboxRow(t, db)
		// Both rollbacks wait for the lock, then run one after the other: the first rolls
		// back the view (no rows), the second would drop the inbox and must refuse.
		release, holderPID := holdLock(t, tdb.URL, "")
		errs := make(chan error, 2)
		for range 2 {
			go func() {
				_, err := migrations.Down(ctx, open(t, tdb.URL, ""), guarded)
				errs <- err
			}()
		}
		require.Eventually(t, func() bool { // both are polling for the lock
			var n int
			err := db.QueryRowContext(ctx, `SELECT count(DISTINCT pid) FROM pg_stat_activity
				WHERE datname = current_database() AND pid NOT IN (pg_backend_pid(), $1)
				  AND (query LIKE 'INSERT INTO `+migrations.LockTable+` %' OR query LIKE 'UPDATE `+migrations.LockTable+` SET%')`, holderPID).Scan(&n)
			return err == nil && n >= 2
		}, time.Minute, 20*time.Millisecond)
		release()
		first, second := <-errs, <-errs
		if first != nil {
			first, second = second, first
		}
		require.NoError(t, first)
		require.ErrorIs(t, second, migrations.ErrDataLoss)
		require.True(t, tableExists(t, db, "public", "pgidem_inbox"), "the inbox and its row survive")
		require.False(t, tableExists(t, db, "public", "pgidem_record_overview"))
	})

	t.Run("OneConnection", func(t *testing.T) {
		t.Parallel()
		// The check and the lock use the one connection in turn, before goose takes it, so a
		// *sql.DB of one connection rolls back as with goose alone. (A version holding the
		// lock on a connection of its own waited forever for a second one.)
		db := open(t, testdb.NewUnmigrated(t).URL, "")
		db.SetMaxOpenConns(1)
		applied, err := migrations.Up(ctx, db, nil)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		results, err := migrations.Down(ctx, db, guarded)
		require.NoError(t, err)
		require.Len(t, results, 1)
		addInboxRow(t, db)
		_, err = migrations.Reset(ctx, db, guarded)
		require.ErrorIs(t, err, migrations.ErrDataLoss)
		results, err = migrations.Reset(ctx, db, nil)
		require.NoError(t, err)
		require.Len(t, results, len(applied)-1)
	})

	t.Run("Gaps", func(t *testing.T) {
		t.Parallel()
		// Versions 1 and 3 recorded, the inbox table gone: the check skips the missing
		// table instead of failing on it, and still guards the records.
		db := open(t, testdb.NewUnmigrated(t).URL, "")
		_, err := migrations.Up(ctx, db, nil)
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, `DROP TABLE pgidem_inbox; DELETE FROM `+migrations.VersionTable+` WHERE version_id = 2;
			INSERT INTO pgidem_record (namespace, key, status, owner, expires_at) VALUES ('n', 'k', 'completed', gen_random_uuid(), now() + interval '1 day')`)
		require.NoError(t, err)
		_, err = migrations.Reset(ctx, db, guarded)
		require.ErrorIs(t, err, migrations.ErrDataLoss)
		require.ErrorContains(t, err, "would drop pgidem_record (1 row)")
		_, err = migrations.Reset(ctx, db, nil)
		require.NoError(t, err)
		require.False(t, tableExists(t, db, "public", "pgidem_record"))
	})
}
