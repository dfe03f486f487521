package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"
)

// statsJSON is the --json output of stats.
type statsJSON struct {
	Namespaces []namespaceStats `json:"namespaces"`
	Table      *tableStats      `json:"table"`
	// Inbox is null when the database has no inbox table.
	Inbox *tableStats `json:"inbox"`
}

func (a *app) statsCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "stats",
		Short: "Per-namespace counts, dead holders' and taken-over records, expired rows, table size",
		Long: `Prints, per namespace: records by status (PARKED: holders kept dying until the
attempts cap, see records list --status parked); LEASE EXPIRED, in-progress records whose
holder stopped renewing the lease; TOOK OVER, records whose effect started more than once
(attempts > 1); EXPIRED, records the next sweep deletes (past their TTL and not in
progress under a live lease); and the oldest in-progress record with its lease: the
longest-running holder, live or dead, not by itself a sign that anything is stuck (a live
holder whose work hangs keeps renewing its lease; its AGE gives it away). Then, for
the record table and the inbox table, the row count, the expired rows the next sweep
deletes, and the total size (with indexes and TOAST). A database without the inbox table
gets no inbox line (--json: "inbox": null). Namespaces and keys are quoted as in records
list.`,
		Example: "  pgidem stats\n  pgidem stats --json",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			return a.withStore(cmd.Context(), func(s *store) error {
				namespaces, total, err := s.stats(cmd.Context())
				if err != nil {
					return err
				}
				inbox, err := s.inboxStats(cmd.Context())
				if err != nil {
					return err
				}
				if a.json {
					return printJSON(a.stdout, statsJSON{Namespaces: namespaces, Table: total, Inbox: inbox})
				}
				if len(namespaces) > 0 {
					t := newTable(a.stdout, "NAMESPACE", "IN PROGRESS", "COMPLETED", "FAILED", "PARKED",
						"LEASE EXPIRED", "TOOK OVER", "EXPIRED", "OLDEST IN PROGRESS", "AGE", "LEASE")
					for _, ns := range namespaces {
						oldest, age, lease := "-", "-", "-"
						if o := ns.OldestInProgress; o != nil {
							oldest, age, lease = quoteName(o.Key), humanDuration(o.AgeSeconds), remaining(o.LeaseRemainingSeconds)
						}
						t.row(quoteName(ns.Namespace), fmt.Sprint(ns.InProgress), fmt.Sprint(ns.Completed), fmt.Sprint(ns.Failed),
							fmt.Sprint(ns.Parked), fmt.Sprint(ns.LeaseExpired), fmt.Sprint(ns.TookOver), fmt.Sprint(ns.Expired), oldest, age, lease)
					}
					if err := t.flush(); err != nil {
						return err
					}
					fmt.Fprintln(a.stdout)
				}
				fmt.Fprintf(a.stdout, "table %s: %s (%d expired, not swept), %s\n",
					total.Table, count(total.Rows, "record", "records"), total.Expired, total.SizePretty)
				if inbox != nil {
					fmt.Fprintf(a.stdout, "table %s: %s (%d expired, not swept), %s\n",
						inbox.Table, count(inbox.Rows, "message", "messages"), inbox.Expired, inbox.SizePretty)
				}
				return nil
			})
		}),
	}
}

// namespaceStats is one row of stats.
type namespaceStats struct {
	Namespace  string `json:"namespace"`
	InProgress int64  `json:"in_progress"`
	Completed  int64  `json:"completed"`
	Failed     int64  `json:"failed"`
	// Parked counts records parked at the attempts cap: they need an operator.
	Parked int64 `json:"parked"`
	// LeaseExpired counts in-progress records whose holder stopped renewing the lease.
	LeaseExpired int64 `json:"lease_expired"`
	// TookOver counts records with attempts > 1: the effect may have run more than once.
	TookOver int64 `json:"took_over"`
	// Expired counts the records the next sweep deletes: past their TTL and not in
	// progress under a live lease.
	Expired          int64             `json:"expired"`
	OldestInProgress *oldestInProgress `json:"oldest_in_progress"`
}

// oldestInProgress is the longest-running in-progress record of a namespace.
type oldestInProgress struct {
	Key                   string    `json:"key"`
	CreatedAt             time.Time `json:"created_at"`
	AgeSeconds            float64   `json:"age_seconds"`
	LeaseExpiresAt        time.Time `json:"lease_expires_at"`
	LeaseRemainingSeconds float64   `json:"lease_remaining_seconds"`
}

// tableStats describes a table as a whole.
type tableStats struct {
	Table string `json:"table"`
	Rows  int64  `json:"rows"`
	// Expired counts the rows the next sweep deletes: past their expiry (and, for records,
	// not in progress under a live lease).
	Expired    int64  `json:"expired"`
	SizeBytes  int64  `json:"size_bytes"`
	SizePretty string `json:"size_pretty"`
}

func (s *store) stats(ctx context.Context) ([]namespaceStats, *tableStats, error) {
	read, err := s.sql.RecordStats(ctx, s.pool)
	if err != nil {
		return nil, nil, s.translate(ctx, "stats", err)
	}
	out := []namespaceStats{}
	total := &tableStats{Table: s.display}
	for _, r := range read {
		ns := namespaceStats{Namespace: r.Namespace, InProgress: r.InProgress, Completed: r.Completed, Failed: r.Failed,
			Parked: r.Parked, LeaseExpired: r.LeaseExpired, TookOver: r.TookOver, Expired: r.Sweepable}
		if o := r.Oldest; o != nil {
			ns.OldestInProgress = &oldestInProgress{
				Key: o.Key, CreatedAt: o.CreatedAt, AgeSeconds: seconds(r.DBNow.Sub(o.CreatedAt)),
				LeaseExpiresAt: o.LeaseExpiresAt, LeaseRemainingSeconds: seconds(o.LeaseExpiresAt.Sub(r.DBNow)),
			}
		}
		total.Rows += ns.InProgress + ns.Completed + ns.Failed + ns.Parked
		total.Expired += ns.Expired
		out = append(out, ns)
	}
	total.SizeBytes, total.SizePretty, err = s.sql.RecordTableSize(ctx, s.pool)
	if err != nil {
		return nil, nil, s.translate(ctx, "stats: table size", err)
	}
	return out, total, nil
}

// inboxStats describes the inbox table, or returns nil when the database has none (its
// migration was not applied, for example when the files were vendored selectively).
func (s *store) inboxStats(ctx context.Context) (*tableStats, error) {
	_, exists, err := s.tablesExist(ctx)
	if err != nil {
		return nil, s.translate(ctx, "stats: inbox", err)
	}
	if !exists {
		return nil, nil
	}
	t := &tableStats{Table: s.inboxDisplay}
	if t.Rows, t.Expired, err = s.sql.InboxStats(ctx, s.pool); err != nil {
		return nil, s.translate(ctx, "stats: inbox", err)
	}
	if t.SizeBytes, t.SizePretty, err = s.sql.InboxTableSize(ctx, s.pool); err != nil {
		return nil, s.translate(ctx, "stats: table size", err)
	}
	return t, nil
}
