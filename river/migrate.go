package pgidemriver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// MigrateLockID is the Postgres session advisory lock [MigrateRiver] holds while River's
// migrations run. It differs from pgidem's own migration lock (package migrations,
// LockID). The value is the ASCII bytes of "pgidemrv". It is one lock per database, not
// per schema: MigrateRiver calls for different [MigrateOpts.Schema] values in the same
// database run one after another.
const MigrateLockID int64 = 0x70676964656d7276

// MigrateOpts are optional settings for [MigrateRiver]; nil means defaults.
type MigrateOpts struct {
	// Schema is the schema of River's tables (river.Config.Schema), created if missing. It
	// must be valid UTF-8 without control characters, at most 63 bytes and not only white
	// space (pgidem's rules for a schema name), or MigrateRiver returns an error matching
	// pgidem.ErrInvalidArgument. Default "": the connection's search_path. Migrations of every schema share
	// [MigrateLockID], so they run one at a time per database.
	Schema string
	// TargetVersion migrates up to this River migration version. Default 0: the latest.
	TargetVersion int
	// Logger receives rivermigrate's progress. Default: discard.
	Logger *slog.Logger
}

// schemaMaxBytes is Postgres's identifier limit (NAMEDATALEN - 1).
const schemaMaxBytes = 63

// MigrateRiver applies River's pending migrations (rivermigrate, the "main" line) through
// pool. It holds the session advisory lock [MigrateLockID] on a connection of its own for
// the whole run. So concurrent callers (several deploys or replicas starting at once) all
// succeed: one migrates, the others wait and then find nothing to do. A missing
// Opts.Schema is created first, under the lock, as pgidem's migrations.Up does; River's own
// migrator would fail on it.
//
// It returns the versions this call applied (none when River's schema is current). On
// failure it returns an error prefixed "pgidemriver: MigrateRiver: " wrapping
// rivermigrate's or the driver's. That is a context error when ctx ended, and an error
// matching [pgidem.ErrInvalidArgument] for a nil pool or an invalid [MigrateOpts.Schema].
//
// Cancelling ctx stops the wait for a connection or for the lock, or the migration in
// progress (each River migration runs in its own transaction). Safe for concurrent use:
// concurrent calls, in one process or many, are the case the lock exists for.
//
// River's migrator takes no lock itself. Two unguarded runs race, and one fails with a
// unique violation on river_migration or an "already exists" error (River v0.51). The lock
// serialises every MigrateRiver call on the database, whatever its Schema: a migration of
// one schema waits for a migration of another. It does not guard against River's own CLI
// or rivermigrate used directly, which take no lock.
//
// The lock connection is acquired from pool, so the pool's BeforeConnect, AfterConnect and
// PrepareConn hooks apply to it. It is then taken out of the pool (pgxpool.Conn.Hijack)
// and closed when MigrateRiver returns. The migrations themselves run on other pool
// connections, so a pool of any size works, including MaxConns 1. Acquiring waits when
// every pool connection is in use.
func MigrateRiver(ctx context.Context, pool *pgxpool.Pool, opts *MigrateOpts) (*rivermigrate.MigrateResult, error) {
	if pool == nil {
		return nil, invalid("MigrateRiver: pool must not be nil")
	}
	if opts == nil {
		opts = &MigrateOpts{}
	}
	if s := opts.Schema; len(s) > schemaMaxBytes || (s != "" && strings.TrimSpace(s) == "") ||
		!utf8.ValidString(s) || strings.IndexFunc(s, unicode.IsControl) >= 0 {
		// Postgres would truncate a longer name, so the schema would never be found again;
		// the other rules are pgidem's for every schema name (migrations.CheckSchemaName).
		return nil, invalid("MigrateRiver: Opts.Schema %q must be valid UTF-8 without control characters, "+
			"at most %d bytes and not only white space", s, schemaMaxBytes)
	}
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Schema: opts.Schema, Logger: logger})
	if err != nil {
		return nil, fmt.Errorf("pgidemriver: MigrateRiver: %w", err)
	}

	pooled, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgidemriver: MigrateRiver: acquire a connection for the lock: %w", err)
	}
	// Out of the pool: the pool may open another connection for the migrator (a pool of one
	// works), and the session never returns to the pool holding the lock.
	lockConn := pooled.Hijack()
	// Closing the session releases the lock even when the unlock below cannot run.
	defer lockConn.Close(context.WithoutCancel(ctx))
	if _, err := lockConn.Exec(ctx, "SELECT pg_advisory_lock($1)", MigrateLockID); err != nil {
		return nil, fmt.Errorf("pgidemriver: MigrateRiver: take lock %d: %w", MigrateLockID, err)
	}
	defer lockConn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", MigrateLockID) //nolint:errcheck // the close releases it anyway

	if opts.Schema != "" {
		// Look first: CREATE SCHEMA checks the CREATE privilege on the database even when
		// the schema exists. Under the lock, concurrent callers create it one at a time.
		var exists bool
		if err := lockConn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", opts.Schema).Scan(&exists); err != nil {
			return nil, fmt.Errorf("pgidemriver: MigrateRiver: look for schema %q: %w", opts.Schema, err)
		}
		if !exists {
			// Another tool (pgidem's migrations.Up, under a lock of its own) may be creating
			// it at this moment: IF NOT EXISTS then fails with a unique violation.
			_, err := lockConn.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{opts.Schema}.Sanitize())
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UniqueViolation {
				err = nil
			}
			if err != nil {
				return nil, fmt.Errorf("pgidemriver: MigrateRiver: create schema %q: %w", opts.Schema, err)
			}
		}
	}

	res, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, &rivermigrate.MigrateOpts{TargetVersion: opts.TargetVersion})
	if err != nil {
		return res, fmt.Errorf("pgidemriver: MigrateRiver: %w", err)
	}
	return res, nil
}
