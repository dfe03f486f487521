package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	pgstore "github.com/pgidem/pgidem/internal/store"
)

// recordTable is the name of pgidem's record table (migrations/sql/00001).
const recordTable = "pgidem_record"

// inboxTable is the name of pgidem's inbox table (migrations/sql/00002).
const inboxTable = "pgidem_inbox"

// store runs the CLI's reads and deletes through the statements of internal/store, and
// turns their errors into actionable messages.
type store struct {
	pool   *pgxpool.Pool
	schema string
	sql    *pgstore.Statements
	// display is the record table's name for people: schema.pgidem_record.
	display string
	// inboxDisplay is the same for the inbox table.
	inboxDisplay string
}

func newStore(pool *pgxpool.Pool, schema string) *store {
	name := func(table string) string {
		if schema == "" {
			return table
		}
		return schema + "." + table
	}
	return &store{pool: pool, schema: schema, sql: pgstore.New(schema), display: name(recordTable), inboxDisplay: name(inboxTable)}
}

// withStore connects and runs fn with a store.
func (a *app) withStore(ctx context.Context, fn func(*store) error) error {
	pool, err := a.connectPool(ctx)
	if err != nil {
		return err
	}
	defer closePool(ctx, pool)
	return fn(newStore(pool, a.schema))
}

// withStoreDeleting is [app.withStore] for a command that deletes: interrupted while
// connecting, it adds that nothing was deleted.
func (a *app) withStoreDeleting(ctx context.Context, fn func(*store) error) error {
	connected := false
	err := a.withStore(ctx, func(s *store) error {
		connected = true
		return fn(s)
	})
	var ie *interruptedError
	if !connected && errors.As(err, &ie) {
		return interruptedf("%s; nothing was deleted", ie.msg)
	}
	return err
}

// translate turns a database error into an actionable message; an error after an
// interrupt says "interrupted".
func (s *store) translate(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return interruptedf("pgidem: %s: interrupted", op)
	}
	if missing := s.missingTable(ctx, op, err); missing != nil {
		return missing
	}
	return fmt.Errorf("pgidem: %s: %w", op, err)
}

// missingTable returns an actionable error when err says a table does not exist, and nil
// otherwise. Postgres does not name the missing relation in a field of the error, so it
// asks which of pgidem's tables is missing; if neither is (or it cannot tell), it quotes
// the server's message.
func (s *store) missingTable(ctx context.Context, op string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != pgerrcode.UndefinedTable && pgErr.Code != pgerrcode.InvalidSchemaName) {
		return nil
	}
	// A mistyped --schema (IDEM for idem): the schema is missing, not a table.
	if missing := s.missingSchema(ctx, op); missing != nil {
		return missing
	}
	where := "the connection's search_path"
	if s.schema != "" {
		where = fmt.Sprintf("schema %q", s.schema)
	}
	what := pgErr.Message
	var elsewhere []string
	if record, inbox, err := s.tablesExist(ctx); err == nil {
		switch {
		case !record:
			what = "table " + recordTable + " not found"
			if s.schema == "" { // with --schema, the operator chose where to look
				elsewhere, _ = otherInstalls(ctx, s.pool)
			}
		case !inbox:
			what = "table " + inboxTable + " not found"
		}
	}
	msg := fmt.Sprintf("pgidem: %s: %s in %s of %s", op, what, where, s.database())
	if len(elsewhere) > 0 {
		return fmt.Errorf("%s; pgidem is installed in %s of this database: pass --schema to point at it", msg, schemaList(elsewhere))
	}
	return fmt.Errorf("%s; if that is not the database you meant, pass --database-url (or --schema); if it is, run 'pgidem migrate up' (or, where your own migration tool applies pgidem's files, apply the missing ones with it)", msg)
}

// otherInstalls returns the schemas, other than the connection's current one, where pgidem
// is installed. Its callers ask only without --schema: with it, the operator chose.
func otherInstalls(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	return pgstore.OtherInstalls(ctx, pool)
}

// schemaList names schemas for a message: schema "a", or schemas "a" and "b".
func schemaList(schemas []string) string {
	quoted := make([]string, len(schemas))
	for i, s := range schemas {
		quoted[i] = strconv.Quote(s)
	}
	if len(quoted) == 1 {
		return "schema " + quoted[0]
	}
	return "schemas " + strings.Join(quoted[:len(quoted)-1], ", ") + " and " + quoted[len(quoted)-1]
}

