// Package store holds every SQL statement pgidem sends, for the library and the pgidem
// command alike, with the row types they read and the rules for interpreting their errors.
//
// Statements are built once per schema ([New]) with every identifier quoted through
// pgx.Identifier; no caller string is spliced into SQL. Every verdict about time (a lease
// or TTL that ran out) is taken by the database clock: statement_timestamp() where a
// statement may run inside a caller's transaction and in every statement operators'
// tools send (reads, listings, statistics, forget, sweep); now() in the protocol's
// writes, which are transactions of their own (the two agree there).
package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Executor is the smallest interface the statements need; a pool, a connection and a
// transaction all satisfy it.
type Executor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// RowQuerier is what a single-row read needs: an Executor, or a database/sql
// transaction adapted to it.
type RowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

var (
	_ Executor = (*pgxpool.Pool)(nil)
	_ Executor = (*pgxpool.Conn)(nil)
	_ Executor = (*pgx.Conn)(nil)
	_ Executor = (pgx.Tx)(nil)
)

// Statements holds every statement for one schema.
type Statements struct {
	recordStatements
	txStatements
	inboxStatements
	sweepStatements
	listStatements
	statsStatements
}

// New returns the statements for pgidem's tables in schema ("": resolved through the
// connection's search_path).
func New(schema string) *Statements {
	return &Statements{
		recordStatements: newRecordStatements(schema),
		txStatements:     newTxStatements(schema),
		inboxStatements:  newInboxStatements(schema),
		sweepStatements:  newSweepStatements(schema),
		listStatements:   newListStatements(schema),
		statsStatements:  newStatsStatements(schema),
	}
}

// Qualify returns the quoted, optionally schema-qualified name of a pgidem table.
func Qualify(schema, table string) string {
	if schema == "" {
		return pgx.Identifier{table}.Sanitize()
	}
	return pgx.Identifier{schema, table}.Sanitize()
}

// Micros returns d in whole microseconds, the unit durations are sent in.
func Micros(d time.Duration) int64 { return d.Microseconds() }

// JSONText returns a JSON value as the text parameter its statement casts to jsonb (nil:
// NULL). JSON travels as text because pgx's modes that type a parameter by its Go type
// (QueryExecModeExec, the simple protocol) would send a []byte as bytea, which jsonb
// does not read.
func JSONText(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}
