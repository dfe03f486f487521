package store

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// NamespaceStats counts one namespace's records.
type NamespaceStats struct {
	Namespace string
	// InProgress, Completed, Failed and Parked count the records by status.
	InProgress, Completed, Failed, Parked int64
	// LeaseExpired counts in-progress records whose lease ran out: their holder stopped
	// renewing it.
	LeaseExpired int64
	// TookOver counts records with attempts > 1: the effect may have run more than once.
	TookOver int64
	// Sweepable counts the records a sweep deletes: past their TTL and not in progress
	// under a live lease.
	Sweepable int64
	// Oldest is the namespace's longest-running in-progress record, nil when none.
	Oldest *OldestInProgress
	// DBNow is the database clock when the statement ran.
	DBNow time.Time
}

// OldestInProgress is a namespace's longest-running in-progress record.
type OldestInProgress struct {
	Key                       string
	CreatedAt, LeaseExpiresAt time.Time
}

// RecordStats returns the record counts of every namespace that has records, in
// namespace order. It returns the driver's error.
func (s *Statements) RecordStats(ctx context.Context, db Executor) ([]NamespaceStats, error) {
	rows, err := db.Query(ctx, s.recordStats)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (NamespaceStats, error) {
		var (
			ns                        NamespaceStats
			key                       *string
			createdAt, leaseExpiresAt pgtype.Timestamptz
		)
		err := row.Scan(&ns.Namespace, &ns.InProgress, &ns.Completed, &ns.Failed, &ns.Parked, &ns.LeaseExpired,
			&ns.TookOver, &ns.Sweepable, &key, &createdAt, &leaseExpiresAt, &ns.DBNow)
		if err == nil && key != nil {
			ns.Oldest = &OldestInProgress{Key: *key, CreatedAt: createdAt.Time, LeaseExpiresAt: leaseExpiresAt.Time}
		}
		return ns, err
	})
}

// InboxStats counts the inbox rows and those past their retention, which a sweep
// deletes. It returns the driver's error (undefined_table where there is no inbox
// table: [Statements.TablesExist] tells first).
func (s *Statements) InboxStats(ctx context.Context, db Executor) (rows, expired int64, err error) {
	err = db.QueryRow(ctx, s.inboxStats).Scan(&rows, &expired)
	return rows, expired, err
}
