package protocol

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// savepointName names the savepoints DoTx opens in the caller's transaction. Nested DoTx
// calls (fn calling DoTx with its tx) reuse it: Postgres lets a newer savepoint shadow an
// older one of the same name and releases and rolls back to the newest.
const savepointName = "pgidem_dotx"

// savepoint is a savepoint DoTx opens in the caller's transaction. Unlike pgx's nested
// transaction, rolling it back also releases it: ROLLBACK TO SAVEPOINT alone keeps the
// savepoint and its subtransaction open, so a caller looping over DoTx calls that fail
// would nest one more subtransaction per call, and past 64 of them Postgres's per-backend
// cache of subtransactions overflows, which slows every snapshot in the cluster while the
// transaction stays open. Statements on it run in the caller's tx; fn receives what
// tx.fnTx makes of it (for a pgx.Tx, a pgx.Tx whose Commit and Rollback end the savepoint
// and whose Begin makes a pgx savepoint inside this one).
//
// It counts as closed only once its release succeeded: a Commit or Rollback that failed (a
// cancelled ctx refuses the statement and keeps the connection) can be rolled back again on
// a detached context, so fn's writes never stay behind in an open savepoint.
type savepoint struct {
	Tx
	closed bool
}

func beginSavepoint(ctx context.Context, tx Tx) (*savepoint, error) {
	if _, err := tx.Exec(ctx, "SAVEPOINT "+savepointName); err != nil {
		return nil, err
	}
	return &savepoint{Tx: tx}, nil
}

// Commit releases the savepoint; its writes become the enclosing transaction's.
func (s *savepoint) Commit(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.Tx.Exec(ctx, "RELEASE SAVEPOINT "+savepointName)
	s.closed = err == nil
	return err
}

// Rollback undoes the savepoint's writes and releases it.
func (s *savepoint) Rollback(ctx context.Context) error {
	if s.closed {
		return pgx.ErrTxClosed
	}
	if _, err := s.Tx.Exec(ctx, "ROLLBACK TO SAVEPOINT "+savepointName); err != nil {
		return err
	}
	_, err := s.Tx.Exec(ctx, "RELEASE SAVEPOINT "+savepointName)
	s.closed = err == nil
	return err
}

// pgxSavepoint is the pgx.Tx a pgx caller's fn receives: the caller's tx, with Commit and
// Rollback ending the savepoint instead.
type pgxSavepoint struct {
	pgx.Tx
	sp *savepoint
}

// Commit releases the savepoint.
func (p *pgxSavepoint) Commit(ctx context.Context) error { return p.sp.Commit(ctx) }

// Rollback undoes the savepoint's writes and releases it.
func (p *pgxSavepoint) Rollback(ctx context.Context) error { return p.sp.Rollback(ctx) }

// rollbacker is a transaction or a savepoint.
type rollbacker interface {
	Rollback(ctx context.Context) error
}

// rollbackDetached rolls tx (a transaction or a savepoint) back on a context detached from
// ctx, so a cancelled caller still releases what it holds.
func (c *Engine) rollbackDetached(ctx context.Context, tx rollbacker) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
	defer cancel()
	_ = tx.Rollback(ctx) // the error, if any, is already the caller's; the conn is closed on failure
}
