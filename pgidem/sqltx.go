package pgidem

import (
	"context"
	"database/sql"
	"time"

	"github.com/pgidem/pgidem/internal/protocol"
)

// The SQLTx forms ([DoSQLTx], [DoSQLTxResult], [Coordinator.InboxRecordSQLTx],
// [Coordinator.LookupSQLTx]) are the Tx forms for a database/sql transaction, as sqlc's
// default target, bun, GORM (through its *sql.Tx), ent and lib/pq users hold one. The
// transaction must be on a Postgres driver — pgx's stdlib (github.com/jackc/pgx/v5/stdlib)
// or github.com/lib/pq — and on the coordinator's database. The protocol, its guarantees,
// errors and events are those of the pgx forms, through one implementation: the same
// advisory lock, savepoint, record and replay, so a pgx caller and a database/sql caller
// share keys. What differs:
//   - fn receives the caller's *sql.Tx itself, not a savepoint object. fn's statements run
//     inside DoTx's savepoint all the same. A fn that calls tx.Commit or tx.Rollback ends
//     the whole transaction. DoSQLTx then returns an error matching [ErrInvalidArgument],
//     as the pgx form does for a fn that ends its savepoint.
//   - DoTx's pipelined lock and read run as separate statements: one more round trip.
//   - A driver's server error is kept in a [*StoreError]'s chain as the driver returned
//     it; its SQLSTATE also matches a *pgconn.PgError (errors.As) with that code.
//   - database/sql rolls the transaction back when the context given to BeginTx ends.

// DoSQLTx is [DoTx] in a database/sql transaction: it is [DoSQLTxResult] without the
// detail.
func DoSQLTx[T any](ctx context.Context, c *Coordinator, tx *sql.Tx, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx *sql.Tx) (T, error)) (T, error) {
	res, err := DoSQLTxResult(ctx, c, tx, namespace, key, ttl, opts, fn)
	return res.Value, err
}

// DoSQLTxResult is [DoTxResult] in the caller's database/sql transaction tx: fn runs in a
// savepoint of tx and receives tx; its writes and the key's record commit together with
// the caller's commit, and a rollback leaves neither. Keys, options, the advisory-lock
// wait, replay, [Permanent] failures (stored in tx: commit it to keep them), errors and
// cancellation are DoTxResult's; the SQLTx forms' differences are listed above. A nil
// coordinator, tx or fn returns an error matching [ErrInvalidArgument]. Safe for
// concurrent use on different transactions; a *sql.Tx must not run DoSQLTx concurrently
// with its other statements.
func DoSQLTxResult[T any](ctx context.Context, c *Coordinator, tx *sql.Tx, namespace, key string, ttl time.Duration, opts *DoOpts, fn func(ctx context.Context, tx *sql.Tx) (T, error)) (Result[T], error) {
	if c == nil || tx == nil || fn == nil {
		return Result[T]{}, invalidArgument("DoSQLTx: the coordinator, tx and fn must not be nil")
	}
	cl, err := c.engine.Prepare(ctx, "DoSQLTx", namespace, key, ttl, opts.engineOpts())
	if err != nil {
		return Result[T]{Outcome: OutcomeInvalid}, err
	}
	ctx, o := c.observe(ctx, OpDoSQLTx, namespace, key)
	defer o.closePanicked()
	var value T
	rep, err := c.engine.DoTx(ctx, protocol.SQLTx(tx), cl, o.txFn(txFunc(fn, &value)), func() ([]byte, error) { return encodeValue(value, c.config.MaxValueBytes) })
	res, err := txResult(namespace, key, rep, value, err)
	return observedResult(o, res, err)
}

// InboxRecordSQLTx is [Coordinator.InboxRecordTx] in the caller's database/sql
// transaction tx: it records message messageID of consumer in tx and reports whether it
// is new, with InboxRecordTx's validation, concurrency and errors. A nil tx returns an
// error matching [ErrInvalidArgument]. Safe for concurrent use on different transactions.
func (c *Coordinator) InboxRecordSQLTx(ctx context.Context, tx *sql.Tx, consumer, messageID string, opts *InboxOpts) (bool, error) {
	var etx protocol.Tx
	if tx != nil {
		etx = protocol.SQLTx(tx)
	}
	ctx, o := c.observe(ctx, OpInboxRecordSQLTx, consumer, messageID)
	isNew, err := c.engine.InboxRecordTx(ctx, etx, consumer, messageID, opts.engineOpts())
	o.inboxDone(isNew, err)
	return isNew, err
}

// LookupSQLTx is [Coordinator.Lookup] inside the caller's database/sql transaction, with
// Lookup's errors; a nil tx returns an error matching [ErrInvalidArgument]. Like any
// statement on a *sql.Tx, not concurrently with other uses of tx.
func (c *Coordinator) LookupSQLTx(ctx context.Context, tx *sql.Tx, namespace, key string) (*Record, error) {
	if tx == nil {
		return nil, invalidArgument("LookupSQLTx: tx is nil")
	}
	return c.engine.Lookup(ctx, protocol.SQLTx(tx), namespace, key)
}