// database describes the database the store is connected to, for messages.
func (s *store) database() string { return describeDatabase(&s.pool.Config().ConnConfig.Config) }

// describeDatabase names the database cc connects to, its user and its first address.
func describeDatabase(cc *pgconn.Config) string {
	// An empty database name in the configuration means the server's default, the user
	// name (libpq's rule); name it.
	return fmt.Sprintf("database %q (user %q on %s)", cmp.Or(cc.Database, cc.User), cc.User, hostPort(cc.Host, cc.Port))
}

// missingSchema returns an actionable error when --schema names a schema that does not
// exist (schema names are case-sensitive: IDEM is not idem). The error names the schemas
// where pgidem is installed. It returns nil when the schema exists, when no --schema was
// given, or when it cannot tell.
func (s *store) missingSchema(ctx context.Context, op string) error {
	if s.schema == "" {
		return nil
	}
	if exists, err := s.schemaExists(ctx); err != nil || exists {
		return nil
	}
	msg := fmt.Sprintf("pgidem: %s: schema %q does not exist in %s, so pgidem is not installed there (schema names are case-sensitive)",
		op, s.schema, s.database())
	// The search_path names only the missing schema, so current_schema() is null and
	// every installation is listed.
	if elsewhere, _ := otherInstalls(ctx, s.pool); len(elsewhere) > 0 {
		return fmt.Errorf("%s; pgidem is installed in %s of this database: pass --schema to point at it", msg, schemaList(elsewhere))
	}
	return fmt.Errorf("%s; if that is not the database you meant, pass --database-url; if it is, check the name, or run 'pgidem migrate up' with it (which creates the schema)", msg)
}

// schemaExists reports whether --schema names an existing schema (compared exactly, as
// Postgres compares quoted identifiers).
func (s *store) schemaExists(ctx context.Context) (bool, error) {
	return pgstore.SchemaExists(ctx, s.pool, s.schema)
}

// tablesExist reports whether the record table and the inbox table exist.
func (s *store) tablesExist(ctx context.Context) (record, inbox bool, err error) {
	return s.sql.TablesExist(ctx, s.pool)
}

// qualifiedInbox names the inbox table with its schema, for messages: --schema's, else the
// connection's current schema (the bare name when that cannot be read).
func (s *store) qualifiedInbox(ctx context.Context) string {
	if s.schema != "" {
		return s.inboxDisplay
	}
	current, ok, err := pgstore.CurrentSchema(ctx, s.pool.QueryRow)
	if err != nil || !ok {
		return inboxTable
	}
	return current + "." + inboxTable
}

// inboxMissing reports whether err says a table is missing because the database has the
// record table but no inbox table.
func (s *store) inboxMissing(ctx context.Context, err error) (bool, error) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != pgerrcode.UndefinedTable {
		return false, nil
	}
	record, inbox, err := s.tablesExist(ctx)
	return record && !inbox, err
}

// acquireToDelete takes a connection from the pool for a delete (op). It fails before the
// delete is sent, so an interrupt here (a bare context.Canceled from the pool, which
// [interruptedDelete] could not tell from a statement the server did not answer) is
// reported as having deleted nothing.
func (s *store) acquireToDelete(ctx context.Context, op string) (*pgxpool.Conn, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, interruptedf("pgidem: %s: interrupted; nothing was deleted", op)
		}
		return nil, s.translate(ctx, op, err)
	}
	return conn, nil
}

// interruptedDelete returns the error of a delete (op, one statement) that failed after an
// interrupt, saying what is known of it, or nil when ctx has not ended. The CLI's
// connections ask the server to cancel the statement and wait for its answer (see
// interruptGrace). A cancelled statement, like one never sent, deleted nothing. Without an
// answer the outcome is unknown, and check says how to find it out. pgconn reports a
// statement the server did not answer in time as a bare context.Canceled, as the pool
// reports an interrupted Acquire: the delete's connection is therefore acquired apart
// ([store.acquireToDelete]), so that err comes from the statement.
func interruptedDelete(ctx context.Context, op string, err error, check string) error {
	if ctx.Err() == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if pgconn.SafeToRetry(err) || (errors.As(err, &pgErr) && pgErr.Code == pgerrcode.QueryCanceled) {
		return interruptedf("pgidem: %s: interrupted; nothing was deleted", op)
	}
	return interruptedf("pgidem: %s: interrupted before the server answered, so the delete may or may not have been applied "+
		"(it is one statement, which commits on its own once it has run); check with: %s", op, check)
}
