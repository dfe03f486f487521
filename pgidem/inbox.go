package pgidem

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/protocol"
)

// InboxRetentionDefault is the default [InboxOpts.Retention]: seven days.
const InboxRetentionDefault = protocol.InboxRetentionDefault

// InboxOpts are optional settings for [Coordinator.InboxRecordTx] and
// [Coordinator.InboxHandle]. A nil *InboxOpts means all defaults.
type InboxOpts struct {
	// Retention is how long the message stays recorded, counted from the statement that
	// recorded it (not from the commit, so a handler that runs longer than Retention
	// commits a row that has already expired). A redelivery within it is skipped; after it the row counts as absent
	// (whether or not [Coordinator.Sweep] has deleted it) and the message would be handled
	// again. Make it outlive the broker's retention and its longest redelivery horizon. At
	// least [Config.MinTTL], otherwise [*InvalidTTLError]. Default [InboxRetentionDefault]
	// (7 days).
	Retention time.Duration

	// Payload is stored in the row's payload column (jsonb) for inspection with SQL; it is
	// never read back by pgidem. It must be JSON that jsonb accepts, which is stricter than
	// [encoding/json.Valid]: valid UTF-8 throughout, no \u0000 escape, no unpaired UTF-16
	// surrogate escape (\ud800 alone), numbers within Postgres's numeric range (at
	// most 131072 digits before the decimal point and 16383 after it, exponent included),
	// and nesting at most 10000 levels deep (encoding/json's limit, which pgidem's check
	// uses); and it must be at most [Config.MaxValueBytes] bytes (16 MiB by default). The
	// database must use the UTF8 encoding (as pgidem needs for keys and results too):
	// in another, a character it cannot represent fails the statement as a *StoreError.
	// A payload that breaks a rule returns an error matching [ErrInvalidPayload] before the
	// transaction is touched, so it stays usable and the handler does not run; record
	// without a payload (or with a sanitised one) to handle such a message. Default nil:
	// NULL.
	Payload []byte
}

// engineOpts returns the engine's form of o (nil: defaults).
func (o *InboxOpts) engineOpts() *protocol.InboxOpts {
	if o == nil {
		return nil
	}
	return &protocol.InboxOpts{Retention: o.Retention, Payload: o.Payload}
}

// InboxRecordTx records message messageID of consumer in the caller's transaction tx and
// reports whether it is new. Run the handler's writes in tx when it returns true, skip the
// message when it returns false; the caller's commit makes the record and the handler's
// rows visible together, and a rollback leaves neither, so the redelivery runs again.
//
// The message id names the delivery (a Kafka event id, an SQS message id); consumer
// scopes it, so two consumer groups handling one topic keep separate inboxes. Both follow
// the key rules ([ErrInvalidKey]): consumer within [Config.MaxNamespaceBytes], messageID
// within [Config.MaxKeyBytes]; an invalid one returns an [*InvalidKeyError] before tx is
// touched. A retention below [Config.MinTTL] returns an [*InvalidTTLError], a payload
// jsonb would reject an error matching [ErrInvalidPayload], also before tx is touched.
//
// The insert uses ON CONFLICT DO NOTHING, never a caught unique violation, so a duplicate
// leaves tx usable, and recording a duplicate is a pure read (no row lock, no transaction
// id). A concurrent transaction recording the same message blocks until the first one
// ends: after its commit this call returns false, after its rollback true. A row past its
// retention counts as absent and is reused (true), whether or not a concurrent
// [Coordinator.Sweep] deletes it meanwhile.
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate, or a concurrent Sweep
// deleting the expired row this call would reuse, may instead fail with a serialization
// failure (SQLSTATE 40001, returned as a [*StoreError] whose Err is the *pgconn.PgError);
// retry the transaction. Database errors are returned as a [*StoreError] for op "inbox";
// roll tx back after one. A tx that cannot take the row returns an error matching
// [ErrInvalidArgument] instead: one already committed or rolled back, or one an earlier
// failed statement aborted. A read-only tx is refused by the server (a *StoreError, as
// from a server that refuses writes), which aborts it: roll it back. A call for the message from within the
// [Coordinator.InboxHandle] fn handling it returns an error matching [ErrInvalidArgument]
// before tx is touched: on that fn's tx it would report a duplicate (and the caller skip
// the handler's writes), on another it would wait for the handler's uncommitted row.
// Cancelling ctx ends the statement (pgx may close the connection, which ends tx). Safe
// for concurrent use on different transactions.
func (c *Coordinator) InboxRecordTx(ctx context.Context, tx pgx.Tx, consumer, messageID string, opts *InboxOpts) (bool, error) {
	var etx protocol.Tx
	if tx != nil {
		etx = protocol.PgxTx(tx)
	}
	ctx, o := c.observe(ctx, OpInboxRecordTx, consumer, messageID)
	isNew, err := c.engine.InboxRecordTx(ctx, etx, consumer, messageID, opts.engineOpts())
	o.inboxDone(isNew, err)
	return isNew, err
}

