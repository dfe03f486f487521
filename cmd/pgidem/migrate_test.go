package main_test

import (
	"context"
	"encoding/json"
	"io/fs"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3/lock"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
)

// latestVersion returns the highest embedded migration version and its file name.
func latestVersion(t *testing.T) (int64, string) {
	t.Helper()
	files, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	last := files[len(files)-1] // NNNNN_description.sql: zero-padded, so sorted by version
	prefix, _, _ := strings.Cut(last, "_")
	version, err := strconv.ParseInt(prefix, 10, 64)
	require.NoError(t, err)
	return version, last
}

func TestMigrate(t *testing.T) {
	t.Parallel()
	db := testdb.NewUnmigrated(t)
	latest, latestFile := latestVersion(t)

	t.Run("BeforeUp", func(t *testing.T) {
		require.Equal(t, "0 (latest is "+strconv.FormatInt(latest, 10)+"; run pgidem migrate up)\n",
			requireOK(t, cli(t, db.URL, "migrate", "version")))
		out := requireOK(t, cli(t, db.URL, "migrate", "status"))
		require.True(t, strings.HasPrefix(out, `pgidem migrations in database "`+db.Name+`" (user "`), out)
		require.Contains(t, out, `, schema "public"`+"\n")
		require.Contains(t, out, "VERSION")
		require.Contains(t, out, "00001_create_pgidem_record.sql")
		require.Contains(t, out, "pending")
		require.NotContains(t, out, "applied  ")
		require.Equal(t, "nothing to roll back; pgidem is not installed here\n", requireOK(t, cli(t, db.URL, "migrate", "down")))
		// Reports about a database without pgidem create nothing in it (goose's own
		// status and version create the version table).
		var tables int
		require.NoError(t, db.Pool.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_tables WHERE tablename LIKE 'pgidem%'`).Scan(&tables))
		require.Zero(t, tables)
	})

	t.Run("Up", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "migrate", "up"))
		require.Contains(t, out, "applied 00001_create_pgidem_record.sql")
		require.Contains(t, out, "applied 00003_create_pgidem_record_overview.sql")
		require.Contains(t, out, "applied "+latestFile)
		require.Contains(t, out, "pgidem schema is now at version "+strconv.FormatInt(latest, 10))

		out = requireOK(t, cli(t, db.URL, "migrate", "up"))
		require.Equal(t, "pgidem schema is up to date at version "+strconv.FormatInt(latest, 10)+"\n", out)
		require.Equal(t, strconv.FormatInt(latest, 10)+"\n", requireOK(t, cli(t, db.URL, "migrate", "version")))
	})

	t.Run("StatusJSON", func(t *testing.T) {
		var status []struct {
			Version   int64      `json:"version"`
			Source    string     `json:"source"`
			State     string     `json:"state"`
			AppliedAt *time.Time `json:"applied_at"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "status", "--json"))), &status))
		require.Len(t, status, int(latest))
		for _, s := range status {
			require.Equal(t, "applied", s.State, s.Source)
			require.NotNil(t, s.AppliedAt)
		}
		var version map[string]int64
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "version", "--json"))), &version))
		require.Equal(t, map[string]int64{"version": latest, "latest": latest}, version)
	})

	t.Run("Down", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "migrate", "down"))
		require.Contains(t, out, "rolled back "+latestFile)
		require.Equal(t, strconv.FormatInt(latest-1, 10)+" (latest is "+strconv.FormatInt(latest, 10)+"; run pgidem migrate up)\n",
			requireOK(t, cli(t, db.URL, "migrate", "version")))

		var res struct {
			Applied    []json.RawMessage `json:"applied"`
			RolledBack []struct {
				Version int64  `json:"version"`
				Source  string `json:"source"`
			} `json:"rolled_back"`
			Version int64 `json:"version"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "down", "--to", "0", "--json"))), &res))
		require.Len(t, res.RolledBack, int(latest-1))
		require.Equal(t, int64(1), res.RolledBack[len(res.RolledBack)-1].Version)
		require.Empty(t, res.Applied)
		require.Zero(t, res.Version)

		require.Equal(t, "nothing to roll back; pgidem schema is at version 0\n",
			requireOK(t, cli(t, db.URL, "migrate", "down")))
		requireFail(t, cli(t, db.URL, "migrate", "down", "--to", "-1"), 2)
	})

	t.Run("UpJSON", func(t *testing.T) {
		var res struct {
			Applied []struct {
				Version int64  `json:"version"`
				Source  string `json:"source"`
			} `json:"applied"`
			Version int64 `json:"version"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "up", "--json"))), &res))
		require.Len(t, res.Applied, int(latest))
		require.Equal(t, latest, res.Version)
	})
}

