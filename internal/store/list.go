package store

import (
	"context"
	"math"

	"github.com/jackc/pgx/v5"
)

// RecordFilter selects the records [Statements.ListRecords] returns. The zero value
// selects every record, without result and error.
type RecordFilter struct {
	// Namespace keeps the records of one namespace ("": every namespace).
	Namespace string
	// Status keeps the records of one status ("": every status).
	Status Status
	// MinAttempts keeps the records started at least this many times (0 or 1: all; 2:
	// taken over).
	MinAttempts int
	// Sweepable keeps only the records a sweep deletes: past their TTL and not in
	// progress under a live lease.
	Sweepable bool
	// Limit is the most records returned (0: no limit).
	Limit int
	// Values reads each record's result and error, which can be megabytes; without it
	// Row.Result and Row.Failure are nil and neither is read at all.
	Values bool
}

// ListedRecord is a record as a listing read it.
type ListedRecord struct {
	Namespace, Key string
	Row
}

// ListRecords returns the records f selects, newest first (by created_at, then namespace
// and key). more reports whether further records match beyond f.Limit; with f.Values it is
// always false: no record beyond the limit is read, to keep its values unread. It returns
// the driver's error; the caller wraps it.
func (s *Statements) ListRecords(ctx context.Context, db Executor, f *RecordFilter) (records []ListedRecord, more bool, err error) {
	sql := s.listRecords
	limit := int64(math.MaxInt64)
	switch {
	case f.Values:
		sql = s.listRecordsValues
		if f.Limit > 0 {
			limit = int64(f.Limit)
		}
	case f.Limit > 0:
		// One more than asked for: whether it comes back says if more records match.
		limit = int64(f.Limit) + 1
	}
	rows, err := db.Query(ctx, sql, f.Namespace, string(f.Status), f.MinAttempts, f.Sweepable, limit)
	if err != nil {
		return nil, false, err
	}
	records, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (ListedRecord, error) {
		var r ListedRecord
		err := row.Scan(append([]any{&r.Namespace, &r.Key}, r.ScanTargets(false)...)...)
		return r, err
	})
	if err != nil {
		return nil, false, err
	}
	if f.Limit > 0 && len(records) > f.Limit {
		return records[:f.Limit], true, nil
	}
	return records, false, nil
}

// InboxFilter selects the inbox rows [Statements.ListInbox] returns. The zero value
// selects every row.
type InboxFilter struct {
	// Consumer keeps the rows of one consumer ("": every consumer).
	Consumer string
	// MessageID keeps the rows of one message id ("": every message).
	MessageID string
	// Expired keeps only the rows past their retention, which a sweep deletes.
	Expired bool
	// Limit is the most rows returned (0: no limit).
	Limit int
}

// ListInbox returns the inbox rows f selects, newest first (by received_at, then consumer
// and message id); more reports whether further rows match beyond f.Limit. It returns the
// driver's error; the caller wraps it.
func (s *Statements) ListInbox(ctx context.Context, db Executor, f *InboxFilter) (inbox []InboxRow, more bool, err error) {
	limit := int64(math.MaxInt64)
	if f.Limit > 0 {
		limit = int64(f.Limit) + 1 // one more than asked for: says if more rows match
	}
	rows, err := db.Query(ctx, s.listInbox, f.Consumer, f.MessageID, f.Expired, limit)
	if err != nil {
		return nil, false, err
	}
	inbox, err = pgx.CollectRows(rows, scanInbox)
	if err != nil {
		return nil, false, err
	}
	if f.Limit > 0 && len(inbox) > f.Limit {
		return inbox[:f.Limit], true, nil
	}
	return inbox, false, nil
}
