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

	pgstore "github.com/pgidem/pgidem/internal/store"
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
	var p pgstore.InboxFilter
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
			if err := checkFilter("--consumer", p.Consumer); err != nil {
				return err
			}
			if err := checkFilter("--message-id", p.MessageID); err != nil {
				return err
			}
			if cmd.Flags().Changed("consumer") && p.Consumer == "" {
				return usagef("--consumer must not be empty (omit it to list every consumer)")
			}
			if cmd.Flags().Changed("message-id") && p.MessageID == "" {
				return usagef("--message-id must not be empty (omit it to list every message)")
			}
			if p.Limit < 0 || p.Limit > math.MaxInt32 {
				return usagef("--limit must be between 0 (no limit) and %d, got %d", math.MaxInt32, p.Limit)
			}
			return a.withStore(cmd.Context(), func(s *store) error {
				rows, more, err := s.inboxList(cmd.Context(), &p)
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
					fmt.Fprintf(a.stdout, "(first %s; raise --limit for more)\n", count(p.Limit, "row", "rows"))
				}
				return nil
			})
		}),
	}
	flags := cmd.Flags()
	flags.StringVar(&p.Consumer, "consumer", "", "only rows of this consumer")
	flags.StringVar(&p.MessageID, "message-id", "", "only rows of this message id (every consumer that handled it)")
	flags.BoolVar(&p.Expired, "expired", false, "only rows the next sweep deletes: past their retention")
	flags.IntVar(&p.Limit, "limit", listLimitDefault, "print at most this many rows (0: all)")
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
	// AgeSeconds and TTLRemainingSeconds are measured against the database clock when the
	// row was read; the remaining time is negative once passed.
	AgeSeconds          float64 `json:"age_seconds"`
	TTLRemainingSeconds float64 `json:"ttl_remaining_seconds"`
	Expired             bool    `json:"expired"`
}

// newInboxRow returns the --json form of row.
func newInboxRow(row *pgstore.InboxRow) *inboxRow {
	return &inboxRow{
		Consumer: row.Consumer, MessageID: row.MessageID, Payload: newRawJSON(row.Payload),
		ReceivedAt: row.ReceivedAt, ExpiresAt: row.ExpiresAt,
		AgeSeconds:          seconds(row.DBNow.Sub(row.ReceivedAt)),
		TTLRemainingSeconds: seconds(row.ExpiresAt.Sub(row.DBNow)),
		Expired:             row.Expired,
	}
}

// inboxList returns the inbox rows f selects, newest first, at most f.Limit of them (0:
// all); more reports whether further rows match beyond the limit.
func (s *store) inboxList(ctx context.Context, f *pgstore.InboxFilter) (rows []*inboxRow, more bool, err error) {
	read, more, err := s.sql.ListInbox(ctx, s.pool, f)
	if err != nil {
		return nil, false, s.translate(ctx, "list inbox rows", err)
	}
	for i := range read {
		rows = append(rows, newInboxRow(&read[i]))
	}
	return rows, more, nil
}

// errNoInboxRow reports a (consumer, message id) with no inbox row.
func errNoInboxRow(consumer, messageID string) error {
	return fmt.Errorf("pgidem: no inbox row for consumer %q message id %q", consumer, messageID)
}

func (s *store) inboxShow(ctx context.Context, consumer, messageID string) (*inboxRow, error) {
	r, err := s.sql.ReadInbox(ctx, s.pool, consumer, messageID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoInboxRow(consumer, messageID)
	}
	if err != nil {
		return nil, s.translate(ctx, "show inbox row", err)
	}
	return newInboxRow(r), nil
}

func (s *store) inboxForget(ctx context.Context, consumer, messageID string) (*inboxRow, error) {
	conn, err := s.acquireToDelete(ctx, "forget inbox row")
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	r, err := s.sql.ForgetInbox(ctx, conn, consumer, messageID)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w; nothing deleted", errNoInboxRow(consumer, messageID))
	}
	if err != nil {
		if ie := interruptedDelete(ctx, "forget inbox row", err, commandLine([]string{"inbox", "show"}, consumer, messageID)); ie != nil {
			return nil, ie
		}
		return nil, s.translate(ctx, "forget inbox row", err)
	}
	return newInboxRow(r), nil
}
