package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// SQLSTATE codes pgidem interprets (Postgres's errcodes appendix).
const (
	codeUndefinedTable             = "42P01"
	codeUndefinedColumn            = "42703"
	codeInvalidSchemaName          = "3F000"
	codeDuplicatePreparedStatement = "42P05"
	codeInvalidSQLStatementName    = "26000"
	codeLockNotAvailable           = "55P03"
	codeInFailedSQLTransaction     = "25P02"
	codeSerializationFailure       = "40001"
	// Classes: 22 data exception (a value the server refuses), 54 program limit exceeded
	// (54001 stack depth for jsonb nested too deep, 54000 a string over jsonb's limit),
	// 23 integrity constraint violation.
	classDataException = "22"
	classProgramLimit  = "54"
	classIntegrity     = "23"
)

var (
	// ErrUnavailable is matched by every [*Error]: the store could not be reached or a
	// statement failed.
	ErrUnavailable = errors.New("pgidem: store unavailable")

	// ErrNotMigrated is matched, besides [ErrUnavailable], by an [*Error] whose cause is
	// that pgidem's tables, columns or schema do not exist where the statement looked.
	ErrNotMigrated = errors.New("pgidem: schema not migrated")
)

// Error wraps a database error. It matches [ErrUnavailable] (and [ErrNotMigrated] when
// pgidem's tables are missing) and unwraps to the driver's error.
type Error struct {
	// Op is the protocol step that failed: "reserve" (which covers Do's first read of the
	// key), "takeover", "complete", "release", "lookup", "forget", "sweep"; "heartbeat"
	// for the renewal Do makes before fn starts when the reserving statement waited a
	// third of the lease or more; for DoTx and the inbox also "begin", "lock",
	// "savepoint", "commit", "inbox".
	Op string
	// Err is the underlying error.
	Err error
}

// Wrap wraps a database error as an [*Error] for op, leaving a cancellation alone so that
// callers can tell it from an unreachable store. A deadline is wrapped: a driver timeout
// (connect_timeout, a hung server) is a store failure.
func Wrap(op string, err error) error {
	if errors.Is(err, context.Canceled) {
		return err
	}
	return &Error{Op: op, Err: err}
}

// Error returns the message, prefixed "pgidem: ", with a hint when the cause is a
// known misconfiguration: missing migrations, or pgx's statement cache behind a
// transaction-pooling proxy.
func (e *Error) Error() string {
	switch {
	case e.notMigrated():
		return fmt.Sprintf("pgidem: store unavailable: %s: %v (have pgidem's migrations run on this database and schema? see package migrations or `pgidem migrate up`)", e.Op, e.Err)
	case IsPreparedStatementClash(e.Err):
		return fmt.Sprintf("pgidem: store unavailable: %s: %v (a transaction-pooling proxy such as PgBouncer between pgx and Postgres? "+
			"pgx's default query mode prepares statements per connection, which such a proxy mixes up: "+
			"set default_query_exec_mode=exec (or simple_protocol) in the connection string)", e.Op, e.Err)
	}
	return fmt.Sprintf("pgidem: store unavailable: %s: %v", e.Op, e.Err)
}

// Unwrap returns [ErrUnavailable], [ErrNotMigrated] when that is the cause, and the
// underlying error.
func (e *Error) Unwrap() []error {
	if e.notMigrated() {
		return []error{ErrUnavailable, ErrNotMigrated, e.Err}
	}
	return []error{ErrUnavailable, e.Err}
}

// notMigrated reports whether the error's cause is a missing table, column or schema of
// pgidem's.
func (e *Error) notMigrated() bool {
	code := Code(e.Err)
	return code == codeUndefinedTable || code == codeUndefinedColumn || code == codeInvalidSchemaName
}

