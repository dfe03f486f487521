package main

import (
	"fmt"
	"io"
	"math"
	"strings"

	"github.com/spf13/cobra"
)

// statusValues lists the values of pgidem_record.status, for messages.
const statusValues = "in_progress, completed, failed"

// validStatus reports whether s is a value of pgidem_record.status.
func validStatus(s string) bool {
	switch s {
	case "in_progress", "completed", "failed":
		return true
	}
	return false
}

// listLimitDefault is how many records records list prints unless --limit says otherwise.
const listLimitDefault = 100

func (a *app) recordsCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "records",
		Aliases: []string{"record"},
		Short:   "List, show or forget idempotency records",
		Args:    cobra.NoArgs,
		RunE:    group,
	}
	cmd.AddCommand(a.recordsListCommand(), a.recordsShowCommand(), a.recordsForgetCommand())
	return cmd
}

// exactArgs is cobra.ExactArgs with a message naming the arguments.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != len(names) {
			return usagef("%s takes %d arguments (%s), got %d", cmd.CommandPath(), len(names), strings.Join(names, " "), len(args))
		}
		return nil
	}
}

// keyArgs checks the NAMESPACE KEY arguments of records show and forget: two, each one
// pgidem could have stored (see checkKeyPart).
func keyArgs(cmd *cobra.Command, args []string) error {
	if err := exactArgs("NAMESPACE", "KEY")(cmd, args); err != nil {
		return err
	}
	if err := checkKeyPart("NAMESPACE", args[0]); err != nil {
		return err
	}
	return checkKeyPart("KEY", args[1])
}

// quotingNote is the help text on how table output prints names.
const quotingNote = `In table output a namespace or key (consumer, message id) with white space, a quote, or a
character that does not print is shown quoted in Go syntax ("order-9 ", "a\tb"), as are
"" and "-"; pass it to show and forget unquoted, as the shell gives it (in bash $'a\tb'
for escapes: pgidem never stores a control character such as a tab, but a row inserted
with SQL can have one). --json output always has the exact text.`

func (a *app) recordsListCommand() *cobra.Command {
	var p listParams
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List records, newest first",
		Long: `Lists records, newest first, with times measured on the database clock.

ATTEMPTS > 1 means the lease was taken over: the effect may have run more than once.
LEASE is the time left before another caller may take an in-progress record over.
EXPIRES is the time left before the record expires; an expired record behaves like no
record and is deleted by the next sweep, unless it is in progress under a live lease.

--expired lists the records the next sweep deletes: past their TTL and not in progress
under a live lease. With --limit, a note says when more records match; the --json output
has no such note: it is an array of at most --limit records (--limit 0 for all), with each
record's result and error (the table leaves them out, and does not read them).

` + quotingNote,
		Example: `  pgidem records list --namespace invoices --min-attempts 2
  pgidem records list --status in_progress --limit 20
  pgidem records list --expired --json`,
		Args: cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("status") && p.status == "" {
				// An empty variable ("--status $STATUS") must not silently list everything.
				return usagef("--status must not be empty (omit it to list every status)")
			}
			if p.status != "" && !validStatus(p.status) {
				return usagef("--status must be one of %s, got %q", statusValues, p.status)
			}
			if err := checkFilter("--namespace", p.namespace); err != nil {
				return err
			}
			if cmd.Flags().Changed("namespace") && p.namespace == "" {
				// An empty variable ("--namespace $NS") must not silently list everything.
				return usagef("--namespace must not be empty (omit it to list every namespace)")
			}
			// The upper bounds keep the values within the int4 attempts column, and
			// --limit + 1 (see store.list) within an int.
			if p.minAttempts < 0 || p.minAttempts > math.MaxInt32 {
				return usagef("--min-attempts must be between 0 and %d, got %d", math.MaxInt32, p.minAttempts)
			}
			if p.limit < 0 || p.limit > math.MaxInt32 {
				return usagef("--limit must be between 0 (no limit) and %d, got %d", math.MaxInt32, p.limit)
			}
			p.values = a.json
			return a.withStore(cmd.Context(), func(s *store) error {
				records, more, err := s.list(cmd.Context(), p)
				if err != nil {
					return err
				}
				if a.json {
					if records == nil {
						records = []*record{}
					}
					return printJSON(a.stdout, records)
				}
				if len(records) == 0 {
					fmt.Fprintln(a.stdout, "no records match")
					return nil
				}
				t := newTable(a.stdout, "NAMESPACE", "KEY", "STATUS", "ATTEMPTS", "AGE", "LEASE", "EXPIRES")
				for _, r := range records {
					lease := "-"
					if r.Status == "in_progress" && r.LeaseRemainingSeconds != nil {
						lease = remaining(*r.LeaseRemainingSeconds)
					}
					t.row(quoteName(r.Namespace), quoteName(r.Key), r.Status, fmt.Sprint(r.Attempts), humanDuration(r.AgeSeconds),
						lease, remaining(r.TTLRemainingSeconds))
				}
				if err := t.flush(); err != nil {
					return err
				}
				if more {
					fmt.Fprintf(a.stdout, "(first %s; raise --limit for more)\n", count(p.limit, "record", "records"))
				}
				return nil
			})
		}),
	}
	flags := cmd.Flags()
	flags.StringVar(&p.namespace, "namespace", "", "only records in this namespace")
	flags.StringVar(&p.status, "status", "", "only records with this status: "+statusValues)
	flags.IntVar(&p.minAttempts, "min-attempts", 0, "only records started at least this many times (2: taken over, the effect may have run twice)")
	flags.BoolVar(&p.expired, "expired", false, "only records the next sweep deletes: past their TTL and not in progress under a live lease")
	flags.IntVar(&p.limit, "limit", listLimitDefault, "print at most this many records (0: no limit; at most 2147483647)")
	return cmd
}