// InboxHandle handles message messageID of consumer at most once: it begins a transaction
// on the coordinator's pool, records the message ([Coordinator.InboxRecordTx]) and, when it
// is new, runs fn in that transaction and commits. handled is true when fn ran and the
// commit succeeded; false with a nil error means the message was a duplicate and fn did not
// run.
//
// fn must not commit or roll back tx. If fn returns an error or panics, the transaction is
// rolled back — fn's writes and the inbox row alike — and the error is returned (a panic
// continues), so the redelivery runs fn again. (A fn that ended tx itself and then returns
// an error gets an error matching [ErrInvalidArgument] that wraps its own: whatever fn
// committed stays, the inbox row included, so a redelivery is skipped.) A failed commit
// returns a [*StoreError] for op "commit", except when the failure is fn's doing, which returns an error saying so,
// neither logged nor counted as a store error: fn returned nil after one of its
// statements failed (the server aborts the transaction, so the commit rolls back); the
// server refused the commit for a deferred constraint fn's writes broke (SQLSTATE class
// 23: nothing is committed, and a redelivery would be refused the same way); or fn
// committed or rolled back tx itself (matching [ErrInvalidArgument]: fn's writes and the
// inbox row went with whichever fn called, so a redelivery is skipped or runs fn again). Validation and
// concurrency are as in InboxRecordTx: a concurrent duplicate waits for the first
// transaction and then skips, or runs if the first rolled back. A nil fn, or a call for
// the message from within the fn handling it (directly or through other calls; it would
// wait for its own uncommitted row), returns an error matching [ErrInvalidArgument] and
// runs nothing.
//
// fn's writes must go through its tx to be exactly-once; an effect outside the database
// (a mail) needs [Do] inside fn, keyed by the effect. Do takes a second connection from
// the pool while InboxHandle holds one: size the pool above the number of concurrent
// handlers, twice that so that none waits. With no connection to spare the handlers wait
// on each other, and a Do that gets no connection within [Config.FinishTimeout] fails
// with an [ErrStoreUnavailable] error saying so (or ends with ctx, if that comes first):
// before the effect, nothing ran; after it, the record stays in progress until its lease
// ends, and the next delivery runs the effect again. Cancelling ctx ends the current statement (pgx may close the connection) and
// the transaction rolls back. Safe for concurrent use.
func (c *Coordinator) InboxHandle(ctx context.Context, consumer, messageID string, opts *InboxOpts, fn func(ctx context.Context, tx pgx.Tx) error) (handled bool, err error) {
	ctx, o := c.observe(ctx, OpInboxHandle, consumer, messageID)
	defer o.closePanicked()
	if o != nil && fn != nil {
		inner := fn
		fn = func(ctx context.Context, tx pgx.Tx) error {
			return o.fn(func(ctx context.Context) error { return inner(ctx, tx) })(ctx)
		}
	}
	handled, err = c.engine.InboxHandle(ctx, consumer, messageID, opts.engineOpts(), fn)
	o.inboxDone(handled, err)
	return handled, err
}
