package store

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
)

// QueryRowFunc runs a statement that returns one row: Executor.QueryRow, or database/sql's
// QueryRowContext (whose *sql.Row is a pgx.Row) wrapped.
type QueryRowFunc func(ctx context.Context, sql string, args ...any) pgx.Row

// OtherInstalls returns, in name order, the schemas other than the connection's current
// one (current_schema()) that hold pgidem's record table, whether or not they are on the
// search_path. It returns the driver's error.
func OtherInstalls(ctx context.Context, db Executor) ([]string, error) {
	var schemas []string
	err := db.QueryRow(ctx, otherInstallsSQL).Scan(&schemas)
	return schemas, err
}

// SchemaExists reports whether schema names an existing schema, compared exactly (as
// Postgres compares quoted identifiers: IDEM is not idem). It returns the driver's error.
func SchemaExists(ctx context.Context, db Executor, schema string) (bool, error) {
	var exists bool
	err := db.QueryRow(ctx, schemaExistsSQL, schema).Scan(&exists)
	return exists, err
}

// CurrentSchema returns the connection's current schema, the first existing schema of
// its search_path; ok is false when none exists. It returns the driver's error.
func CurrentSchema(ctx context.Context, queryRow QueryRowFunc) (schema string, ok bool, err error) {
	var current *string
	if err := queryRow(ctx, currentSchemaSQL).Scan(&current); err != nil || current == nil {
		return "", false, err
	}
	return *current, true, nil
}

// MigrationLockHolder returns the backend pid of a session of the connection's database
// holding the session-level advisory lock lockID; held is false when none does. It
// returns the driver's error.
func MigrationLockHolder(ctx context.Context, queryRow QueryRowFunc, lockID int64) (pid int, held bool, err error) {
	err = queryRow(ctx, migrationLockHolderSQL, lockID).Scan(&pid)
	if IsNoRows(err) || errors.Is(err, sql.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, err
	}
	return pid, true, nil
}

// TablesExist reports whether the schema's record table and inbox table exist. It
// returns the driver's error.
func (s *Statements) TablesExist(ctx context.Context, db Executor) (record, inbox bool, err error) {
	err = db.QueryRow(ctx, tablesExistSQL, s.recordTable, s.inboxTable).Scan(&record, &inbox)
	return record, inbox, err
}

// RecordTableSize returns the total size of the record table, with its indexes and
// TOAST, in bytes and for people ("16 kB"). It returns the driver's error.
func (s *Statements) RecordTableSize(ctx context.Context, db Executor) (bytes int64, pretty string, err error) {
	err = db.QueryRow(ctx, tableSizeSQL, s.recordTable).Scan(&bytes, &pretty)
	return bytes, pretty, err
}

// InboxTableSize is [Statements.RecordTableSize] for the inbox table.
func (s *Statements) InboxTableSize(ctx context.Context, db Executor) (bytes int64, pretty string, err error) {
	err = db.QueryRow(ctx, tableSizeSQL, s.inboxTable).Scan(&bytes, &pretty)
	return bytes, pretty, err
}
