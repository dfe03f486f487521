package protocol

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// inboxCall is one validated inbox request.
type inboxCall struct {
	consumer, messageID string
	retention           time.Duration
	payload             []byte
}

// InboxOpts are an inbox call's settings (pgidem.InboxOpts documents each).
type InboxOpts struct {
	Retention time.Duration
	Payload   []byte
}

// InboxRetentionDefault is how long an inbox row is kept when InboxOpts.Retention is 0.
const InboxRetentionDefault = 7 * 24 * time.Hour

func (c *Engine) newInboxCall(consumer, messageID string, opts *InboxOpts) (*inboxCall, error) {
	if opts == nil {
		opts = &InboxOpts{}
	}
	if err := ValidatePart("consumer", consumer, c.config.MaxNamespaceBytes); err != nil {
		return nil, err
	}
	if err := ValidatePart("message_id", messageID, c.config.MaxKeyBytes); err != nil {
		return nil, err
	}
	ic := &inboxCall{consumer: consumer, messageID: messageID,
		retention: cmp.Or(opts.Retention, InboxRetentionDefault), payload: opts.Payload}
	if ic.retention < c.config.MinTTL {
		return nil, &InvalidTTLError{TTL: ic.retention, MinTTL: c.config.MinTTL, Lease: c.config.Lease}
	}
	if ic.payload != nil {
		if _, err := store.CheckJSON(ic.payload, c.config.MaxValueBytes); err != nil {
			return nil, fmt.Errorf("%w: InboxOpts.Payload %v", ErrInvalidPayload, err)
		}
	}
	return ic, nil
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
// [Engine.Sweep] deletes it meanwhile.
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate, or a concurrent Sweep
// deleting the expired row this call would reuse, may instead fail with a serialization
// failure (SQLSTATE 40001, returned as a [*StoreError] whose Err is the *pgconn.PgError);
// retry the transaction. Database errors are returned as a [*StoreError] for op "inbox";
// roll tx back after one. A tx that cannot take the row returns an error matching
// [ErrInvalidArgument] instead: one already committed or rolled back, or one an earlier
// failed statement aborted. A read-only tx is refused by the server (a *store.Error, as
// from a server that refuses writes), which aborts it: roll it back. A call for the message from within the
// [Engine.InboxHandle] fn handling it returns an error matching [ErrInvalidArgument]
// before tx is touched: on that fn's tx it would report a duplicate (and the caller skip
// the handler's writes), on another it would wait for the handler's uncommitted row.
// Cancelling ctx ends the statement (pgx may close the connection, which ends tx). Safe
// for concurrent use on different transactions.
func (c *Engine) InboxRecordTx(ctx context.Context, tx Tx, consumer, messageID string, opts *InboxOpts) (bool, error) {
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err == nil {
		err = checkNotHeld(ctx, "InboxRecordTx", c.config.Schema, consumer, messageID, true)
	}
	if err != nil {
		c.emitInvalid(ctx, consumer)
		return false, err
	}
	if tx == nil {
		return false, InvalidArgument("InboxRecordTx: tx is nil")
	}
	return c.inboxRecord(ctx, tx, ic, true)
}

// inboxRecord records ic's message in db. callersTx is true when db is the caller's
// transaction (InboxRecordTx): one already ended or aborted is then the caller's mistake,
// not a store error.
func (c *Engine) inboxRecord(ctx context.Context, db rowQuerier, ic *inboxCall, callersTx bool) (bool, error) {
	var inserted bool
	err := db.QueryRow(ctx, c.sql.InboxRecord, ic.consumer, ic.messageID, store.JSONText(ic.payload),
		store.Micros(ic.retention)).Scan(&inserted)
	if txErr := unusableTx("InboxRecordTx", err); callersTx && txErr != nil {
		c.emitInvalid(ctx, ic.consumer)
		return false, txErr
	}
	if err != nil {
		return false, c.inboxStoreError(ctx, ic, "inbox", err)
	}
	if !inserted {
		if c.config.Logger.Enabled(ctx, slog.LevelDebug) { // keep the duplicate path allocation-free
			c.config.Logger.DebugContext(ctx, "pgidem: inbox duplicate skipped",
				slog.String("consumer", ic.consumer), slog.String("message_id", ic.messageID))
		}
		c.emit(ctx, EventInboxDuplicate, ic.consumer, 1)
		return false, nil
	}
	c.emit(ctx, EventInboxRecorded, ic.consumer, 1)
	return true, nil
}

func (c *Engine) inboxStoreError(ctx context.Context, ic *inboxCall, op string, err error) error {
	return c.reportStoreError(ctx, ic.consumer, store.Wrap(op, err),
		slog.String("consumer", ic.consumer), slog.String("message_id", ic.messageID))
}

// InboxHandle handles message messageID of consumer at most once: it begins a transaction
// on the coordinator's pool, records the message ([Engine.InboxRecordTx]) and, when it
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
// with an [store.ErrUnavailable] error saying so (or ends with ctx, if that comes first):
// before the effect, nothing ran; after it, the record stays in progress until its lease
// ends, and the next delivery runs the effect again. Cancelling ctx ends the current statement (pgx may close the connection) and
// the transaction rolls back. Safe for concurrent use.
func (c *Engine) InboxHandle(ctx context.Context, consumer, messageID string, opts *InboxOpts, fn func(ctx context.Context, tx pgx.Tx) error) (handled bool, err error) {
	if fn == nil {
		return false, InvalidArgument("InboxHandle: fn must not be nil")
	}
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err == nil {
		err = checkNotHeld(ctx, "InboxHandle", c.config.Schema, consumer, messageID, true)
	}
	if err != nil {
		c.emitInvalid(ctx, consumer)
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	// READ WRITE explicitly: a pool whose sessions default to read-only transactions
	// still records, and a server that refuses writes (a hot standby) fails the BEGIN as
	// a store error.
	tx, err := c.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return false, c.inboxStoreError(ctx, ic, "begin", err)
	}
	ended := false
	defer func() {
		if !ended { // error or panic
			c.rollbackDetached(ctx, tx)
		}
	}()
	isNew, err := c.inboxRecord(ctx, tx, ic, false)
	if err != nil {
		return false, err
	}
	if !isNew {
		// Nothing was written. Should ctx be cancelled now, pgx closes the connection and
		// the server ends the transaction just the same.
		ended = true
		_ = tx.Rollback(ctx)
		return false, nil
	}
	if fnErr := fn(withKey(ctx, c.config.Schema, consumer, messageID, true), tx); fnErr != nil {
		ended = true
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
		defer cancel()
		if err := tx.Rollback(rctx); errors.Is(err, pgx.ErrTxClosed) {
			// fn committed or rolled back tx itself and then failed: its error does not say
			// what happened to the message (after a commit the redelivery is skipped), so
			// it is refused as a fn that returns nil is, keeping fn's error in the chain.
			return false, fmt.Errorf("%w (fn returned: %w)", commitRefused("InboxHandle", err), fnErr)
		}
		return false, fnErr
	}
	ended = true
	if err := tx.Commit(ctx); err != nil {
		if refused := commitRefused("InboxHandle", err); refused != nil {
			return false, refused
		}
		return false, c.inboxStoreError(ctx, ic, "commit", err)
	}
	return true, nil
}
