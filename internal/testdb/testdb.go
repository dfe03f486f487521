// Package testdb gives each test its own Postgres database, cloned from a template that is
// migrated once per test process.
//
// The server is found by [dbserver.Find]: DATABASE_URL, libpq PG* variables, the local
// default, or testcontainers-go. When none answers the test fails (never skips) with a
// message that says how to provide one.
//
// The template's name carries a hash of the migration files, so a changed migration gets a
// fresh template; creating it is serialised across test processes with an advisory lock.
package testdb

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/migrations"
)

// templateLockID serialises template creation across test processes ("pgidemtt").
const templateLockID int64 = 0x70676964656d7474

type state struct {
	server   *dbserver.Server
	template string
	err      error
}

var (
	once   sync.Once
	shared state
)

// setupTemplate finds the server and makes sure the migrated template database exists.
func setupTemplate() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	server, err := dbserver.Find(ctx)
	if err != nil {
		shared.err = err
		return
	}
	shared.server = server
	name, err := templateName()
	if err != nil {
		shared.err = err
		return
	}
	shared.template = name
	if shared.err = ensureTemplate(ctx, server.URL, name); shared.err != nil {
		return
	}
	// Databases of runs killed before their cleanup would pile up on a developer's server.
	// No run lasts staleAge; one that does keeps its databases while connected to them.
	if _, err := server.DropStale(ctx, staleAge); err != nil {
		shared.err = fmt.Errorf("testdb: %w", err)
	}
}

// staleAge is the age past which [dbserver.Server.DropStale] removes an unused test or
// example database.
const staleAge = 6 * time.Hour

func templateName() (string, error) {
	h := sha256.New()
	err := fs.WalkDir(migrations.FS(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := fs.ReadFile(migrations.FS(), path)
		if err != nil {
			return err
		}
		h.Write([]byte(path))
		h.Write(b)
		return nil
	})
	if err != nil {
		return "", err
	}
	return "pgidem_tmpl_" + hex.EncodeToString(h.Sum(nil))[:16], nil
}

func ensureTemplate(ctx context.Context, serverURL, name string) error {
	conn, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return fmt.Errorf("testdb: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", templateLockID); err != nil {
		return fmt.Errorf("testdb: lock: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", templateLockID) //nolint:errcheck

	var ready bool
	err = conn.QueryRow(ctx,
		"SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1 AND datistemplate)", name).Scan(&ready)
	if err != nil {
		return fmt.Errorf("testdb: look up template: %w", err)
	}
	// Templates of other migration revisions no test run used for an hour are no longer
	// used: remove them. (A run of another checkout, on another branch, may be cloning a
	// more recently used one right now.)
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_database
		WHERE datname LIKE 'pgidem\_tmpl\_%' AND datname <> $1
			AND coalesce(substring(shobj_description(oid, 'pg_database') FROM '^pgidem test template used at (.*)$')::timestamptz,
				'-infinity') < now() - interval '1 hour'`, name)
	if err != nil {
		return fmt.Errorf("testdb: list old templates: %w", err)
	}
	old, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("testdb: list old templates: %w", err)
	}
	for _, db := range old {
		ident := pgx.Identifier{db}.Sanitize()
		if _, err := conn.Exec(ctx, "ALTER DATABASE "+ident+" WITH IS_TEMPLATE false"); err != nil {
			return fmt.Errorf("testdb: unmark old template %s: %w", db, err)
		}
		if _, err := conn.Exec(ctx, "DROP DATABASE "+ident+" WITH (FORCE)"); err != nil {
			return fmt.Errorf("testdb: drop old template %s: %w", db, err)
		}
	}
	if ready {
		// Mark it used now, so that a run of another revision keeps it for the next hour.
		return markTemplate(ctx, conn, name)
	}
	// A half-made template from a killed run is not marked datistemplate: start over.
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("testdb: drop stale template: %w", err)
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return fmt.Errorf("testdb: create template: %w", err)
	}
	if err := migrate(ctx, serverURL, name); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH IS_TEMPLATE true"); err != nil {
		return fmt.Errorf("testdb: mark template: %w", err)
	}
	return markTemplate(ctx, conn, name)
}

// markTemplate records in the template's comment that a run uses it now: runs of other
// migration revisions drop templates only an hour after their last use.
func markTemplate(ctx context.Context, conn *pgx.Conn, name string) error {
	// (COMMENT takes no parameters; the text is ours and holds no quote.)
	if _, err := conn.Exec(ctx, fmt.Sprintf("COMMENT ON DATABASE %s IS 'pgidem test template used at %s'",
		pgx.Identifier{name}.Sanitize(), time.Now().UTC().Format(time.RFC3339))); err != nil {
		return fmt.Errorf("testdb: mark template: %w", err)
	}
	return nil
}

func migrate(ctx context.Context, serverURL, dbName string) error {
	url, err := dbserver.ConnStringFor(serverURL, dbName)
	if err != nil {
		return err
	}
	db, err := migrations.OpenDB(url, "")
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := migrations.Up(ctx, db, nil); err != nil {
		return fmt.Errorf("testdb: migrate template: %w", err)
	}
	return nil
}

// DB is a fresh, migrated database owned by one test.
type DB struct {
	// Name is the database's name.
	Name string
	// URL connects to it; hand it to child processes or command line tools.
	URL string
	// Pool is a pool on it, closed at test cleanup.
	Pool *pgxpool.Pool
}

// NewPool returns another pool on db of at most maxConns connections (pgxpool's default,
// max(4, CPUs), queues concurrent statements in benchmarks), closed at test cleanup before
// the database is dropped.
func (db *DB) NewPool(tb testing.TB, maxConns int32) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

// New creates a fresh database cloned from the migrated template, and drops it when the
// test ends. It fails the test when no server can be found.
func New(tb testing.TB) *DB {
	tb.Helper()
	return newDB(tb, true)
}

// NewUnmigrated creates a fresh empty database (no pgidem tables), for migration tests.
func NewUnmigrated(tb testing.TB) *DB {
	tb.Helper()
	return newDB(tb, false)
}

// newDB creates a database, from the migrated template when migrated is true.
func newDB(tb testing.TB, migrated bool) *DB {
	tb.Helper()
	db, drop, err := Create(context.Background(), migrated)
	if err != nil {
		tb.Fatalf("testdb: %v", err)
	}
	tb.Cleanup(func() {
		if err := drop(); err != nil {
			tb.Errorf("testdb: %v", err)
		}
	})
	return db
}

// Create makes a fresh database (from the migrated template when migrated is true) for
// callers without a testing.TB, such as runnable examples. The returned function closes the
// pool and drops the database.
func Create(ctx context.Context, migrated bool) (*DB, func() error, error) {
	once.Do(setupTemplate)
	if shared.err != nil {
		return nil, nil, shared.err
	}
	template := ""
	if migrated {
		template = shared.template
	}
	db, err := shared.server.CreateDatabase(ctx, "pgidem_test_", template)
	if err != nil {
		return nil, nil, err
	}
	pool, err := pgxpool.New(ctx, db.URL)
	if err != nil {
		return nil, nil, errors.Join(err, db.Drop(ctx))
	}
	drop := func() error { pool.Close(); return db.Drop(ctx) }
	return &DB{Name: db.Name, URL: db.URL, Pool: pool}, drop, nil
}

// ServerURL returns the URL of the server the test databases live on, failing the test when
// none can be found.
func ServerURL(tb testing.TB) string {
	tb.Helper()
	once.Do(setupTemplate)
	if shared.err != nil {
		tb.Fatalf("testdb: %v", shared.err)
	}
	return shared.server.URL
}
