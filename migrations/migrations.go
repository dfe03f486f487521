// Package migrations holds pgidem's database schema as embedded goose SQL migrations and
// runs them from Go.
//
// The migrations are ordinary goose SQL files (see [FS]); they run unchanged under the
// goose command line tool and can be copied into other migration tools. Run from Go, they
// use pgidem's own version table ([VersionTable]) and their own lock ([LockTable], [LockID]), and
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
// Objects are created in the connection's current schema: the first existing schema of its
// search_path. To use another schema, open the database with [OpenDB] and a schema name (or
// put search_path in the connection string) and set [Opts.Schema]. Up creates the schema
// when it is missing. It refuses to run when the connection would put the tables anywhere
// else. Down, Reset and Status never create a schema: for a missing one they return an
// error.
//
// Without Opts.Schema, every function refuses to run when pgidem is installed in another
// schema of the search_path than the current one, instead of installing it a second time
// (see [NewProvider]).
//
// # Locking and connection poolers
//
// Up, Down, DownTo and Reset hold pgidem's migration lock while they migrate. The lock is
// a row in [LockTable] (goose's table locker), not a session advisory lock. So concurrent
// deploys apply each migration once also through a transaction-pooling proxy such as
// PgBouncer.
// The caller's context bounds the wait for the lock ([ErrLockHeld]) and the retries of
// its release; a holder that dies or fails to release it leaves a lease that runs out
// after [LockLease]. Through PgBouncer in transaction pooling, open the database with
// default_query_exec_mode=exec (or simple_protocol) in the connection string.
package migrations

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

	// LockID identifies pgidem's migration lock: the id of its row in [LockTable], held
	// while pgidem's migrations run so that concurrent deploys apply each migration once,
	// and the transaction advisory lock id under which [Up] creates [Opts.Schema]. It
	// differs from goose's default lock id. The value is the ASCII bytes of "pgidemmg".
	LockID int64 = 0x70676964656d6d67

	// LockRetryPeriodSeconds is how often, in seconds, a migration run waiting for the
	// migration lock tries again (with goose's ±25% jitter).
	LockRetryPeriodSeconds = 1

	// LockRetryAttempts is how many times a waiting migration run retries before it fails
	// with [ErrLockHeld]: with [LockRetryPeriodSeconds] it waits about five minutes, or
	// until the caller's context ends, whichever comes first.
	LockRetryAttempts = 300
)

// ErrManagedElsewhere is returned (wrapped, with the schema named) by [NewProvider], [Up],
// [Down], [DownTo], [Reset], [Status] and [Installed] when pgidem's tables exist in the
// current schema but [VersionTable] records no migration there. Another migration tool
// created them: pgidem's files copied into the application's own migrations, or the goose
// CLI without -table pgidem_goose_db_version (docs/migrations.md). That tool's
// history is the one that knows them; applying the files again from here would fail on
// the existing tables, so nothing is run or created. Keep migrating them with that tool.
var ErrManagedElsewhere = errors.New("pgidem: migrations: pgidem's tables are managed by another migration tool")

// ErrDataLoss is returned (wrapped, naming the tables and their row counts) by [Down],
// [DownTo] and [Reset] with [Opts.RefuseDataLoss] when a migration they would roll back
// drops a table that holds rows. Nothing is rolled back.
var ErrDataLoss = errors.New("pgidem: migrations: refused: the rollback would drop rows")

// ErrInvalidArgument is matched by the error of a call given an argument it cannot use: a
// nil *sql.DB, an Opts.Schema or OpenDB schema that [CheckSchemaName] refuses, a negative
// version for [DownTo]. Nothing is run. (The package cannot import pgidem, whose
// pgidem.ErrInvalidArgument is the same idea.)
var ErrInvalidArgument = errors.New("pgidem: migrations: invalid argument")

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

