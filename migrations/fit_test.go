package migrations_test

import (
	"bufio"
	"context"
	"database/sql"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// catalogSQL lists every object a migration could leave behind in the database, outside
// the system schemas: schemas, relations (tables, indexes, sequences, views), types,
// functions, constraints (with their definitions, so a migration that only changes one
// is seen), user triggers, rules, policies, extensions and event triggers.
const catalogSQL = `
WITH user_ns AS (
	SELECT oid, nspname FROM pg_catalog.pg_namespace
	WHERE nspname NOT IN ('pg_catalog', 'information_schema')
	  AND nspname NOT LIKE 'pg\_toast%' AND nspname NOT LIKE 'pg\_temp\_%'
)
SELECT 'schema ' || nspname FROM user_ns
UNION ALL SELECT 'relation ' || n.nspname || '.' || c.relname || ' (' || c.relkind::text || ')'
	FROM pg_catalog.pg_class c JOIN user_ns n ON n.oid = c.relnamespace
UNION ALL SELECT 'type ' || n.nspname || '.' || t.typname
	FROM pg_catalog.pg_type t JOIN user_ns n ON n.oid = t.typnamespace
UNION ALL SELECT 'function ' || n.nspname || '.' || p.proname
	FROM pg_catalog.pg_proc p JOIN user_ns n ON n.oid = p.pronamespace
UNION ALL SELECT 'constraint ' || n.nspname || '.' || c.conname || ' ' || pg_catalog.pg_get_constraintdef(c.oid)
	FROM pg_catalog.pg_constraint c JOIN user_ns n ON n.oid = c.connamespace
UNION ALL SELECT 'trigger ' || t.tgname FROM pg_catalog.pg_trigger t WHERE NOT t.tgisinternal
UNION ALL SELECT 'rule ' || r.rulename FROM pg_catalog.pg_rewrite r
	JOIN pg_catalog.pg_class c ON c.oid = r.ev_class JOIN user_ns n ON n.oid = c.relnamespace
	WHERE r.rulename <> '_RETURN'
UNION ALL SELECT 'policy ' || polname FROM pg_catalog.pg_policy
UNION ALL SELECT 'extension ' || extname FROM pg_catalog.pg_extension WHERE extname <> 'plpgsql'
UNION ALL SELECT 'event trigger ' || evtname FROM pg_catalog.pg_event_trigger
UNION ALL SELECT 'comment on ' || n.nspname || '.' || c.relname || ' column ' || d.objsubid
	FROM pg_catalog.pg_description d
	JOIN pg_catalog.pg_class c ON c.oid = d.objoid AND d.classoid = 'pg_catalog.pg_class'::regclass
	JOIN user_ns n ON n.oid = c.relnamespace
ORDER BY 1`

// catalog returns the database's user objects, minus those of version tables (versionTables
// are the goose version tables in use, whose objects stay by design).
func catalog(t *testing.T, db *sql.DB, versionTables ...string) []string {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), catalogSQL)
	require.NoError(t, err)
	defer rows.Close()
	var objects []string
	for rows.Next() {
		var o string
		require.NoError(t, rows.Scan(&o))
		if !slices.ContainsFunc(versionTables, func(v string) bool { return strings.Contains(o, v) }) {
			objects = append(objects, o)
		}
	}
	require.NoError(t, rows.Err())
	return objects
}

