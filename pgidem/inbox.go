package pgidem

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// InboxRetentionDefault is the default [InboxOpts.Retention]: seven days.
const InboxRetentionDefault = 7 * 24 * time.Hour

// Inbox event kinds, reported to [Config.Hook] with the consumer as Event.Namespace.
const (
	// EventInboxRecorded: a message was recorded as new; its handler runs.
	EventInboxRecorded EventKind = "inbox_recorded"
	// EventInboxDuplicate: a message was already recorded; its handler is skipped.
	EventInboxDuplicate EventKind = "inbox_duplicate"
)

// InboxOpts are optional settings for [Coordinator.InboxRecordTx] and
// [Coordinator.InboxHandle]. A nil *InboxOpts means all defaults.
type InboxOpts struct {
	// Retention is how long the message stays recorded, counted from when it was
	// recorded. A redelivery within it is skipped; after it the row counts as absent
	// (whether or not [Coordinator.Sweep] has deleted it) and the message would be handled
	// again. Make it outlive the broker's retention and its longest redelivery horizon. At
	// least [Config.MinTTL], otherwise [*InvalidTTLError]. Default [InboxRetentionDefault]
	// (7 days).
	Retention time.Duration

	// Payload is stored in the row's payload column (jsonb) for inspection with SQL. It
	// must be valid JSON. Default nil: NULL.
	Payload []byte
}

// inboxStatements holds the inbox's SQL with the table name quoted in.
type inboxStatements struct {
	record, takeover, sweep string
}