// Opts are optional settings for [NewProvider], [Up], [Down], [DownTo], [Reset], [Status] and [Installed]. A nil
// *Opts means all defaults.
type Opts struct {
	// Schema, when non-empty, is the schema pgidem's tables and version table live in. It
	// must pass [CheckSchemaName] (at most [SchemaMaxLen] bytes, valid UTF-8, no control
	// character, not only white space, not "$user"); otherwise every function returns an error. It is
	// quoted, so any other name works (mixed case, spaces). The connections of the *sql.DB must already have it as their current schema
	// (see [OpenDB]); otherwise every function returns an error instead of creating the
	// tables elsewhere.
	//
	// Only [Up] creates the schema when it is missing. [NewProvider], [Installed], [Down],
	// [DownTo], [Reset] and [Status] return an error for a schema that does not exist, so a
	// mistyped name is reported instead of created.
	//
	// Default: "", the current schema of the connection: the first existing schema of its
	// search_path (usually public).
	Schema string

	// Logger receives goose's progress messages. Default: nil, which discards them.
	Logger *slog.Logger

	// RefuseDataLoss makes [Down], [DownTo] and [Reset] refuse, rolling back nothing, when
	// a migration they would roll back drops a table that holds rows. The error matches
	// [ErrDataLoss]. Without pgidem_record every completed key would run its effect again;
	// without pgidem_inbox every recorded message would be handled again. The check runs under
	// the migration lock, which the rollback then keeps, so another rollback cannot
	// change what is rolled back after the check. It guards against rolling back the
	// wrong database, not against the application writing meanwhile: a row committed
	// between the check and the DROP is dropped with its table, so stop the application's
	// use of pgidem first. Rows are counted up to a million per table. Default false: they
	// roll back as asked. `pgidem migrate down` sets it unless --force.
	RefuseDataLoss bool
}

// SchemaMaxLen is the longest schema name, in bytes, that [Opts.Schema] and [OpenDB]
// accept: Postgres's identifier limit (NAMEDATALEN - 1). Postgres truncates longer names.
const SchemaMaxLen = 63

// CheckSchemaName returns an error saying why schema cannot be pgidem's schema name, or
// nil. It must be valid UTF-8 without NUL or other control characters, and not only white
// space. It must be at most [SchemaMaxLen] bytes, since Postgres would silently truncate a
// longer name. It must not be "$user": search_path reads it, quoted or not, as the role's
// name.
// pgidem.Config.Schema follows the same rules (except the last: the coordinator qualifies
// its table names, so a schema named "$user" would work there), so a schema Up creates is
// one the coordinator accepts. The empty string (the default schema) is valid.
func CheckSchemaName(schema string) error {
	switch {
	case schema == "":
		return nil
	case len(schema) > SchemaMaxLen:
		return fmt.Errorf("%q is %d bytes long; Postgres truncates identifiers to %d bytes", schema, len(schema), SchemaMaxLen)
	case !utf8.ValidString(schema):
		return fmt.Errorf("%q is not valid UTF-8", schema)
	case strings.IndexFunc(schema, unicode.IsControl) >= 0:
		return fmt.Errorf("%q contains a control character", schema)
	case strings.TrimSpace(schema) == "":
		return fmt.Errorf("%q is only white space", schema)
	case schema == "$user":
		return fmt.Errorf("%q stands for the role's own schema in a search_path, so no connection can have a schema of that name as its current schema", schema)
	}
	return nil
}

// checkSchemaName is [CheckSchemaName] with the field's name in the error.
func checkSchemaName(field, schema string) error {
	if err := CheckSchemaName(schema); err != nil {
		return fmt.Errorf("%w: %s %w", ErrInvalidArgument, field, err)
	}
	return nil
}

// OpenDB opens a database/sql handle through pgx's stdlib adapter for connString (a URL or
// keyword/value string; "" means libpq's PG* environment variables). When schema is
// non-empty every connection uses it as its search_path, which is what [Opts.Schema]
// requires; schema follows the rules of [Opts.Schema], and an invalid one is an error.
//
// Every connection also sets the session time zone to UTC, replacing any timezone in
// connString or in the database's or role's settings. goose records when a migration was
// applied in a timestamp without time zone, written with now() in the session's time zone
// and read back as UTC (see [Status]).
//
// OpenDB does not connect; the first operation does. The caller closes the returned
// *sql.DB.
func OpenDB(connString, schema string) (*sql.DB, error) {
	if err := checkSchemaName("schema", schema); err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: parse connection string: %w", err)
	}
	if schema != "" {
		cfg.RuntimeParams["search_path"] = pgx.Identifier{schema}.Sanitize()
	}
	for name := range cfg.RuntimeParams {
		if strings.EqualFold(name, "timezone") {
			delete(cfg.RuntimeParams, name)
		}
	}
	cfg.RuntimeParams["timezone"] = "UTC"
	return stdlib.OpenDB(*cfg), nil
}