// TestDownLeavesNothing applies each migration and rolls it back, one at a time, and
// checks against pg_catalog that every down migration removes exactly what its up
// migration created; then that a full down leaves only the version table.
func TestDownLeavesNothing(t *testing.T) {
	t.Parallel()
	for _, schema := range []string{"", "idem"} {
		name := "DefaultSchema"
		if schema != "" {
			name = "OwnSchema"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			tdb := testdb.NewUnmigrated(t)
			db := open(t, tdb.URL, schema)
			if schema != "" {
				// Up creates the schema but Down leaves it (it may hold other things): make it
				// part of the baseline.
				_, err := db.ExecContext(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
				require.NoError(t, err)
			}
			baseline := catalog(t, db)
			provider, err := migrations.NewProvider(ctx, db, &migrations.Opts{Schema: schema})
			require.NoError(t, err)

			for _, source := range provider.ListSources() {
				before := catalog(t, db, migrations.VersionTable, migrations.LockTable)
				_, err := provider.UpByOne(ctx)
				require.NoError(t, err, source.Path)
				created := catalog(t, db, migrations.VersionTable, migrations.LockTable)
				require.NotEqual(t, before, created, "%s created nothing", source.Path)

				_, err = provider.Down(ctx)
				require.NoError(t, err, source.Path)
				require.Equal(t, before, catalog(t, db, migrations.VersionTable, migrations.LockTable), "down of %s left objects behind", source.Path)

				_, err = provider.UpByOne(ctx)
				require.NoError(t, err, source.Path)
				require.Equal(t, created, catalog(t, db, migrations.VersionTable, migrations.LockTable), "%s is not repeatable after its down", source.Path)
			}

			_, err = provider.DownTo(ctx, 0)
			require.NoError(t, err)
			left := catalog(t, db)
			for _, o := range left {
				if !slices.Contains(baseline, o) {
					require.True(t, strings.Contains(o, migrations.VersionTable) || strings.Contains(o, migrations.LockTable),
						"left behind by the down migrations: %s", o)
				}
			}
			require.Equal(t, baseline, catalog(t, db, migrations.VersionTable, migrations.LockTable))
		})
	}
}

// TestPlainGoose runs the SQL files as the goose command line tool does: read from the
// directory on disk, goose's default version table (goose_db_version), no pgidem options.
// It proves the files need nothing from pgidem's Go code.
func TestPlainGoose(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	baseline := catalog(t, db)

	// The files on disk are the embedded ones.
	onDisk := os.DirFS("sql")
	embedded, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	disk, err := fs.Glob(onDisk, "*.sql")
	require.NoError(t, err)
	require.Equal(t, embedded, disk)
	for _, name := range disk {
		a, err := fs.ReadFile(onDisk, name)
		require.NoError(t, err)
		b, err := fs.ReadFile(migrations.FS(), name)
		require.NoError(t, err)
		require.Equal(t, string(a), string(b), name)
	}

	provider, err := goose.NewProvider(goose.DialectPostgres, db, onDisk, goose.WithDisableGlobalRegistry(true))
	require.NoError(t, err)
	applied, err := provider.Up(ctx)
	require.NoError(t, err)
	require.Len(t, applied, len(disk))
	require.True(t, tableExists(t, db, "public", "pgidem_record"))
	require.True(t, tableExists(t, db, "public", goose.DefaultTablename))
	require.False(t, tableExists(t, db, "public", migrations.VersionTable))

	_, err = provider.DownTo(ctx, 0)
	require.NoError(t, err)
	require.Equal(t, baseline, catalog(t, db, goose.DefaultTablename))
}

// splitGoose splits a goose SQL file into its up and down parts, the way docs/migrations.md
// tells golang-migrate users to (the awk one-liner there does the same).
func splitGoose(t *testing.T, text string) (up, down string) {
	t.Helper()
	var part *strings.Builder
	var upB, downB strings.Builder
	scanner := bufio.NewScanner(strings.NewReader(text))
	for scanner.Scan() {
		line := scanner.Text()
		switch {
		case strings.HasPrefix(line, "-- +goose Up"):
			part = &upB
		case strings.HasPrefix(line, "-- +goose Down"):
			part = &downB
		case strings.HasPrefix(line, "-- +goose"):
			t.Fatalf("goose annotation %q: the vendoring recipe in docs/migrations.md does not handle it", line)
		case part != nil:
			part.WriteString(line + "\n")
		}
	}
	require.NoError(t, scanner.Err())
	return upB.String(), downB.String()
}