func newInboxStatements(schema string) inboxStatements {
	t := qualify(schema, "pgidem_inbox")
	r := strings.NewReplacer("{t}", t)
	return inboxStatements{
		// Insert the message, or read whether the existing row has expired, in one round
		// trip. ON CONFLICT DO NOTHING never raises a unique violation (which would abort
		// the caller's transaction) and takes no lock on an existing row, so a duplicate
		// costs a read. A concurrent duplicate's insert waits for the first transaction:
		// after its commit the statement returns nothing (the row committed after this
		// statement's snapshot), after its rollback the insert goes ahead.
		record: r.Replace(`
WITH ins AS (
	INSERT INTO {t} (consumer, message_id, payload, received_at, expires_at)
	VALUES ($1, $2, $3, statement_timestamp(), statement_timestamp() + $4 * interval '1 microsecond')
	ON CONFLICT (consumer, message_id) DO NOTHING
	RETURNING true AS inserted, false AS expired
)
SELECT inserted, expired FROM ins
UNION ALL
SELECT false, expires_at <= statement_timestamp() FROM {t}
WHERE consumer = $1 AND message_id = $2 AND NOT EXISTS (SELECT 1 FROM ins)`),

		// Reuse a row past its retention, as if it had been swept. Of two concurrent
		// takers the second re-checks the condition on the first's new row version and
		// updates nothing.
		takeover: r.Replace(`
UPDATE {t} SET payload = $3, received_at = statement_timestamp(),
	expires_at = statement_timestamp() + $4 * interval '1 microsecond'
WHERE consumer = $1 AND message_id = $2 AND expires_at <= statement_timestamp()`),

		// Delete one batch of rows past their retention; see statements.sweep.
		sweep: r.Replace(`
DELETE FROM {t}
WHERE (consumer, message_id) IN (
	SELECT consumer, message_id FROM {t}
	WHERE expires_at <= now()
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
	}
}

// inboxCall is one validated inbox request.
type inboxCall struct {
	consumer, messageID string
	retention           time.Duration
	payload             []byte
}

func (c *Coordinator) newInboxCall(consumer, messageID string, opts *InboxOpts) (*inboxCall, error) {
	if opts == nil {
		opts = &InboxOpts{}
	}
	if err := validatePart("consumer", consumer, c.config.MaxNamespaceBytes); err != nil {
		return nil, err
	}
	if err := validatePart("message_id", messageID, c.config.MaxKeyBytes); err != nil {
		return nil, err
	}
	ic := &inboxCall{consumer: consumer, messageID: messageID,
		retention: orDefault(opts.Retention, InboxRetentionDefault), payload: opts.Payload}
	if ic.retention < c.config.MinTTL {
		return nil, &InvalidTTLError{TTL: ic.retention, MinTTL: c.config.MinTTL, Lease: c.config.Lease}
	}
	if ic.payload != nil && !json.Valid(ic.payload) {
		return nil, errors.New("pgidem: InboxOpts.Payload is not valid JSON")
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
// touched. A retention below [Config.MinTTL] returns an [*InvalidTTLError].
//
// The insert uses ON CONFLICT DO NOTHING, never a caught unique violation, so a duplicate
// leaves tx usable. A concurrent transaction recording the same message blocks until the
// first one ends: after its commit this call returns false, after its rollback true. A row
// past its retention counts as absent and is reused (true).
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate may instead fail with a
// serialization failure (SQLSTATE 40001); retry the transaction. Database errors are
// returned as a [*StoreError] for op "inbox"; roll tx back after one. Cancelling ctx
// cancels the statement. Safe for concurrent use on different transactions.
func (c *Coordinator) InboxRecordTx(ctx context.Context, tx pgx.Tx, consumer, messageID string, opts *InboxOpts) (bool, error) {
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err != nil {
		c.emit(ctx, EventInvalidKey, consumer, 1)
		return false, err
	}
	if tx == nil {
		return false, errors.New("pgidem: InboxRecordTx: tx is nil")
	}
	return c.inboxRecord(ctx, tx, ic)
}

func (c *Coordinator) inboxRecord(ctx context.Context, db executor, ic *inboxCall) (bool, error) {
	var inserted, expired bool
	err := db.QueryRow(ctx, c.sql.inbox.record, ic.consumer, ic.messageID, ic.payload,
		micros(ic.retention)).Scan(&inserted, &expired)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		// A concurrent transaction recorded the message and committed after this
		// statement's snapshot: a duplicate.
	case err != nil:
		return false, c.inboxStoreError(ctx, ic, "inbox", err)
	case expired:
		tag, err := db.Exec(ctx, c.sql.inbox.takeover, ic.consumer, ic.messageID, ic.payload, micros(ic.retention))
		if err != nil {
			return false, c.inboxStoreError(ctx, ic, "inbox", err)
		}
		inserted = tag.RowsAffected() == 1
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

func (c *Coordinator) inboxStoreError(ctx context.Context, ic *inboxCall, op string, err error) error {
	err = storeError(op, err)
	if errors.Is(err, ErrStoreUnavailable) {
		c.config.Logger.ErrorContext(ctx, "pgidem: store error",
			slog.String("consumer", ic.consumer), slog.String("message_id", ic.messageID), slog.String("error", err.Error()))
		c.emit(ctx, EventStoreError, ic.consumer, 1)
	}
	return err
}

// InboxHandle handles message messageID of consumer at most once: it begins a transaction
// on the coordinator's pool, records the message ([Coordinator.InboxRecordTx]) and, when it
// is new, runs fn in that transaction and commits. handled is true when fn ran and the
// commit succeeded; false with a nil error means the message was a duplicate and fn did not
// run.
//
// If fn returns an error or panics, the transaction is rolled back — fn's writes and the
// inbox row alike — and the error is returned (a panic continues), so the redelivery runs
// fn again. A failed commit returns a [*StoreError] for op "commit". Validation and
// concurrency are as in InboxRecordTx: a concurrent duplicate waits for the first
// transaction and then skips, or runs if the first rolled back.
//
// fn's writes must go through its tx to be exactly-once; an effect outside the database
// (a mail) needs [Do] inside fn, keyed by the effect. Cancelling ctx cancels the current
// statement and rolls back. Safe for concurrent use.
func (c *Coordinator) InboxHandle(ctx context.Context, consumer, messageID string, opts *InboxOpts, fn func(ctx context.Context, tx pgx.Tx) error) (handled bool, err error) {
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err != nil {
		c.emit(ctx, EventInvalidKey, consumer, 1)
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return false, c.inboxStoreError(ctx, ic, "begin", err)
	}
	ended := false
	defer func() {
		if !ended { // error or panic
			c.rollbackDetached(ctx, tx)
		}
	}()
	isNew, err := c.inboxRecord(ctx, tx, ic)
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
	if err := fn(ctx, tx); err != nil {
		return false, err
	}
	ended = true
	if err := tx.Commit(ctx); err != nil {
		return false, c.inboxStoreError(ctx, ic, "commit", err)
	}
	return true, nil
}