// NewProvider returns a goose provider for pgidem's migrations on db, configured with
// [VersionTable], goose's table lock on [LockTable] and [LockID] (goose's own waits and
// release retries, bounded by [LockRetryAttempts], not by a context), and goose's global
// registry disabled. goose takes a connection before it takes the lock through another
// one, so the provider's locking operations need a *sql.DB of at least two connections;
// the package's functions do not. Cancelling ctx stops its checks.
//
// NewProvider queries db to check where pgidem is installed, and returns an error (creating
// nothing) when:
//   - Opts.Schema is invalid (see [Opts.Schema]).
//   - Opts.Schema names a schema that does not exist (only [Up] creates it).
//   - Opts.Schema is set and is not db's current schema.
//   - Opts.Schema is empty and pgidem's version table is missing from db's current schema
//     but exists in another schema on its search_path. pgidem is installed there, and
//     migrating the current schema would install it a second time. That happens when a
//     schema named after the role appears in front of public on the default search_path
//     "$user", public. The error names that schema; pass it as Opts.Schema and to
//     [OpenDB].
//   - pgidem's tables are in the current schema but [VersionTable] records no migration
//     there: another tool installed them ([ErrManagedElsewhere]).
//
// Use it for operations the package functions do not wrap (UpTo, ApplyVersion); prefer
// [DownTo] to the provider's, which honours [Opts.RefuseDataLoss] and refuses a database
// newer than this build.
//
// Like goose's own provider, the returned provider creates [VersionTable] in the current
// schema on its first operation, Status and version queries included; [Status], [Down],
// [DownTo], [Reset] and [Installed] do not where pgidem was never installed.
func NewProvider(ctx context.Context, db *sql.DB, opts *Opts) (*goose.Provider, error) {
	// Not ctx: it bounds NewProvider's checks, not the provider's later operations.
	locker, err := newTableLocker(context.Background())
	if err != nil {
		return nil, err
	}
	return newProvider(ctx, db, opts, locker)
}