// Code returns the SQLSTATE of the server error err carries, or "".
func Code(err error) string {
	if err == nil {
		return ""
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// IsPreparedStatementClash reports whether err says a prepared statement already exists
// (42P05) or does not exist (26000): what pgx's statement cache meets behind a proxy that
// hands each transaction another server connection.
func IsPreparedStatementClash(err error) bool {
	code := Code(err)
	return code == codeDuplicatePreparedStatement || code == codeInvalidSQLStatementName
}

// IsValueRefused reports whether err carries a server error of class 22 (data exception)
// or 54 (program limit exceeded): a value the server refuses, and will refuse again
// (jsonb rejecting a string or number, or JSON nested deeper than it parses).
func IsValueRefused(err error) bool {
	code := Code(err)
	return strings.HasPrefix(code, classDataException) || strings.HasPrefix(code, classProgramLimit)
}

// IsLockNotAvailable reports whether err is lock_not_available (55P03): a lock_timeout
// expired.
func IsLockNotAvailable(err error) bool { return Code(err) == codeLockNotAvailable }

// IsInFailedTransaction reports whether err is in_failed_sql_transaction (25P02): a
// statement sent in a transaction that an earlier failed statement aborted.
func IsInFailedTransaction(err error) bool { return Code(err) == codeInFailedSQLTransaction }

// IsIntegrityViolation reports whether err is of class 23 (integrity constraint
// violation): at a commit, a deferred constraint the transaction's writes broke.
func IsIntegrityViolation(err error) bool { return strings.HasPrefix(Code(err), classIntegrity) }

// IsSerializationFailure reports whether the server refused a statement because a row it
// needed changed after its snapshot (serialization_failure, 40001). pgidem's statements
// expect READ COMMITTED, Postgres's default, which re-checks such a row instead; a pool
// whose sessions default to REPEATABLE READ or SERIALIZABLE gets this error for ordinary
// contention on a key, and the caller reads the key again.
func IsSerializationFailure(err error) bool { return Code(err) == codeSerializationFailure }

// MayHaveApplied reports whether a write that failed with err may still have committed on
// the server, its reply lost. Nothing was applied when the connection could not be made,
// when pgconn says nothing was sent, or when the server answered with an ERROR (the
// statement, its own transaction, rolled back). A FATAL or PANIC ends the session, and a
// session can end after its commit.
func MayHaveApplied(err error) bool {
	if IsConnectError(err) || pgconn.SafeToRetry(err) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		severity := cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity)
		return severity == "FATAL" || severity == "PANIC"
	}
	return true
}

// IsConnectError reports whether err is a failure to reach the server at all (refused,
// timed out, network): nothing was sent to the store. A connection the server refused
// with an error of its own (authentication failed, database missing) is a
// misconfiguration, not an outage, and does not count.
func IsConnectError(err error) bool {
	var connectErr *pgconn.ConnectError
	var pgErr *pgconn.PgError
	return errors.As(err, &connectErr) && !errors.As(err, &pgErr)
}

// IsNoRows reports whether err is pgx.ErrNoRows.
func IsNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

// SQLSTATE codes of a server that is going away, not there yet, or not the primary.
const (
	codeAdminShutdown      = "57P01" // terminating connection due to administrator command
	codeCrashShutdown      = "57P02" // terminating connection due to a crash (or an immediate shutdown)
	codeCannotConnectNow   = "57P03" // the database system is starting up, shutting down or recovering
	codeTooManyConnections = "53300" // every client slot is taken, as when all clients reconnect at once
	codeReadOnlyTx         = "25006" // a standby: the primary is failing over
	classConnection        = "08"
)

// IsServerUnavailable reports whether err says the server was not there to answer: a
// connection that could not be made or broke (refused, reset, closed, cut off mid-reply),
// a session the server ended because it shut down or crashed (57P01, 57P02), a server
// starting up, shutting down or recovering (57P03), any other connection exception (class
// 08), no client slot left (53300), or a read-only server (25006, a standby while the
// primary fails over). Such failures last as long as a restart or a failover. A server's
// ERROR about the statement itself is not one (it would be refused again), nor is a
// deadline or a cancellation (a statement may be waiting on a lock).
func IsServerUnavailable(err error) bool {
	if err == nil || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return false
	}
	switch code := Code(err); {
	case code == codeAdminShutdown, code == codeCrashShutdown, code == codeCannotConnectNow,
		code == codeTooManyConnections, code == codeReadOnlyTx, strings.HasPrefix(code, classConnection):
		return true
	case code != "":
		return false
	}
	var netErr net.Error
	return IsConnectError(err) || (errors.As(err, &netErr) && !netErr.Timeout()) || errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) || errors.Is(err, pgconn.ErrConnClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}