// TestMigrateConcurrentWithSchema runs several migrate up at once with a schema that does
// not exist yet, like deploys starting together: all succeed.
func TestMigrateConcurrentWithSchema(t *testing.T) {
	t.Parallel()
	for round := range 5 {
		db := testdb.NewUnmigrated(t)
		const n = 8
		var wg sync.WaitGroup
		results := make([]result, n)
		for i := range n {
			wg.Go(func() { results[i] = cli(t, db.URL, "--schema", "idem", "migrate", "up") })
		}
		wg.Wait()
		for i, r := range results {
			require.Equal(t, 0, r.code, "round %d caller %d: stderr %q", round, i, r.stderr)
		}
	}
}

// TestMigrateMissingSchema checks that only migrate up creates --schema: the other migrate
// commands report a schema that does not exist and create nothing.
func TestMigrateMissingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	for _, args := range [][]string{{"migrate", "status"}, {"migrate", "version"}, {"migrate", "down"}, {"migrate", "down", "--to", "0"}} {
		line := requireFail(t, cli(t, db.URL, append([]string{"--schema", "typo"}, args...)...), 1)
		require.Contains(t, line, `pgidem: `+strings.Join(args[:2], " ")+`: schema "typo" does not exist in database "`+db.Name+`"`, args)
		require.Contains(t, line, `so pgidem is not installed there (schema names are case-sensitive)`, args)
	}
	var created []string
	require.NoError(t, db.Pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(n.nspname || '.' || coalesce(c.relname, '') ORDER BY 1), '{}')
		FROM pg_namespace n LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind = 'r'
		WHERE n.nspname = 'typo'`).Scan(&created))
	require.Empty(t, created, "read-only commands created objects")
}

// TestMigrateInstalledElsewhere covers the default search_path "$user", public when a
// schema named after the user appears after pgidem was installed in public: migrate up
// refuses to install pgidem a second time and says how to point at public.
func TestMigrateInstalledElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	var user string
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT current_user").Scan(&user))
	_, err := db.Pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{user}.Sanitize())
	require.NoError(t, err)

	for _, args := range [][]string{{"migrate", "up"}, {"migrate", "status"}} {
		line := requireFail(t, cli(t, db.URL, args...), 1)
		require.Contains(t, line, `pgidem is installed in schema "public"`, args)
		require.Contains(t, line, `pgidem --schema "public"`, args)
	}
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1", user).Scan(&n))
	require.Zero(t, n, "nothing installed in the user's schema")

	latest, _ := latestVersion(t)
	require.Equal(t, "pgidem schema is up to date at version "+strconv.FormatInt(latest, 10)+"\n",
		requireOK(t, cli(t, db.URL, "--schema", "public", "migrate", "up")))
}

// TestMigrateStatusTimeZone checks APPLIED AT on a server whose time zone is not UTC: it is
// the real time the migrations were applied.
func TestMigrateStatusTimeZone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	_, err := db.Pool.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{db.Name}.Sanitize()+" SET timezone = 'Asia/Tokyo'")
	require.NoError(t, err)
	requireOK(t, cli(t, db.URL, "migrate", "up"))

	var status []struct {
		Source    string     `json:"source"`
		AppliedAt *time.Time `json:"applied_at"`
	}
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "status", "--json"))), &status))
	require.NotEmpty(t, status)
	for _, s := range status {
		require.NotNil(t, s.AppliedAt, s.Source)
		require.WithinDuration(t, time.Now(), *s.AppliedAt, time.Minute, "%s: applied_at must be the real UTC time", s.Source)
	}
}

// upTo returns a new database migrated up to version only.
func upTo(t *testing.T, version int64) *testdb.DB {
	t.Helper()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	sqlDB, err := migrations.OpenDB(db.URL, "")
	require.NoError(t, err)
	defer sqlDB.Close()
	provider, err := migrations.NewProvider(ctx, sqlDB, nil)
	require.NoError(t, err)
	_, err = provider.UpTo(ctx, version)
	require.NoError(t, err)
	return db
}

func TestMigrateRiver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	relationSchema := func(t *testing.T, db *testdb.DB, name string) []string {
		t.Helper()
		var schemas []string
		require.NoError(t, db.Pool.QueryRow(ctx, `
			SELECT coalesce(array_agg(n.nspname ORDER BY n.nspname), '{}')
			FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
			WHERE c.relname = $1`, name).Scan(&schemas))
		return schemas
	}

	t.Run("Default", func(t *testing.T) {
		t.Parallel()
		db := testdb.NewUnmigrated(t)
		out := requireOK(t, cli(t, db.URL, "migrate", "up", "--river"))
		require.Contains(t, out, "applied 00001_create_pgidem_record.sql")
		require.Contains(t, out, "applied River migration 001")
		require.Contains(t, out, "River schema is now up to date\n")
		require.Equal(t, []string{"public"}, relationSchema(t, db, "river_job"))
		require.Equal(t, []string{"public"}, relationSchema(t, db, "pgidem_record"))

		var res struct {
			Applied []json.RawMessage `json:"applied"`
			River   []struct {
				Version int `json:"version"`
			} `json:"river"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "migrate", "up", "--river", "--json"))), &res))
		require.Empty(t, res.Applied)
		require.NotNil(t, res.River)
		require.Empty(t, res.River)
		latest, _ := latestVersion(t)
		require.Equal(t, "pgidem schema is up to date at version "+strconv.FormatInt(latest, 10)+"\nRiver schema is up to date\n",
			requireOK(t, cli(t, db.URL, "migrate", "up", "--river")))
		require.NotContains(t, requireOK(t, cli(t, db.URL, "migrate", "up", "--json")), "river")
	})

	t.Run("Schemas", func(t *testing.T) {
		t.Parallel()
		db := testdb.NewUnmigrated(t)
		requireOK(t, cli(t, db.URL, "--schema", "idem", "migrate", "up", "--river"))
		require.Equal(t, []string{"idem"}, relationSchema(t, db, "river_job"))
		require.Equal(t, []string{"idem"}, relationSchema(t, db, "pgidem_record"))

		other := testdb.NewUnmigrated(t)
		_, err := other.Pool.Exec(ctx, "CREATE SCHEMA queue")
		require.NoError(t, err)
		requireOK(t, cli(t, other.URL, "--schema", "idem", "migrate", "up", "--river", "--river-schema", "queue"))
		require.Equal(t, []string{"queue"}, relationSchema(t, other, "river_job"))
		require.Equal(t, []string{"idem"}, relationSchema(t, other, "pgidem_record"))
	})
}