// TestVendoredSplit runs the files as golang-migrate would after the split described in
// docs/migrations.md: each up part as one multi-statement Exec, in order, then each down
// part in reverse; the database ends as it began.
func TestVendoredSplit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	baseline := catalog(t, db)

	names, err := fs.Glob(migrations.FS(), "*.sql")
	require.NoError(t, err)
	var downs []string
	for _, name := range names {
		require.Regexp(t, regexp.MustCompile(`^\d{5}_[a-z0-9_]+\.sql$`), name, "golang-migrate needs VERSION_TITLE names")
		text, err := fs.ReadFile(migrations.FS(), name)
		require.NoError(t, err)
		up, down := splitGoose(t, string(text))
		require.NotEmpty(t, strings.TrimSpace(up), name)
		require.NotEmpty(t, strings.TrimSpace(down), name)
		_, err = db.ExecContext(ctx, up)
		require.NoError(t, err, "up part of %s", name)
		downs = append(downs, filepath.Base(name)+"\x00"+down)
	}
	require.True(t, tableExists(t, db, "public", "pgidem_record"))
	slices.Reverse(downs)
	for _, d := range downs {
		name, down, _ := strings.Cut(d, "\x00")
		_, err := db.ExecContext(ctx, down)
		require.NoError(t, err, "down part of %s", name)
	}
	require.Equal(t, baseline, catalog(t, db))
}

// TestRecordOverview checks the view's derived columns on rows whose times are far from
// any boundary, so nothing depends on timing.
func TestRecordOverview(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.New(t)
	long := `{"text": "` + strings.Repeat("x", 100) + `"}`
	_, err := tdb.Pool.Exec(ctx, `
		INSERT INTO pgidem_record (namespace, key, status, owner, attempts, result, error,
			lease_expires_at, expires_at, created_at, updated_at, completed_at)
		VALUES
		('invoices', 'done', 'completed', gen_random_uuid(), 2, '{"invoice_id": "inv_1"}', NULL,
			NULL, now() + interval '23 hours', now() - interval '1 hour', now(), now()),
		('invoices', 'long', 'completed', gen_random_uuid(), 1, $1::jsonb, NULL,
			NULL, now() + interval '1 hour', now() - interval '2 hours', now(), now()),
		('invoices', 'running', 'in_progress', gen_random_uuid(), 1, NULL, NULL,
			now() + interval '1 hour', now() + interval '24 hours', now() - interval '10 minutes', now(), NULL),
		('invoices', 'dead', 'in_progress', gen_random_uuid(), 1, NULL, NULL,
			now() - interval '1 hour', now() + interval '24 hours', now() - interval '3 hours', now(), NULL),
		('mail', 'bounced', 'failed', gen_random_uuid(), 1, NULL, '{"message": "mailbox unavailable"}',
			NULL, now() - interval '1 hour', now() - interval '25 hours', now(), now())`, long)
	require.NoError(t, err)

	type row struct {
		key                         string
		tookOver, leaseExpired, exp bool
		ageHours                    float64
		leaseRemainingPositive      *bool
		ttlRemainingPositive        bool
		preview                     *string
	}
	rows, err := tdb.Pool.Query(ctx, `
		SELECT key, took_over, lease_expired, expired,
		       extract(epoch FROM age) / 3600,
		       lease_remaining > interval '0',
		       ttl_remaining > interval '0',
		       result_preview
		FROM pgidem_record_overview ORDER BY key`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		err := r.Scan(&x.key, &x.tookOver, &x.leaseExpired, &x.exp, &x.ageHours,
			&x.leaseRemainingPositive, &x.ttlRemainingPositive, &x.preview)
		return x, err
	})
	require.NoError(t, err)
	require.Len(t, got, 5)
	byKey := map[string]row{}
	for _, r := range got {
		byKey[r.key] = r
	}
	yes, no := true, false

	require.True(t, byKey["done"].tookOver)
	require.InDelta(t, 1, byKey["done"].ageHours, 0.1)
	require.Nil(t, byKey["done"].leaseRemainingPositive)
	require.Equal(t, `{"invoice_id": "inv_1"}`, *byKey["done"].preview)

	require.False(t, byKey["long"].tookOver)
	preview := *byKey["long"].preview
	require.Equal(t, 60, len([]rune(preview)))
	require.True(t, strings.HasSuffix(preview, "…"))
	require.True(t, strings.HasPrefix(long, strings.TrimSuffix(preview, "…")))

	require.Equal(t, &yes, byKey["running"].leaseRemainingPositive)
	require.False(t, byKey["running"].leaseExpired)
	require.Nil(t, byKey["running"].preview)

	require.Equal(t, &no, byKey["dead"].leaseRemainingPositive)
	require.True(t, byKey["dead"].leaseExpired)
	require.False(t, byKey["dead"].exp)

	require.True(t, byKey["bounced"].exp)
	require.False(t, byKey["bounced"].ttlRemainingPositive)
	require.Equal(t, `{"message": "mailbox unavailable"}`, *byKey["bounced"].preview)
}

