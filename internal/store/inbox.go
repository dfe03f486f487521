package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// InboxRow is one row of pgidem_inbox with the verdict its statement took by the database
// clock.
type InboxRow struct {
	// Consumer and MessageID identify the row.
	Consumer, MessageID string
	// Payload is the stored JSON payload, nil when none was stored.
	Payload []byte
	// ReceivedAt is when the message was recorded; ExpiresAt ends its retention.
	ReceivedAt, ExpiresAt time.Time
	// Expired reports whether ExpiresAt had passed at DBNow, the statement's time.
	Expired bool
	DBNow   time.Time
}

// ScanTargets are the scan targets of an inbox statement's columns.
func (r *InboxRow) ScanTargets() []any {
	return []any{&r.Consumer, &r.MessageID, &r.Payload, &r.ReceivedAt, &r.ExpiresAt, &r.Expired, &r.DBNow}
}

func scanInbox(row pgx.CollectableRow) (InboxRow, error) {
	var r InboxRow
	err := row.Scan(r.ScanTargets()...)
	return r, err
}

// ReadInbox reads the inbox row of (consumer, messageID). It returns pgx.ErrNoRows when
// there is none and the driver's error otherwise.
func (s *Statements) ReadInbox(ctx context.Context, db Executor, consumer, messageID string) (*InboxRow, error) {
	var r InboxRow
	if err := db.QueryRow(ctx, s.readInbox, consumer, messageID).Scan(r.ScanTargets()...); err != nil {
		return nil, err
	}
	return &r, nil
}

// ForgetInbox deletes the inbox row of (consumer, messageID) and returns it, so that the
// message is handled again when it is redelivered. It returns pgx.ErrNoRows when there is
// none (a handler's uncommitted row is not seen) and the driver's error otherwise.
func (s *Statements) ForgetInbox(ctx context.Context, db Executor, consumer, messageID string) (*InboxRow, error) {
	var r InboxRow
	if err := db.QueryRow(ctx, s.forgetInbox, consumer, messageID).Scan(r.ScanTargets()...); err != nil {
		return nil, err
	}
	return &r, nil
}