// migrate down refuses to drop tables that hold rows unless --force, and names them with
// their row counts; --to above the current version rolls back nothing.
func TestMigrateDownGuards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	latest, _ := latestVersion(t)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	require.NoError(t, err)
	_, err = pgidem.Do(ctx, coord, "invoices", "order-1", time.Hour, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)

	require.Equal(t, "nothing to roll back; pgidem schema is at version "+strconv.FormatInt(latest, 10)+"\n",
		requireOK(t, cli(t, db.URL, "migrate", "down", "--to", strconv.FormatInt(latest+1, 10))))

	// The rollbacks down to the inbox's migration (the view's among them) drop no table:
	// allowed.
	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "down", "--to", "2")), "rolled back 00003_")
	line := requireFail(t, cli(t, db.URL, "migrate", "down", "--to", "0"), 1)
	require.Contains(t, line, "rolling back would drop pgidem_record (1 row)")
	require.Contains(t, line, "--force")
	var records int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pgidem_record`).Scan(&records))
	require.Equal(t, 1, records, "nothing was rolled back")
	// The inbox is empty, so its own rollback goes ahead.
	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "down")), "rolled back 00002_")
	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "down", "--force")), "rolled back 00001_")
}

// A database a newer release migrated: version, status and up say so, and down refuses
// to roll back a migration this build does not have, instead of printing the version bare,
// calling the schema up to date, or failing with goose's "version not found".
func TestMigrateNewerDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	latest, _ := latestVersion(t)
	newer := strconv.FormatInt(latest+1, 10)
	_, err := db.Pool.Exec(ctx, `INSERT INTO `+migrations.VersionTable+` (version_id, is_applied) VALUES ($1, true)`, latest+1)
	require.NoError(t, err)

	require.Equal(t, newer+" (newer than this pgidem's latest migration, "+strconv.FormatInt(latest, 10)+": a newer release migrated the database)\n",
		requireOK(t, cli(t, db.URL, "migrate", "version")))
	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "status")), "the database is at version "+newer+", newer than")
	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "up")), "nothing to apply; pgidem schema is at version "+newer)
	line := requireFail(t, cli(t, db.URL, "migrate", "down"), 1)
	require.Contains(t, line, "it was migrated by a newer pgidem release; roll back with that release")
	sqlDB, err := migrations.OpenDB(db.URL, "")
	require.NoError(t, err)
	defer sqlDB.Close()
	_, err = migrations.Down(ctx, sqlDB, nil)
	require.ErrorContains(t, err, "newer than the latest migration this build has")
}

// pgidem's files applied by another tool (copied into the application's goose directory):
// every migrate command refuses with the reason instead of reporting version 0 and
// telling the operator to run up, which would fail on the existing tables.
func TestMigrateManagedElsewhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	for _, name := range []string{"00001_create_pgidem_record.sql", "00002_create_pgidem_inbox.sql"} {
		text, err := fs.ReadFile(migrations.FS(), name)
		require.NoError(t, err)
		up, _, _ := strings.Cut(strings.SplitN(string(text), "-- +goose Up", 2)[1], "-- +goose Down")
		_, err = db.Pool.Exec(ctx, up)
		require.NoError(t, err, name)
	}
	for _, args := range [][]string{{"migrate", "version"}, {"migrate", "status"}, {"migrate", "up"}, {"migrate", "down"}} {
		line := requireFail(t, cli(t, db.URL, args...), 1)
		require.Contains(t, line, "managed by another migration tool", args)
	}
	var versionTable bool
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, migrations.VersionTable).Scan(&versionTable))
	require.False(t, versionTable, "nothing created")
}

// pgidem installed in a schema the search_path does not reach: without --schema the
// commands name that schema instead of only suggesting migrate up (which would install a
// second copy).
func TestInstalledOffSearchPath(t *testing.T) {
	t.Parallel()
	db := testdb.NewUnmigrated(t)
	const schema = "Idem Store"
	requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "up"))

	line := requireFail(t, cli(t, db.URL, "stats"), 1)
	require.Contains(t, line, `pgidem is installed in schema "Idem Store" of this database: pass --schema`)
	require.Equal(t, "0 (pgidem is not installed here but in schema \"Idem Store\" of this database: pass --schema)\n",
		requireOK(t, cli(t, db.URL, "migrate", "version")))
	// With --schema the operator chose the schema (one per tenant, say): no hint.
	_, err := db.Pool.Exec(context.Background(), `CREATE SCHEMA tenant2`)
	require.NoError(t, err)
	require.Contains(t, requireOK(t, cli(t, db.URL, "--schema", "tenant2", "migrate", "version")), "run pgidem migrate up")
	require.Contains(t, requireFail(t, cli(t, db.URL, "--schema", "tenant2", "stats"), 1), "run 'pgidem migrate up'")
	r := cli(t, db.URL, "migrate", "up")
	require.Zero(t, r.code, r.stderr)
	require.Contains(t, r.stdout, "pgidem schema is now at version")
	require.Contains(t, r.stderr, `installed pgidem anew here, although it is installed in schema "Idem Store"`)
	// Now installed here too: no more notes (requireOK wants stderr empty).
	requireOK(t, cli(t, db.URL, "migrate", "up"))
}

// While another run holds pgidem's migration lock, migrate status answers at once and
// migrate up says whom it waits for, then applies once the lock is free.
func TestMigrateLockHeld(t *testing.T) {
	t.Parallel()
	db := testdb.NewUnmigrated(t)
	holder, release := holdMigrationLock(t, db.URL)

	require.Contains(t, requireOK(t, cli(t, db.URL, "migrate", "status")), "pending")
	p := startCLI(t, db.URL, "migrate", "up")
	// The note comes while the lock is still held: the run is waiting.
	line := p.waitLine(t, "waiting for pgidem's migration lock")
	require.Equal(t, "pgidem: waiting for pgidem's migration lock, held by "+holder+
		" (another migration run); giving up after about 300 s", line)
	release()
	r := p.wait(t)
	require.Zero(t, r.code, r.stderr)
	require.Contains(t, r.stdout, "pgidem schema is now at version")
}

// holdMigrationLock takes pgidem's migration lock in the database at url as another
// migration run would (goose's table locker on migrations.LockTable and LockID) and
// returns the holder's name; release frees it (at the latest at cleanup).
func holdMigrationLock(t *testing.T, url string) (holder string, release func()) {
	t.Helper()
	ctx := context.Background()
	db, err := migrations.OpenDB(url, "")
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	locker, err := lock.NewPostgresTableLocker(lock.WithTableName(migrations.LockTable), lock.WithTableLockID(migrations.LockID))
	require.NoError(t, err)
	require.NoError(t, locker.Lock(ctx, db))
	var once sync.Once
	release = func() { once.Do(func() { require.NoError(t, locker.Unlock(ctx, db)) }) }
	t.Cleanup(release)
	holder, _, held, err := migrations.LockHolder(ctx, db)
	require.NoError(t, err)
	require.True(t, held)
	return holder, release
}

// cliWaitingForLock waits until a session of the CLI in db waits for a lock (a row or a
// table lock that the test holds).
func cliWaitingForLock(t *testing.T, db *testdb.DB) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting bool
		err := db.Pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND application_name = 'pgidem-cli' AND wait_event_type = 'Lock')`).Scan(&waiting)
		return err == nil && waiting
	}, time.Minute, 10*time.Millisecond)
}