func (a *app) recordsShowCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "show NAMESPACE KEY",
		Short:   "Show one record in full",
		Long:    "Shows the record for NAMESPACE KEY in full, result and error included.\n\n" + quotingNote,
		Example: "  pgidem records show invoices order-9.invoice\n  pgidem records show invoices -- -order-9   # a key starting with '-'",
		Args:    keyArgs,
		RunE: a.action(func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s *store) error {
				r, err := s.show(cmd.Context(), args[0], args[1])
				if err != nil {
					return err
				}
				return a.printFound(r, false, func(w io.Writer) error { return printRecord(w, r) })
			})
		}),
	}
}

func (a *app) recordsForgetCommand() *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "forget NAMESPACE KEY",
		Short: "Delete a record so the effect runs again on the next delivery",
		Long: `Deletes the record for NAMESPACE KEY, so that the next call with that key runs the
effect again: use it to replay an effect by hand after an incident. It prints the record
it deleted.

A record in progress under a live lease (and not past its TTL) is refused: its holder
may be running the effect right now, and deleting the record would let a second caller
run it in parallel. A live holder keeps renewing its lease, so the lease ends only once
the holder is gone (or finishes); try again then, or pass --force if you know the holder
is gone. The check and the delete are one SQL statement, so a holder renewing its lease
at the same moment is never deleted without --force.

Interrupted (Ctrl-C), it asks the server to cancel the delete and says whether anything
was deleted; only when the server does not answer within a few seconds is that unknown,
and the message says how to check.

` + quotingNote,
		Example: "  pgidem records forget invoices order-9.invoice\n  pgidem records forget invoices -- -order-9   # a key starting with '-'",
		Args:    keyArgs,
		RunE: a.action(func(cmd *cobra.Command, args []string) error {
			return a.withStoreDeleting(cmd.Context(), func(s *store) error {
				r, err := s.forget(cmd.Context(), args[0], args[1], force)
				if err != nil {
					return err
				}
				a.changed = "records forget deleted the record"
				if r.live() {
					fmt.Fprintln(a.stderr, "pgidem: warning: the record was in progress under a live lease; its holder may still be running the effect, and the next call with the key runs it again beside it")
				}
				return a.printFound(r, true, func(w io.Writer) error { return printRecord(w, r) })
			})
		}),
	}
	cmd.Flags().BoolVar(&force, "force", false, "delete even a record in progress under a live lease")
	return cmd
}

// printFound prints one row that a command found, or deleted (then under "deleted:", or
// as {"deleted": row} in JSON), as JSON or as text by print.
func (a *app) printFound(row any, deleted bool, print func(io.Writer) error) error {
	if a.json {
		if deleted {
			return printJSON(a.stdout, map[string]any{"deleted": row})
		}
		return printJSON(a.stdout, row)
	}
	if deleted {
		fmt.Fprintln(a.stdout, "deleted:")
	}
	return print(a.stdout)
}

// printRecord prints one record as aligned "field  value" lines.
func printRecord(w io.Writer, r *record) error {
	t := newTable(w, "namespace", quoteName(r.Namespace))
	t.row("key", quoteName(r.Key))
	t.row("status", r.Status)
	attempts := fmt.Sprint(r.Attempts)
	if r.TookOver {
		attempts += " (taken over: the effect may have run more than once)"
	}
	t.row("attempts", attempts)
	t.row("owner", r.Owner)
	fingerprint := "-"
	if r.Fingerprint != nil {
		fingerprint = *r.Fingerprint
	}
	t.row("fingerprint", fingerprint)
	t.row("created", timestamp(r.CreatedAt)+" ("+humanDuration(r.AgeSeconds)+" ago)")
	t.row("updated", timestamp(r.UpdatedAt))
	completed := "-"
	if r.CompletedAt != nil {
		completed = timestamp(*r.CompletedAt)
	}
	t.row("completed", completed)
	lease := "-"
	if r.LeaseExpiresAt != nil && r.LeaseRemainingSeconds != nil {
		lease = timestamp(*r.LeaseExpiresAt) + " (" + remaining(*r.LeaseRemainingSeconds) + ")"
	}
	t.row("lease expires", lease)
	t.row("expires", timestamp(r.ExpiresAt)+" ("+remaining(r.TTLRemainingSeconds)+")")
	t.row("result", r.Result.String())
	t.row("error", r.Error.String())
	return t.flush()
}
