package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
)

func (a *app) inboxCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "inbox",
		Short: "List, show or forget inbox rows (messages a consumer has handled)",
		Long: `An inbox row says that a consumer handled a message: the handler's transaction
inserted it (pgidem.Coordinator.InboxHandle or InboxRecordTx) and committed it with the
handler's own rows, so a redelivered message finds it and is skipped. A row past its
retention (EXPIRES) counts as absent and is deleted by the sweep.`,
		Args: cobra.NoArgs,
		RunE: group,
	}
	cmd.AddCommand(a.inboxListCommand(), a.inboxShowCommand(), a.inboxForgetCommand())
	return cmd
}

// messageArgs checks the CONSUMER MESSAGE_ID arguments of inbox show and forget: two, each
// one pgidem could have stored (see checkKeyPart).
func messageArgs(cmd *cobra.Command, args []string) error {
	if err := exactArgs("CONSUMER", "MESSAGE_ID")(cmd, args); err != nil {
		return err
	}
	if err := checkKeyPart("CONSUMER", args[0]); err != nil {
		return err
	}
	return checkKeyPart("MESSAGE_ID", args[1])
}

func (a *app) inboxListCommand() *cobra.Command {
	var p inboxListParams
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List inbox rows, newest first",
		Long: `Lists inbox rows, newest first: the consumer, the message id, how long ago the
message was handled (RECEIVED) and the time left before the row expires (EXPIRES).
--expired lists the rows the next sweep deletes.

` + quotingNote,
		Example: `  pgidem inbox list --consumer billing
  pgidem inbox list --message-id evt_1042
  pgidem inbox list --expired --json`,
		Args: cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if err := checkFilter("--consumer", p.consumer); err != nil {
				return err
			}
			if err := checkFilter("--message-id", p.messageID); err != nil {
				return err
			}
			if cmd.Flags().Changed("consumer") && p.consumer == "" {
				return usagef("--consumer must not be empty (omit it to list every consumer)")
			}
			if cmd.Flags().Changed("message-id") && p.messageID == "" {
				return usagef("--message-id must not be empty (omit it to list every message)")
			}
			if p.limit < 0 || p.limit > math.MaxInt32 {
				return usagef("--limit must be between 0 (no limit) and %d, got %d", math.MaxInt32, p.limit)
			}
			return a.withStore(cmd.Context(), func(s *store) error {
				rows, more, err := s.inboxList(cmd.Context(), p)
				if err != nil {
					return err
				}
				if a.json {
					if rows == nil {
						rows = []*inboxRow{}
					}
					return printJSON(a.stdout, rows)
				}
				if len(rows) == 0 {
					fmt.Fprintln(a.stdout, "no inbox rows match")
					return nil
				}
				t := newTable(a.stdout, "CONSUMER", "MESSAGE ID", "RECEIVED", "EXPIRES")
				for _, r := range rows {
					t.row(quoteName(r.Consumer), quoteName(r.MessageID), humanDuration(r.AgeSeconds)+" ago", remaining(r.TTLRemainingSeconds))
				}
				if err := t.flush(); err != nil {
					return err
				}
				if more {
					fmt.Fprintf(a.stdout, "(first %s; raise --limit for more)\n", count(p.limit, "row", "rows"))
				}
				return nil
			})
		}),
	}
	flags := cmd.Flags()
	flags.StringVar(&p.consumer, "consumer", "", "only rows of this consumer")
	flags.StringVar(&p.messageID, "message-id", "", "only rows of this message id (every consumer that handled it)")
	flags.BoolVar(&p.expired, "expired", false, "only rows the next sweep deletes: past their retention")
	flags.IntVar(&p.limit, "limit", listLimitDefault, "print at most this many rows (0: all)")
	return cmd
}

func (a *app) inboxShowCommand() *cobra.Command {
	return &cobra.Command{
		Use:     "show CONSUMER MESSAGE_ID",
		Short:   "Show one inbox row in full, payload included",
		Long:    "Shows the inbox row for CONSUMER MESSAGE_ID in full, payload included.\n\n" + quotingNote,
		Example: "  pgidem inbox show billing msg-42\n  pgidem inbox show billing -- -msg-42   # a message id starting with '-'",
		Args:    messageArgs,
		RunE: a.action(func(cmd *cobra.Command, args []string) error {
			return a.withStore(cmd.Context(), func(s *store) error {
				r, err := s.inboxShow(cmd.Context(), args[0], args[1])
				if err != nil {
					return err
				}
				return a.printFound(r, false, func(w io.Writer) error { return printInboxRow(w, r) })
			})
		}),
	}
}

func (a *app) inboxForgetCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "forget CONSUMER MESSAGE_ID",
		Short: "Delete an inbox row so the message is handled again when it is redelivered",
		Long: `Deletes the inbox row for CONSUMER MESSAGE_ID and prints it, so that the next
delivery of the message runs its handler again: use it to reprocess a message by hand
after an incident. What the handler committed with the row stays; the next run adds to it.
A handler running right now has not committed its row yet, so the delete does not see it
(no inbox row): try again once it has. Interrupted (Ctrl-C), it says whether anything was
deleted, as records forget does.

` + quotingNote,
		Example: "  pgidem inbox forget billing msg-42",
		Args:    messageArgs,
		RunE: a.action(func(cmd *cobra.Command, args []string) error {
			return a.withStoreDeleting(cmd.Context(), func(s *store) error {
				r, err := s.inboxForget(cmd.Context(), args[0], args[1])
				if err != nil {
					return err
				}
				a.changed = "inbox forget deleted the inbox row"
				return a.printFound(r, true, func(w io.Writer) error { return printInboxRow(w, r) })
			})
		}),
	}
}