// A migration run that finds pgidem's lock held but does not wait for it (here: nothing
// to migrate, which goose finds out without the lock) says nothing about waiting.
func TestMigrateLockNoteOnlyWhenWaiting(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	holdMigrationLock(t, db.URL)

	latest, _ := latestVersion(t)
	require.Equal(t, "pgidem schema is up to date at version "+strconv.FormatInt(latest, 10)+"\n",
		requireOK(t, cli(t, db.URL, "migrate", "up")))
}

// A rollback that fails part-way (here a view of the application's depends on the inbox)
// still reports, with --json, what it rolled back before the failure.
func TestMigrateDownPartialJSON(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, err := db.Pool.Exec(context.Background(), `CREATE VIEW app_inbox AS SELECT consumer FROM pgidem_inbox`)
	require.NoError(t, err)
	r := cli(t, db.URL, "migrate", "down", "--to", "0", "--force", "--json")
	require.Equal(t, 1, r.code, r.stderr)
	var out struct {
		RolledBack []struct {
			Version int64 `json:"version"`
		} `json:"rolled_back"`
		Version int64 `json:"version"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out), r.stdout)
	latest, _ := latestVersion(t)
	require.Len(t, out.RolledBack, int(latest-2), "every migration above the inbox's")
	require.Equal(t, latest, out.RolledBack[0].Version)
	require.Equal(t, int64(3), out.RolledBack[len(out.RolledBack)-1].Version)
	require.Equal(t, int64(2), out.Version)
	require.Contains(t, r.stderr, "other objects depend on it")
}

// migrate up --schema with a schema that does not exist creates it and installs pgidem
// there; when pgidem is installed in another schema (IDEM for idem, say) it says so instead
// of installing a second copy without a word.
func TestMigrateUpNewSchemaInstalledElsewhere(t *testing.T) {
	t.Parallel()
	db := testdb.New(t) // pgidem in public

	r := cli(t, db.URL, "--schema", "Public", "migrate", "up")
	require.Zero(t, r.code, r.stderr)
	require.Contains(t, r.stdout, "pgidem schema is now at version")
	require.Equal(t, `pgidem: note: installed pgidem anew in schema "Public", which this run created, although it is installed in `+
		`schema "public" of this database (schema names are case-sensitive); if you meant that installation, `+
		`roll this one back (pgidem --schema Public migrate down --to 0) and pass that --schema instead`+"\n", r.stderr)
	// Installed there now: no more notes.
	requireOK(t, cli(t, db.URL, "--schema", "Public", "migrate", "up"))

	// A schema of its own (one per tenant) gets pgidem without a note when it is the only
	// installation.
	fresh := testdb.NewUnmigrated(t)
	requireOK(t, cli(t, fresh.URL, "--schema", "tenant1", "migrate", "up"))
}