// newProvider is [NewProvider] with the given locker; with none, the provider takes no
// lock. That is for reports that must not wait for a migration in progress (goose's Status
// and GetDBVersion take it). It is also for the package's functions, which take the lock
// around the provider's work themselves ([locked]).
func newProvider(ctx context.Context, db *sql.DB, opts *Opts, locker lock.Locker) (*goose.Provider, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: db is nil", ErrInvalidArgument)
	}
	if opts == nil {
		opts = &Opts{}
	}
	if err := checkSchemaName("Opts.Schema", opts.Schema); err != nil {
		return nil, err
	}
	if opts.Schema != "" {
		if err := checkSchema(ctx, db, opts.Schema); err != nil {
			return nil, err
		}
	} else if err := checkNotInstalledElsewhere(ctx, db); err != nil {
		return nil, err
	}
	if err := checkManagedHere(ctx, db); err != nil {
		return nil, err
	}
	providerOpts := []goose.ProviderOption{
		goose.WithTableName(VersionTable),
		goose.WithDisableGlobalRegistry(true),
	}
	if locker != nil {
		providerOpts = append(providerOpts, goose.WithLocker(locker))
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

// wrongSchemaError is the error for a connection whose current schema is not Opts.Schema.
func wrongSchemaError(schema string, current sql.NullString) error {
	if !current.Valid {
		// search_path names no schema the role can use: Opts.Schema (if the connection
		// points there) exists, so the role lacks USAGE on it.
		return fmt.Errorf("pgidem: migrations: the connection has no current schema: its search_path names no schema this role may use; if it is set to %q, grant the role USAGE (and CREATE, to migrate) on schema %q, or open the database with migrations.OpenDB(connString, %q)", schema, schema, schema)
	}
	return fmt.Errorf("pgidem: migrations: Opts.Schema is %q but the connection's current schema is %q; open the database with migrations.OpenDB(connString, %q) or set search_path in the connection string", schema, current.String, schema)
}

// checkSchema checks that schema exists and is db's current schema.
func checkSchema(ctx context.Context, db *sql.DB, schema string) error {
	var (
		exists  bool
		current sql.NullString
	)
	err := db.QueryRowContext(ctx,
		"SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1), current_schema()",
		schema).Scan(&exists, &current)
	if err != nil {
		return fmt.Errorf("pgidem: migrations: read current schema: %w", err)
	}
	if !exists {
		return fmt.Errorf("pgidem: migrations: schema %q does not exist, so pgidem is not installed there; Up (pgidem migrate up) creates it", schema)
	}
	if current.String != schema {
		return wrongSchemaError(schema, current)
	}
	return nil
}

// installedElsewhereSQL finds the first schema on the search_path, other than the current
// schema, that holds pgidem's version table ($1) when the current schema does not; it
// returns no row when there is none.
const installedElsewhereSQL = `
SELECT n.nspname, current_schema()
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = $1 AND c.relkind IN ('r', 'p')
  AND n.nspname = ANY (current_schemas(false))
  AND n.nspname IS DISTINCT FROM current_schema()
  AND NOT EXISTS (
	SELECT 1 FROM pg_catalog.pg_class c2 JOIN pg_catalog.pg_namespace n2 ON n2.oid = c2.relnamespace
	WHERE c2.relname = $1 AND n2.nspname = current_schema())
ORDER BY array_position(current_schemas(false), n.nspname)
LIMIT 1`

// checkNotInstalledElsewhere returns an error when pgidem's version table is not in db's
// current schema but is in another schema of its search_path (see [NewProvider]).
func checkNotInstalledElsewhere(ctx context.Context, db *sql.DB) error {
	var (
		schema  string
		current sql.NullString
	)
	err := db.QueryRowContext(ctx, installedElsewhereSQL, VersionTable).Scan(&schema, &current)
	if errors.Is(err, sql.ErrNoRows) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("pgidem: migrations: look for pgidem's version table on the search_path: %w", err)
	}
	return fmt.Errorf("pgidem: migrations: pgidem is installed in schema %q (table %s), which is on the search_path, but the connection's current schema is %q, where it is not: migrating would install pgidem a second time; point at the installation with Opts.Schema %q and migrations.OpenDB(connString, %q) (pgidem --schema %s)",
		schema, pgx.Identifier{schema, VersionTable}.Sanitize(), current.String, schema, schema, pgx.Identifier{schema}.Sanitize())
}

// managedSQL says whether the current schema holds pgidem_record and whether it holds
// [VersionTable] ($1).
const managedSQL = `
SELECT
	EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relname = 'pgidem_record' AND n.nspname = current_schema()),
	EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relname = $1 AND n.nspname = current_schema()),
	coalesce(current_schema(), '')`

// checkManagedHere returns an error matching [ErrManagedElsewhere] when the current schema
// holds pgidem_record but [VersionTable] records no applied migration there.
func checkManagedHere(ctx context.Context, db *sql.DB) error {
	// Both reads in one snapshot: a rollback of the first migration committing between
	// them (table dropped, version row deleted together) must not look like tables
	// without a history.
	tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return fmt.Errorf("pgidem: migrations: look for pgidem's tables: %w", err)
	}
	defer tx.Rollback() //nolint:errcheck // read-only
	var (
		hasRecord, hasVersions bool
		current                string
	)
	if err := tx.QueryRowContext(ctx, managedSQL, VersionTable).Scan(&hasRecord, &hasVersions, &current); err != nil {
		return fmt.Errorf("pgidem: migrations: look for pgidem's tables: %w", err)
	}
	if !hasRecord {
		return nil
	}
	if hasVersions {
		// Unqualified, the name resolves to the current schema: it is the first schema of
		// the search_path and holds the table.
		var applied bool
		if err := tx.QueryRowContext(ctx, "SELECT EXISTS (SELECT 1 FROM "+pgx.Identifier{VersionTable}.Sanitize()+" WHERE version_id > 0)").Scan(&applied); err != nil {
			return fmt.Errorf("pgidem: migrations: read %s: %w", VersionTable, err)
		}
		if applied {
			return nil
		}
	}
	return fmt.Errorf("%w: schema %q holds %s but %s records no pgidem migration, so another tool "+
		"(pgidem's files copied into your own migrations) created them; migrate them with that tool",
		ErrManagedElsewhere, current, pgx.Identifier{current, "pgidem_record"}.Sanitize(), VersionTable)
}

