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
// reports whether it is new: the engine of pgidem's Coordinator.InboxRecordTx, whose
// comment and package documentation ("Inbox") describe its errors and concurrency. The
// insert uses ON CONFLICT DO NOTHING, so a duplicate leaves tx usable. Invalid input
// returns an [*InvalidKeyError], an [*InvalidTTLError] or an error matching
// [ErrInvalidPayload] or [ErrInvalidArgument] before tx is touched; a database error
// returns a [*StoreError] for op "inbox". Safe for concurrent use on different
// transactions.
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
// is new, runs fn in that transaction and commits. It is the engine of pgidem's
// Coordinator.InboxHandle, whose comment describes its errors in full. handled is true
// when fn ran and the commit succeeded; false with a nil error means a duplicate.
//
// fn's error or panic rolls the transaction back, fn's writes and the inbox row alike, and
// is returned (a panic continues). A failed commit returns a [*StoreError] for op
// "commit", unless the failure is fn's doing ([commitRefused]). A nil fn, or a call for
// the message from within the fn handling it, returns an error matching
// [ErrInvalidArgument] and runs nothing. Cancelling ctx ends the current statement and
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