// TestInspectDocQueries runs every SQL block of docs/inspect.md against a database with
// records, so the documented queries keep working as the schema evolves.
func TestInspectDocQueries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	doc, err := os.ReadFile(filepath.Join("..", "docs", "inspect.md"))
	require.NoError(t, err)
	blocks := regexp.MustCompile("(?s)```sql\n(.*?)```").FindAllStringSubmatch(string(doc), -1)
	require.GreaterOrEqual(t, len(blocks), 4, "docs/inspect.md has its queries in ```sql blocks")

	tdb := testdb.New(t)
	_, err = pgidemriver.MigrateRiver(ctx, tdb.Pool, nil) // the River section joins river_job
	require.NoError(t, err)
	_, err = tdb.Pool.Exec(ctx, `
		INSERT INTO pgidem_record (namespace, key, status, owner, attempts, result,
			lease_expires_at, expires_at, created_at, updated_at, completed_at)
		VALUES
		('invoices', 'order-9.invoice', 'completed', gen_random_uuid(), 2, '{"invoice_id": "inv_1"}',
			NULL, now() + interval '1 hour', now() - interval '1 hour', now(), now()),
		('invoices', 'order-7.invoice', 'in_progress', gen_random_uuid(), 1, NULL,
			now() - interval '1 hour', now() + interval '24 hours', now() - interval '3 hours', now(), NULL)`)
	require.NoError(t, err)
	for i, block := range blocks {
		tx, err := tdb.Pool.Begin(ctx)
		require.NoError(t, err)
		// Simple protocol: a block may hold several statements; the rollback keeps any
		// DELETE in the docs from changing what the next block sees.
		_, err = tx.Exec(ctx, block[1], pgx.QueryExecModeSimpleProtocol)
		require.NoError(t, err, "query %d of docs/inspect.md:\n%s", i+1, block[1])
		require.NoError(t, tx.Rollback(ctx))
	}
}

// TestGooseCLIWithPgidemTable checks that the goose command line tool run with
// -table pgidem_goose_db_version and pgidem's own runner share one history: each continues
// where the other stopped.
func TestGooseCLIWithPgidemTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")

	cliLike, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS("sql"),
		goose.WithDisableGlobalRegistry(true), goose.WithTableName(migrations.VersionTable))
	require.NoError(t, err)
	res, err := cliLike.UpByOne(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), res.Source.Version)

	applied, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)
	require.Len(t, applied, len(cliLike.ListSources())-1, "pgidem's runner applies only what the goose CLI has not")
	require.NotEqual(t, int64(1), applied[0].Source.Version)

	pending, err := cliLike.HasPending(ctx)
	require.NoError(t, err)
	require.False(t, pending, "the goose CLI sees pgidem's runner's migrations as applied")
}