// createSchema creates schema if it does not exist and checks that it is db's current
// schema, in one transaction: when it is not, the transaction rolls back and nothing is
// created. To create the schema the transaction first takes [LockID] as a transaction
// lock, so concurrent callers create it one after the other. CREATE SCHEMA IF NOT EXISTS
// alone fails with a unique violation when two run at once, so a caller that met a
// session not taking the lock calls it again. The lock is released at commit, before the
// migration lock is taken. A transaction lock works through a transaction pooler. It
// waits for the lock at most as long as the migration lock ([LockRetryAttempts] × [LockRetryPeriodSeconds]), whatever
// the session's statement_timeout. An existing schema takes no lock.
func createSchema(ctx context.Context, db *sql.DB, schema string) (err error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("pgidem: migrations: create schema %q: begin: %w", schema, err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	// CREATE SCHEMA checks the CREATE privilege on the database even when the schema
	// exists. Look first, so a role without it can migrate an existing schema. An existing
	// schema needs no lock either, so a deploy that finds it waits only for the migration
	// lock.
	const existsSQL = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)"
	var exists bool
	if err := tx.QueryRowContext(ctx, existsSQL, schema).Scan(&exists); err != nil {
		return fmt.Errorf("pgidem: migrations: create schema %q: %w", schema, err)
	}
	if !exists {
		// Wait for the lock as long as goose does, whatever the session's
		// statement_timeout (which would cancel the wait).
		wait := fmt.Sprintf("SET LOCAL lock_timeout = '%ds'", LockRetryAttempts*LockRetryPeriodSeconds)
		for _, stmt := range []string{wait, "SET LOCAL statement_timeout = 0"} {
			if _, err := tx.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("pgidem: migrations: create schema %q: %w", schema, err)
			}
		}
		if _, err := tx.ExecContext(ctx, "SELECT pg_advisory_xact_lock($1)", LockID); err != nil {
			return fmt.Errorf("pgidem: migrations: create schema %q: lock: %w", schema, err)
		}
		if _, err := tx.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
			return fmt.Errorf("pgidem: migrations: create schema %q: %w", schema, err)
		}
	}
	var current sql.NullString
	if err := tx.QueryRowContext(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return fmt.Errorf("pgidem: migrations: read current schema: %w", err)
	}
	if current.String != schema {
		return wrongSchemaError(schema, current)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("pgidem: migrations: create schema %q: commit: %w", schema, err)
	}
	return nil
}

// Up applies every pending pgidem migration, holding the migration lock ([LockTable]) so
// concurrent callers (two deploys starting at once, through a transaction pooler too) all
// succeed and each migration is applied once. With
// [Opts.Schema] set it first creates that schema if it does not exist, under the same lock
// id; when the connection's current schema is not Opts.Schema it returns an error and
// creates nothing. It returns the errors of [NewProvider] too. It returns the migrations
// this call applied (none when the schema is current), also those applied before a
// failing one (goose's *goose.PartialError, which the error wraps). A run that waited for
// the lock until ctx ended, or about five minutes, returns an error matching
// [ErrLockHeld] and applies nothing. Cancelling ctx stops the wait or stops between
// statements; a migration interrupted mid-way is rolled back by its transaction.
// Safe for concurrent use, in one process or many: that is what the lock is for.
func Up(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationResult, error) {
	if db != nil && opts != nil && opts.Schema != "" {
		if err := checkSchemaName("Opts.Schema", opts.Schema); err != nil {
			return nil, err
		}
		err := createSchema(ctx, db, opts.Schema)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UniqueViolation {
			// A session that does not take LockID (River's migrator, an operator) created
			// the schema while this one waited to: it exists now.
			err = createSchema(ctx, db, opts.Schema)
		}
		if err != nil {
			return nil, err
		}
	}
	provider, err := newProvider(ctx, db, opts, nil)
	if err != nil {
		return nil, err
	}
	// Like goose's Up, look without the lock first: a deploy with nothing to apply does not
	// wait for one that migrates.
	if pending, err := provider.HasPending(ctx); err != nil || !pending {
		if err != nil {
			err = fmt.Errorf("pgidem: migrations: up: %w", err)
		}
		return nil, err
	}
	var results []*goose.MigrationResult
	err = locked(ctx, db, func(ctx context.Context) error {
		results, err = provider.Up(ctx)
		return err
	})
	if err != nil {
		if errors.Is(err, ErrLockHeld) {
			return nil, err
		}
		return completed(results, err), fmt.Errorf("pgidem: migrations: up: %w", err)
	}
	return results, nil
}

