package main

import (
	"fmt"

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
		Long: `Prints, per namespace: records by status; LEASE EXPIRED, in-progress records whose
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
					t := newTable(a.stdout, "NAMESPACE", "IN PROGRESS", "COMPLETED", "FAILED",
						"LEASE EXPIRED", "TOOK OVER", "EXPIRED", "OLDEST IN PROGRESS", "AGE", "LEASE")
					for _, ns := range namespaces {
						oldest, age, lease := "-", "-", "-"
						if o := ns.OldestInProgress; o != nil {
							oldest, age, lease = quoteName(o.Key), humanDuration(o.AgeSeconds), remaining(o.LeaseRemainingSeconds)
						}
						t.row(quoteName(ns.Namespace), fmt.Sprint(ns.InProgress), fmt.Sprint(ns.Completed), fmt.Sprint(ns.Failed),
							fmt.Sprint(ns.LeaseExpired), fmt.Sprint(ns.TookOver), fmt.Sprint(ns.Expired), oldest, age, lease)
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