// printInboxRow prints one inbox row as aligned "field  value" lines.
func printInboxRow(w io.Writer, r *inboxRow) error {
	t := newTable(w, "consumer", quoteName(r.Consumer))
	t.row("message id", quoteName(r.MessageID))
	t.row("received", timestamp(r.ReceivedAt)+" ("+humanDuration(r.AgeSeconds)+" ago)")
	t.row("expires", timestamp(r.ExpiresAt)+" ("+remaining(r.TTLRemainingSeconds)+")")
	t.row("payload", r.Payload.String())
	return t.flush()
}

// inboxRow is one row of pgidem_inbox with times derived from the database clock. It is
// also the --json form of an inbox row.
type inboxRow struct {
	Consumer   string    `json:"consumer"`
	MessageID  string    `json:"message_id"`
	Payload    rawJSON   `json:"payload"`
	ReceivedAt time.Time `json:"received_at"`
	ExpiresAt  time.Time `json:"expires_at"`
	// AgeSeconds and TTLRemainingSeconds are measured against the database's now(); the
	// remaining time is negative once passed.
	AgeSeconds          float64 `json:"age_seconds"`
	TTLRemainingSeconds float64 `json:"ttl_remaining_seconds"`
	Expired             bool    `json:"expired"`
}

// inboxColumns selects an [inboxRow] from a relation aliased i.
const inboxColumns = `i.consumer, i.message_id, i.payload::text, i.received_at, i.expires_at,
	extract(epoch FROM now() - i.received_at)::float8,
	extract(epoch FROM i.expires_at - now())::float8`

func scanInboxRow(row pgx.Row) (*inboxRow, error) {
	var r inboxRow
	err := row.Scan(&r.Consumer, &r.MessageID, &r.Payload.text, &r.ReceivedAt, &r.ExpiresAt, &r.AgeSeconds, &r.TTLRemainingSeconds)
	if err != nil {
		return nil, err
	}
	r.Expired = r.TTLRemainingSeconds <= 0
	return &r, nil
}

// inboxListParams are the filters of inbox list.
type inboxListParams struct {
	consumer  string
	messageID string
	expired   bool
	limit     int
}

// inboxList returns the inbox rows matching p, newest first, at most p.limit of them (0:
// all); more reports whether further rows match beyond the limit.
func (s *store) inboxList(ctx context.Context, p inboxListParams) (rows []*inboxRow, more bool, err error) {
	// $1 (consumer, "" for any), $2 (message id, "" for any) and $3 (expired only) are
	// always bound; $4 is the limit.
	query := "SELECT " + inboxColumns + " FROM " + s.inbox + ` i
		WHERE ($1 = '' OR i.consumer = $1) AND ($2 = '' OR i.message_id = $2) AND (NOT $3 OR i.expires_at <= now())
		ORDER BY i.received_at DESC, i.consumer, i.message_id`
	args := []any{p.consumer, p.messageID, p.expired}
	if p.limit > 0 {
		// One more than asked for: whether it comes back says if more rows match.
		query += " LIMIT $4"
		args = append(args, p.limit+1)
	}
	result, err := s.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, false, s.translate(ctx, "list inbox rows", err)
	}
	rows, err = pgx.CollectRows(result, func(row pgx.CollectableRow) (*inboxRow, error) { return scanInboxRow(row) })
	if err != nil {
		return nil, false, s.translate(ctx, "list inbox rows", err)
	}
	if p.limit > 0 && len(rows) > p.limit {
		return rows[:p.limit], true, nil
	}
	return rows, false, nil
}

// errNoInboxRow reports a (consumer, message id) with no inbox row.
func errNoInboxRow(consumer, messageID string) error {
	return fmt.Errorf("pgidem: no inbox row for consumer %q message id %q", consumer, messageID)
}

func (s *store) inboxShow(ctx context.Context, consumer, messageID string) (*inboxRow, error) {
	query := "SELECT " + inboxColumns + " FROM " + s.inbox + " i WHERE i.consumer = $1 AND i.message_id = $2"
	r, err := scanInboxRow(s.pool.QueryRow(ctx, query, consumer, messageID))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoInboxRow(consumer, messageID)
	}
	if err != nil {
		return nil, s.translate(ctx, "show inbox row", err)
	}
	return r, nil
}

func (s *store) inboxForget(ctx context.Context, consumer, messageID string) (*inboxRow, error) {
	conn, err := s.acquireToDelete(ctx, "forget inbox row")
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	query := "DELETE FROM " + s.inbox + " i WHERE i.consumer = $1 AND i.message_id = $2 RETURNING " + inboxColumns
	r, err := scanInboxRow(conn.QueryRow(ctx, query, consumer, messageID))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w; nothing deleted", errNoInboxRow(consumer, messageID))
	}
	if err != nil {
		if ie := interruptedDelete(ctx, "forget inbox row", err, commandLine([]string{"inbox", "show"}, consumer, messageID)); ie != nil {
			return nil, ie
		}
		return nil, s.translate(ctx, "forget inbox row", err)
	}
	return r, nil
}