// Installed reports whether pgidem's version table ([VersionTable]) exists in db's current
// schema, where [Opts.Schema] (or the search_path) points: false means no pgidem migration
// was ever applied there. It creates nothing, takes no lock, and returns the errors of
// [NewProvider]. Cancelling ctx stops its queries. Safe for concurrent use.
func Installed(ctx context.Context, db *sql.DB, opts *Opts) (bool, error) {
	if _, err := newProvider(ctx, db, opts, nil); err != nil {
		return false, err
	}
	return installed(ctx, db)
}

// installed is [Installed] after NewProvider's checks.
func installed(ctx context.Context, db *sql.DB) (bool, error) {
	var exists bool
	err := db.QueryRowContext(ctx, `SELECT EXISTS (
		SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relname = $1 AND n.nspname = current_schema())`, VersionTable).Scan(&exists)
	if err != nil {
		return false, fmt.Errorf("pgidem: migrations: look for the version table: %w", err)
	}
	return exists, nil
}

// Down rolls back the most recently applied pgidem migration, like goose's Down and
// `pgidem migrate down`; the results hold it, or nothing when no migration is applied.
// Where pgidem was never installed ([Installed] is false) it does nothing and creates
// nothing. It holds the migration lock like [Up], and returns the errors of [NewProvider] (a missing
// Opts.Schema among them). A rollback removes what the migration created, rows included:
// rolling back the first migration deletes every record, unless [Opts.RefuseDataLoss].
// [Reset] rolls back all of them, [DownTo] those above a version. A database at a version
// newer than this build's latest migration (a newer release migrated it, and a deploy was
// rolled back) returns an error and rolls back nothing: this build does not have that
// migration's down part. Cancelling ctx stops the wait for the lock or the rollback (its
// transaction rolls back). Safe for concurrent use: concurrent rollbacks run one after the
// other.
func Down(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationResult, error) {
	return down(ctx, db, opts, 0, true)
}

// Reset rolls back every applied pgidem migration, removing all of pgidem's tables
// (records and their data included), like goose's reset and `pgidem migrate down --to 0`.
// It leaves the version table, holding only goose's initial version-0 row, and the
// schema. It is DownTo(ctx, db, opts, 0); see [DownTo].
func Reset(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationResult, error) {
	return DownTo(ctx, db, opts, 0)
}

// DownTo rolls back the applied pgidem migrations above version, most recently applied
// first, like goose's down-to and `pgidem migrate down --to VERSION`. Like goose, it stops
// at the first applied migration at or below version. It returns them, also those rolled
// back before a failing one, whose *goose.PartialError the error wraps. It returns none
// when the database is at version or below. A rollback removes what the migration created, rows
// included, unless [Opts.RefuseDataLoss]. Where pgidem was never installed ([Installed]
// is false) it does nothing and creates nothing. It holds the migration lock like [Up], returns the
// errors of [NewProvider] (a missing Opts.Schema among them) and, like [Down], refuses a
// database at a version newer than this build's latest migration. A negative version
// returns an error matching [ErrInvalidArgument]. Cancelling ctx and concurrent use are as for [Down].
func DownTo(ctx context.Context, db *sql.DB, opts *Opts, version int64) ([]*goose.MigrationResult, error) {
	if version < 0 {
		return nil, fmt.Errorf("%w: DownTo: version %d is negative", ErrInvalidArgument, version)
	}
	return down(ctx, db, opts, version, false)
}

