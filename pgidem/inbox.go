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
	// [encoding/json.Valid]:
	//   - valid UTF-8 throughout, with no \u0000 escape and no unpaired UTF-16 surrogate
	//     escape (\ud800 alone).
	//   - numbers within Postgres's numeric range: at most 131072 digits before the
	//     decimal point and 16383 after it, exponent included.
	//   - nesting at most 10000 levels deep (encoding/json's limit, which pgidem's check
	//     uses).
	//   - at most [Config.MaxValueBytes] bytes (16 MiB by default).
	//
	// The database must use the UTF8 encoding, as pgidem needs for keys and results too. In
	// another, a character it cannot represent fails the statement as a *StoreError. A
	// payload that breaks a rule returns an error matching [ErrInvalidPayload] before the
	// transaction is touched, so it stays usable and the handler does not run. Record
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
// message when it returns false. The caller's commit makes the record and the handler's
// rows visible together; a rollback leaves neither, so the redelivery runs again. A
// duplicate leaves tx usable. A concurrent transaction recording the same message blocks
// until the first one ends ("Inbox" in the package documentation).
//
// Errors (tx is not touched for the first three):
//   - consumer or messageID breaking the key rules (within [Config.MaxNamespaceBytes] and
//     [Config.MaxKeyBytes]): an [*InvalidKeyError].
//   - a retention below [Config.MinTTL]: an [*InvalidTTLError]; a payload jsonb would
//     reject: [ErrInvalidPayload].
//   - a call from within the [Coordinator.InboxHandle] fn handling the message:
//     [ErrInvalidArgument].
//   - a tx already committed or rolled back, or aborted by an earlier failed statement:
//     [ErrInvalidArgument].
//   - a database error: a [*StoreError] for op "inbox"; roll tx back. A read-only tx is
//     refused by the server this way, and a serialization failure (SQLSTATE 40001) under
//     REPEATABLE READ or SERIALIZABLE too: retry the transaction.
//
// Cancelling ctx ends the statement; pgx may close the connection, which ends tx. Safe for
// concurrent use on different transactions.
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

// InboxHandle handles message messageID of consumer at most once. It begins a transaction
// on the coordinator's pool, records the message ([Coordinator.InboxRecordTx]) and, when it
// is new, runs fn in that transaction and commits. handled is true when fn ran and the
// commit succeeded; false with a nil error means the message was a duplicate and fn did not
// run. fn's writes must go through its tx to be exactly-once. An effect outside the
// database (a mail) needs [Do] inside fn, keyed by the effect; size the pool for it
// ("Inbox" in the package documentation).
//
// Errors:
//   - validation as in InboxRecordTx; a nil fn, or a call for the message from within the
//     fn handling it (it would wait for its own uncommitted row): [ErrInvalidArgument],
//     and nothing runs.
//   - fn's error or panic: the transaction is rolled back, fn's writes and the inbox row
//     alike, and the error returned (a panic continues); the redelivery runs fn again.
//   - fn ended tx itself: [ErrInvalidArgument], wrapping fn's error if any. Whatever fn
//     committed stays, the inbox row included.
//   - a failed commit: a [*StoreError] for op "commit", unless the failure is fn's doing.
//     Then the error says so, and is neither logged nor counted as a store error (see
//     "Inbox").
//
// A concurrent duplicate waits for the first transaction and then skips, or runs if the
// first rolled back. Cancelling ctx ends the current statement (pgx may close the
// connection) and the transaction rolls back. Safe for concurrent use.
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
