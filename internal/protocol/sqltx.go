package protocol

import (
	"context"
	"database/sql"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Tx is a caller's transaction as the transactional calls (DoTx, InboxRecordTx, Lookup in
// a transaction) use it: the statements they send and what fn receives. [PgxTx] and
// [SQLTx] make one.
type Tx interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	// sendBatch runs b's statements in order and returns their results.
	sendBatch(ctx context.Context, b *pgx.Batch) batchResults
	// fnTx returns what fn receives while sp is open.
	fnTx(sp *savepoint) any
}

// batchResults is what the engine reads of a batch's results (pgx.BatchResults has it).
type batchResults interface {
	Exec() (pgconn.CommandTag, error)
	QueryRow() pgx.Row
	Close() error
}

// rowQuerier is the one method lookups and single-row writes need: a pool, a connection and
// a Tx all have it.
type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// PgxTx returns tx as a [Tx]. fn receives a pgx.Tx whose Commit and Rollback end DoTx's
// savepoint, not tx.
func PgxTx(tx pgx.Tx) Tx { return pgxTx{tx} }

type pgxTx struct{ pgx.Tx }

func (t pgxTx) sendBatch(ctx context.Context, b *pgx.Batch) batchResults { return t.SendBatch(ctx, b) }

func (t pgxTx) fnTx(sp *savepoint) any { return &pgxSavepoint{Tx: t.Tx, sp: sp} }

// SQLTx returns a database/sql transaction on a Postgres driver (pgx's stdlib, lib/pq) as a
// [Tx]. fn receives tx itself. A batch runs one statement after another, in order, so a
// statement still sees what the earlier ones did. Errors are translated once, here, into
// what the engine interprets for pgx: sql.ErrNoRows matches pgx.ErrNoRows, sql.ErrTxDone
// matches pgx.ErrTxClosed, and a driver's server error that reports its SQLSTATE (lib/pq's
// *pq.Error) matches a *pgconn.PgError with that code; the driver's error stays in the chain.
func SQLTx(tx *sql.Tx) Tx { return sqlTx{tx} }

type sqlTx struct{ tx *sql.Tx }

func (t sqlTx) fnTx(*savepoint) any { return t.tx }

func (t sqlTx) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	_, err := t.tx.ExecContext(ctx, query, args...)
	return pgconn.CommandTag{}, sqlError(err)
}

func (t sqlTx) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	return sqlRow{t.tx.QueryRowContext(ctx, query, args...)}
}

func (t sqlTx) sendBatch(ctx context.Context, b *pgx.Batch) batchResults {
	return &sqlBatch{ctx: ctx, tx: t, queued: b.QueuedQueries}
}

// sqlRow is a *sql.Row whose Scan translates errors, and hands a driver's text ([]byte) to
// destinations that scan text only (pgtype.UUID).
type sqlRow struct{ row *sql.Row }

func (r sqlRow) Scan(dest ...any) error {
	targets := make([]any, len(dest))
	for i, d := range dest {
		targets[i] = d
		if s, ok := d.(sql.Scanner); ok {
			targets[i] = textScanner{s}
		}
	}
	return sqlError(r.row.Scan(targets...))
}

type textScanner struct{ sql.Scanner }

func (s textScanner) Scan(src any) error {
	if b, ok := src.([]byte); ok {
		src = string(b)
	}
	return s.Scanner.Scan(src)
}

// sqlBatch runs a batch's statements one by one as they are read. After a failed statement
// the rest are not run: they fail with that error, as in a pgx pipeline.
type sqlBatch struct {
	ctx    context.Context
	tx     sqlTx
	queued []*pgx.QueuedQuery
	next   int
	err    error
}

func (b *sqlBatch) take() (*pgx.QueuedQuery, error) {
	if b.err != nil {
		return nil, b.err
	}
	if b.next >= len(b.queued) {
		return nil, errors.New("pgidem: no more results in the batch")
	}
	q := b.queued[b.next]
	b.next++
	return q, nil
}

func (b *sqlBatch) Exec() (pgconn.CommandTag, error) {
	q, err := b.take()
	if err == nil {
		_, err = b.tx.Exec(b.ctx, q.SQL, q.Arguments...)
	}
	b.err = err
	return pgconn.CommandTag{}, err
}

func (b *sqlBatch) QueryRow() pgx.Row { return batchRow{b} }

func (b *sqlBatch) Close() error { return b.err }

type batchRow struct{ b *sqlBatch }

func (r batchRow) Scan(dest ...any) error {
	q, err := r.b.take()
	if err == nil {
		err = r.b.tx.QueryRow(r.b.ctx, q.SQL, q.Arguments...).Scan(dest...)
	}
	if !errors.Is(err, pgx.ErrNoRows) { // no row is a result, not a failed statement
		r.b.err = err
	}
	return err
}

// sqlError translates a database/sql error (see [SQLTx]).
func sqlError(err error) error {
	var pgErr *pgconn.PgError
	var coded interface{ SQLState() string }
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sql.ErrNoRows):
		return &translatedError{as: pgx.ErrNoRows, err: err}
	case errors.Is(err, sql.ErrTxDone):
		return &translatedError{as: pgx.ErrTxClosed, err: err}
	case errors.As(err, &pgErr):
		return err
	case errors.As(err, &coded):
		return &translatedError{as: &pgconn.PgError{Severity: "ERROR", Code: coded.SQLState(), Message: err.Error()}, err: err}
	}
	return err
}

// translatedError is a driver's error err that also matches as.
type translatedError struct{ as, err error }

func (e *translatedError) Error() string   { return e.err.Error() }
func (e *translatedError) Unwrap() []error { return []error{e.err, e.as} }