// down rolls back, with goose, the applied migrations above target (only the most recently
// applied one when byOne). Under pgidem's migration lock, it first checks what goose will
// roll back: a version this build does not have is refused, and so, with
// [Opts.RefuseDataLoss], is a plan that drops a table holding rows. The check and the
// rollback hold the lock together, so a concurrent rollback cannot change what was
// checked.
func down(ctx context.Context, db *sql.DB, opts *Opts, target int64, byOne bool) ([]*goose.MigrationResult, error) {
	if opts == nil {
		opts = &Opts{}
	}
	provider, err := newProvider(ctx, db, opts, nil) // the checks; creates nothing
	if err != nil {
		return nil, err
	}
	if ok, err := installed(ctx, db); err != nil || !ok {
		return nil, err
	}
	sources := provider.ListSources()
	var (
		results []*goose.MigrationResult
		refused error
	)
	err = locked(ctx, db, func(ctx context.Context) error {
		if refused = checkDown(ctx, db, opts, sources[len(sources)-1].Version, target, byOne); refused != nil {
			return refused
		}
		if !byOne {
			results, err = provider.DownTo(ctx, target)
			return err
		}
		res, err := provider.Down(ctx)
		if res != nil {
			results = append(results, res)
		}
		if errors.Is(err, goose.ErrNoNextVersion) {
			return nil // nothing applied: nothing to roll back
		}
		return err
	})
	switch {
	case refused != nil, errors.Is(err, ErrLockHeld):
		return nil, err // refused before anything ran
	case err != nil:
		return completed(results, err), fmt.Errorf("pgidem: migrations: down: %w", err)
	}
	return results, nil
}

// checkDown checks, on a connection of db, the migrations goose is about to roll back
// (see [down]).
func checkDown(ctx context.Context, db *sql.DB, opts *Opts, latest, target int64, byOne bool) error {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("pgidem: migrations: down: %w", err)
	}
	defer conn.Close()
	plan, err := downPlan(ctx, conn, latest, target, byOne)
	if err != nil || !opts.RefuseDataLoss {
		return err
	}
	return refuseDataLoss(ctx, conn, plan)
}

// completed returns the migrations that ran before err: goose reports them in a
// *goose.PartialError rather than in its results.
func completed(results []*goose.MigrationResult, err error) []*goose.MigrationResult {
	var partial *goose.PartialError
	if len(results) == 0 && errors.As(err, &partial) {
		return partial.Applied
	}
	return results
}

// downPlan lists the migrations to roll back, as goose's down and down-to choose them from
// the version table (newest row first, stopping at the first at or below target). It
// refuses a plan holding a version above latest, which this build does not have.
func downPlan(ctx context.Context, conn *sql.Conn, latest, target int64, byOne bool) ([]int64, error) {
	rows, err := conn.QueryContext(ctx, "SELECT version_id FROM "+pgx.Identifier{VersionTable}.Sanitize()+" ORDER BY id DESC")
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: down: read %s: %w", VersionTable, err)
	}
	defer rows.Close()
	var plan []int64
	for rows.Next() {
		var version int64
		if err := rows.Scan(&version); err != nil {
			return nil, fmt.Errorf("pgidem: migrations: down: read %s: %w", VersionTable, err)
		}
		if version <= target || version == 0 {
			break
		}
		if version > latest {
			return nil, fmt.Errorf("pgidem: migrations: down: the database is at pgidem schema version %d, newer than "+
				"the latest migration this build has (%d): it was migrated by a newer pgidem release; roll back with that release",
				version, latest)
		}
		plan = append(plan, version)
		if byOne {
			break
		}
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("pgidem: migrations: down: read %s: %w", VersionTable, err)
	}
	return plan, nil
}

// createTable finds the tables a migration's up part creates (pgidem's migrations name
// them unqualified).
var createTable = regexp.MustCompile(`(?i)\bCREATE\s+(?:UNLOGGED\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?([a-z_][a-z0-9_]*)`)

