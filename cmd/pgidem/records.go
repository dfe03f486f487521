package main

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	pgstore "github.com/pgidem/pgidem/internal/store"
)

// statusValues lists the values of pgidem_record.status, for messages.
const statusValues = "in_progress, completed, failed, parked"

// validStatus reports whether s is a value of pgidem_record.status.
func validStatus(s string) bool {
	switch s {
	case "in_progress", "completed", "failed", "parked":
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
STATUS parked means its holders kept dying until the attempts cap (the coordinator's
MaxAttempts): calls with its key fail until it is forgotten (records forget) or expires.
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
  pgidem records list --status parked
  pgidem records list --expired --json`,
		Args: cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if err := checkListFlags(cmd, &p); err != nil {
				return err
			}
			f := &pgstore.RecordFilter{Namespace: p.namespace, Status: pgstore.Status(p.status), MinAttempts: p.minAttempts,
				Sweepable: p.expired, Limit: p.limit, Values: a.json}
			return a.withStore(cmd.Context(), func(s *store) error {
				records, more, err := s.list(cmd.Context(), f)
				if err != nil {
					return err
				}
				return a.printRecords(records, more, p.limit)
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

// listParams are the flags of records list.
type listParams struct {
	namespace   string
	status      string
	minAttempts int
	expired     bool
	limit       int
}

// checkListFlags checks the flags of records list.
func checkListFlags(cmd *cobra.Command, p *listParams) error {
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
	// The upper bounds keep the values within the int4 attempts column, and --limit + 1
	// (see store.Statements.ListRecords) within an int.
	if p.minAttempts < 0 || p.minAttempts > math.MaxInt32 {
		return usagef("--min-attempts must be between 0 and %d, got %d", math.MaxInt32, p.minAttempts)
	}
	if p.limit < 0 || p.limit > math.MaxInt32 {
		return usagef("--limit must be between 0 (no limit) and %d, got %d", math.MaxInt32, p.limit)
	}
	return nil
}

// printRecords prints the records a listing returned: as a JSON array, or as a table
// with a note when more records match beyond limit.
func (a *app) printRecords(records []*record, more bool, limit int) error {
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
		fmt.Fprintf(a.stdout, "(first %s; raise --limit for more)\n", count(limit, "record", "records"))
	}
	return nil
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

Forgetting a parked record (records list --status parked) is how its key is let run
again. A record in progress under a live lease (and not past its TTL) is refused: its holder
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

// record is one row of pgidem_record with times derived from the database clock. It is
// also the --json form of a record.
type record struct {
	Namespace   string  `json:"namespace"`
	Key         string  `json:"key"`
	Status      string  `json:"status"`
	Attempts    int     `json:"attempts"`
	TookOver    bool    `json:"took_over"`
	Owner       string  `json:"owner"`
	Fingerprint *string `json:"fingerprint"`
	// Result and Error are the stored JSON documents (null when absent).
	Result         rawJSON    `json:"result"`
	Error          rawJSON    `json:"error"`
	CreatedAt      time.Time  `json:"created_at"`
	UpdatedAt      time.Time  `json:"updated_at"`
	CompletedAt    *time.Time `json:"completed_at"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at"`
	ExpiresAt      time.Time  `json:"expires_at"`
	// AgeSeconds, LeaseRemainingSeconds and TTLRemainingSeconds are measured against the
	// database clock when the record was read; the remaining times are negative once
	// passed.
	AgeSeconds            float64  `json:"age_seconds"`
	LeaseRemainingSeconds *float64 `json:"lease_remaining_seconds"`
	TTLRemainingSeconds   float64  `json:"ttl_remaining_seconds"`
	Expired               bool     `json:"expired"`
	LeaseExpired          bool     `json:"lease_expired"`
}

// newRecord returns the record of namespace and key that row holds.
func newRecord(namespace, key string, row *pgstore.Row) *record {
	r := &record{
		Namespace: namespace, Key: key, Status: string(row.Status), Attempts: row.Attempts,
		TookOver: row.Attempts > 1, Owner: row.Owner.String(),
		Result: newRawJSON(row.Result), Error: newRawJSON(row.Failure),
		CreatedAt: row.CreatedAt, UpdatedAt: row.UpdatedAt, ExpiresAt: row.ExpiresAt,
		AgeSeconds:          seconds(row.DBNow.Sub(row.CreatedAt)),
		TTLRemainingSeconds: seconds(row.ExpiresAt.Sub(row.DBNow)),
		Expired:             row.Expired,
		LeaseExpired:        row.LeaseExpired,
	}
	if row.Fingerprint != nil {
		fingerprint := hex.EncodeToString(row.Fingerprint)
		r.Fingerprint = &fingerprint
	}
	if row.CompletedAt.Valid {
		r.CompletedAt = &row.CompletedAt.Time
	}
	if row.LeaseExpires.Valid {
		r.LeaseExpiresAt = &row.LeaseExpires.Time
		lease := seconds(row.LeaseExpires.Time.Sub(row.DBNow))
		r.LeaseRemainingSeconds = &lease
	}
	return r
}

// seconds returns d in seconds, as Postgres's extract(epoch FROM interval)::float8 gives
// it: the database's times are whole microseconds, and so is d.
func seconds(d time.Duration) float64 { return float64(d.Microseconds()) / 1e6 }

// live reports whether the record is in progress under a live lease: its holder may be
// running the effect right now.
func (r *record) live() bool {
	return r.Status == "in_progress" && !r.LeaseExpired && !r.Expired
}

// rawJSON is stored JSON text, emitted verbatim in --json output.
type rawJSON struct{ text *string }

// newRawJSON returns the stored JSON text b (nil: absent).
func newRawJSON(b []byte) rawJSON {
	if b == nil {
		return rawJSON{}
	}
	s := string(b)
	return rawJSON{&s}
}

// MarshalJSON implements json.Marshaler.
func (j rawJSON) MarshalJSON() ([]byte, error) {
	if j.text == nil {
		return []byte("null"), nil
	}
	return []byte(*j.text), nil
}

// String returns the JSON text, or "-" when absent.
func (j rawJSON) String() string {
	if j.text == nil {
		return "-"
	}
	return *j.text
}

// list returns the records f selects, newest first, at most f.Limit of them (0: all).
// more reports whether further records match beyond the limit; with f.Values it is always
// false (the --json output has no such note, so no extra record is read to tell). Without
// f.Values no result or error is read at all, and with it only those of the records
// returned (see store.Statements.ListRecords).
func (s *store) list(ctx context.Context, f *pgstore.RecordFilter) (records []*record, more bool, err error) {
	rows, more, err := s.sql.ListRecords(ctx, s.pool, f)
	if err != nil {
		return nil, false, s.translate(ctx, "list records", err)
	}
	for i := range rows {
		records = append(records, newRecord(rows[i].Namespace, rows[i].Key, &rows[i].Row))
	}
	return records, more, nil
}

// errNoRecord reports a (namespace, key) with no record.
func errNoRecord(namespace, key string) error {
	return fmt.Errorf("pgidem: no record for namespace %q key %q", namespace, key)
}

func (s *store) show(ctx context.Context, namespace, key string) (*record, error) {
	row, err := s.sql.ReadRecord(ctx, s.pool, namespace, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoRecord(namespace, key)
	}
	if err != nil {
		return nil, s.translate(ctx, "show record", err)
	}
	return newRecord(namespace, key, row), nil
}

// forget deletes the record for (namespace, key) and returns it, with the statement
// pgidem.Coordinator.Forget sends. It refuses a record in progress under a live lease
// unless force is true.
func (s *store) forget(ctx context.Context, namespace, key string, force bool) (*record, error) {
	conn, err := s.acquireToDelete(ctx, "forget record")
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	row, deleted, err := s.sql.ForgetRecord(ctx, conn, namespace, key, force)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w; nothing deleted", errNoRecord(namespace, key))
	}
	if err != nil {
		if ie := interruptedDelete(ctx, "forget record", err, commandLine([]string{"records", "show"}, namespace, key)); ie != nil {
			return nil, ie
		}
		return nil, s.translate(ctx, "forget record", err)
	}
	r := newRecord(namespace, key, row)
	if deleted {
		return r, nil
	}
	if r.live() {
		return nil, fmt.Errorf("pgidem: refusing to forget namespace %q key %q: it is in progress under a live lease (%s, owner %s), so its holder may be running the effect right now (a live holder keeps renewing its lease; the lease ends only once the holder is gone); try again after that, or pass --force if you know the holder is gone",
			namespace, key, "expires "+remaining(*r.LeaseRemainingSeconds), r.Owner)
	}
	return nil, fmt.Errorf("pgidem: namespace %q key %q changed while it was being forgotten (its holder renewed or took over the lease); nothing deleted; run the command again", namespace, key)
}
