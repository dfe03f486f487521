// Package migrations holds pgidem's database schema as embedded goose SQL migrations and
// runs them from Go.
//
// The migrations are ordinary goose SQL files (see [FS]); they run unchanged under the
// goose command line tool and can be copied into other migration tools. Run from Go, they
// use pgidem's own version table ([VersionTable]) and its own advisory lock ([LockID]), and
// goose's global registry of Go migrations is disabled, so pgidem's history never mixes
// with the application's own goose migrations in the same database.
//
// # Running
//
//	db, err := migrations.OpenDB(os.Getenv("DATABASE_URL"), "")
//	if err != nil { ... }
//	defer db.Close()
//	if _, err := migrations.Up(ctx, db, nil); err != nil { ... }
//
// # Schema
//
// Objects are created in the first schema of the connection's search_path. To use another
// schema, open the database with [OpenDB] and a schema name (or put search_path in the
// connection string) and set [Opts.Schema]; Up creates the schema when it is missing and
// refuses to run when the connection would put the tables anywhere else.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed sql/*.sql
var embedded embed.FS

const (
	// VersionTable is the goose version table pgidem records its own migrations in. It is
	// distinct from goose's default (goose_db_version) so the application's goose history
	// and pgidem's never collide.
	VersionTable = "pgidem_goose_db_version"

	// LockID is the Postgres session advisory lock id held while pgidem's migrations run,
	// so that concurrent deploys apply each migration once. It differs from goose's default
	// lock id. The value is the ASCII bytes of "pgidemmg".
	LockID int64 = 0x70676964656d6d67

	// LockRetryPeriodSeconds is how often, in seconds, a migration run waiting for
	// [LockID] retries (goose's minimum period is one second).
	LockRetryPeriodSeconds = 1

	// LockRetryAttempts is how many times a waiting migration run retries before it fails:
	// with [LockRetryPeriodSeconds] it waits about five minutes.
	LockRetryAttempts = 300
)

// FS returns the migration files: goose SQL files named NNNNN_description.sql at the root
// of the returned file system. It is read only and safe for concurrent use.
func FS() fs.FS {
	sub, err := fs.Sub(embedded, "sql")
	if err != nil {
		// fs.Sub only fails on an invalid path literal, which is a programming error.
		panic(err)
	}
	return sub
}

// Opts are optional settings for [NewProvider], [Up], [Down] and [Status]. A nil *Opts
// means all defaults.
type Opts struct {
	// Schema, when non-empty, is the schema pgidem's tables and version table live in. Up
	// creates it if it does not exist. The connections of the *sql.DB must already have it
	// as their current schema (see [OpenDB]); otherwise every function returns an error
	// instead of creating the tables elsewhere.
	//
	// Default: "", the first schema of the connection's search_path (usually public).
	Schema string

	// Logger receives goose's progress messages. Default: nil, which discards them.
	Logger *slog.Logger
}

// OpenDB opens a database/sql handle through pgx's stdlib adapter for connString (a URL or
// keyword/value string; "" means libpq's PG* environment variables). When schema is
// non-empty every connection uses it as its search_path, which is what [Opts.Schema]
// requires. The caller closes the returned *sql.DB.
func OpenDB(connString, schema string) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: parse connection string: %w", err)
	}
	if schema != "" {
		cfg.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	}
	return stdlib.OpenDB(*cfg), nil
}

// NewProvider returns a goose provider for pgidem's migrations on db, configured with
// [VersionTable], [LockID] and goose's global registry disabled. Use it for operations the
// package functions do not wrap (UpTo, DownTo, ApplyVersion). It returns an error when
// Opts.Schema is set and is not db's current schema.
func NewProvider(ctx context.Context, db *sql.DB, opts *Opts) (*goose.Provider, error) {
	if db == nil {
		return nil, errors.New("pgidem: migrations: db is nil")
	}
	if opts == nil {
		opts = &Opts{}
	}
	if opts.Schema != "" {
		if err := ensureSchema(ctx, db, opts.Schema); err != nil {
			return nil, err
		}
	}
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(LockID),
		lock.WithLockTimeout(LockRetryPeriodSeconds, LockRetryAttempts),
	)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: session locker: %w", err)
	}
	providerOpts := []goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	}
	if opts.Logger != nil {
		providerOpts = append(providerOpts, goose.WithSlog(opts.Logger), goose.WithVerbose(true))
	}
	provider, err := goose.NewProvider(goose.DialectPostgres, db, FS(), providerOpts...)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: new provider: %w", err)
	}
	return provider, nil
}

// ensureSchema creates schema if needed and checks that it is db's current schema.
func ensureSchema(ctx context.Context, db *sql.DB, schema string) error {
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("pgidem: migrations: create schema %q: %w", schema, err)
	}
	var current sql.NullString
	if err := db.QueryRowContext(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return fmt.Errorf("pgidem: migrations: read current schema: %w", err)
	}
	if current.String != schema {
		return fmt.Errorf("pgidem: migrations: Opts.Schema is %q but the connection's current schema is %q; open the database with migrations.OpenDB(connString, %q) or set search_path in the connection string", schema, current.String, schema)
	}
	return nil
}

// Up applies every pending pgidem migration, holding [LockID] so concurrent callers (two
// deploys starting at once) all succeed and each migration is applied once. It returns the
// migrations this call applied (none when the schema is current). Cancelling ctx stops
// between statements; a migration interrupted mid-way is rolled back by its transaction.
func Up(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationResult, error) {
	provider, err := NewProvider(ctx, db, opts)
	if err != nil {
		return nil, err
	}
	results, err := provider.Up(ctx)
	if err != nil {
		return results, fmt.Errorf("pgidem: migrations: up: %w", err)
	}
	return results, nil
}

// Down rolls back every applied pgidem migration, removing all of pgidem's tables (records
// and their data included) and leaving only the empty version table. It holds [LockID]
// like [Up]. Use [NewProvider] and DownTo to roll back part of the way.
func Down(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationResult, error) {
	provider, err := NewProvider(ctx, db, opts)
	if err != nil {
		return nil, err
	}
	results, err := provider.DownTo(ctx, 0)
	if err != nil {
		return results, fmt.Errorf("pgidem: migrations: down: %w", err)
	}
	return results, nil
}

// Status reports every pgidem migration and whether it has been applied.
func Status(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationStatus, error) {
	provider, err := NewProvider(ctx, db, opts)
	if err != nil {
		return nil, err
	}
	status, err := provider.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: status: %w", err)
	}
	return status, nil
}