// dataLossCountLimit bounds how many rows refuseDataLoss counts in one table.
const dataLossCountLimit = 1_000_000

// refuseDataLoss returns an error matching [ErrDataLoss] when rolling back the planned
// migrations would drop a table of the current schema that holds rows.
func refuseDataLoss(ctx context.Context, conn *sql.Conn, plan []int64) error {
	var current string
	if err := conn.QueryRowContext(ctx, "SELECT current_schema()").Scan(&current); err != nil {
		return fmt.Errorf("pgidem: migrations: down: read current schema: %w", err)
	}
	var losses []string
	for _, version := range plan {
		names, err := fs.Glob(FS(), fmt.Sprintf("%05d_*.sql", version))
		if err != nil || len(names) != 1 {
			return fmt.Errorf("pgidem: migrations: down: no migration file for version %d", version)
		}
		text, err := fs.ReadFile(FS(), names[0])
		if err != nil {
			return fmt.Errorf("pgidem: migrations: down: read %s: %w", names[0], err)
		}
		up, _, _ := strings.Cut(string(text), "-- +goose Down")
		for _, m := range createTable.FindAllStringSubmatch(up, -1) {
			// A version table with gaps may list a migration whose table is gone.
			table := pgx.Identifier{current, m[1]}.Sanitize()
			var exists bool
			if err := conn.QueryRowContext(ctx, "SELECT to_regclass($1) IS NOT NULL", table).Scan(&exists); err != nil {
				return fmt.Errorf("pgidem: migrations: down: look for %s: %w", table, err)
			}
			if !exists {
				continue
			}
			var rows int64
			err := conn.QueryRowContext(ctx, fmt.Sprintf("SELECT count(*) FROM (SELECT FROM %s LIMIT %d) t", table, dataLossCountLimit+1)).Scan(&rows)
			if err != nil {
				return fmt.Errorf("pgidem: migrations: down: count the rows of %s: %w", table, err)
			}
			switch {
			case rows > dataLossCountLimit:
				losses = append(losses, fmt.Sprintf("%s (over %d rows)", m[1], dataLossCountLimit))
			case rows == 1:
				losses = append(losses, fmt.Sprintf("%s (1 row)", m[1]))
			case rows > 0:
				losses = append(losses, fmt.Sprintf("%s (%d rows)", m[1], rows))
			}
		}
	}
	if len(losses) == 0 {
		return nil
	}
	return fmt.Errorf("%w: rolling back would drop %s; a dropped record lets its key run the effect again, "+
		"a dropped inbox row lets its message be handled again", ErrDataLoss, strings.Join(losses, " and "))
}

// Status reports every pgidem migration and whether it has been applied. Where pgidem was
// never installed ([Installed] is false) every migration is pending and nothing is
// created (goose's own Status would create the version table). It returns the errors of
// [NewProvider] (a missing Opts.Schema among them). It takes no lock: it reads the version
// table as it is, without waiting for a migration in progress ([Up] in another process).
// Cancelling ctx stops its queries. Safe for concurrent use.
//
// AppliedAt comes from goose's version table, a timestamp without time zone written with
// now() in the session time zone of the connection that applied the migration; it is read
// as UTC. Migrations applied through [OpenDB] or the pgidem command (both use UTC
// sessions) are therefore exact. One applied through a session with another TimeZone shows
// shifted by that zone's offset: the goose CLI, another tool, or a *sql.DB opened by the
// caller, on a server whose TimeZone is not UTC.
func Status(ctx context.Context, db *sql.DB, opts *Opts) ([]*goose.MigrationStatus, error) {
	provider, err := newProvider(ctx, db, opts, nil)
	if err != nil {
		return nil, err
	}
	ok, err := installed(ctx, db)
	if err != nil {
		return nil, err
	}
	if !ok {
		var status []*goose.MigrationStatus
		for _, src := range provider.ListSources() {
			status = append(status, &goose.MigrationStatus{Source: src, State: goose.StatePending})
		}
		return status, nil
	}
	status, err := provider.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgidem: migrations: status: %w", err)
	}
	return status, nil
}
