// Command consumer is a Kafka consumer that turns at-least-once delivery into one ledger row
// and one invoice mail per order, with pgidem's inbox for the row and an idempotency key for
// the mail.
//
//	go run ./examples/consumer     # or: make demo
//
// Kafka is real: an in-process kfake cluster speaks the Kafka protocol to franz-go (kgo)
// clients in the consumer group "billing"; nothing is mocked and nothing needs installing.
// The handler of an order.created event, in one database transaction, records the event
// in the inbox (pgidem.Coordinator.InboxHandle), writes a ledger row, and sends the invoice
// mail through pgidem.Do keyed "<order>.invoice" — the effect's identity, not the message's.
//
// Scene 1: one event reaches the handler three times — the original delivery; a crash
// before the offset commit, after which the rebalance replays the uncommitted batch to the
// next member; and the copy a producer retry put in the log. One ledger row, one mail.
//
// Scene 2: the handler sends the mail and the process dies before the database commit.
// The ledger row and the inbox row roll back, so the inbox alone would let the redelivery
// mail again; the key replays the mail from its record instead.
//
// It creates its own database on the server found like the tests find theirs
// (DATABASE_URL, libpq PG* variables, postgres://postgres@127.0.0.1:5432), migrates it, and
// drops it at the end.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/pgidem"
)

const (
	topic = "orders"
	group = "billing"
	// mailTTL outlives the topic's retention and every redelivery horizon.
	mailTTL = 7 * 24 * time.Hour
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

// sceneCounts are one scene's printed numbers.
type sceneCounts struct {
	Deliveries    int // times the handler received the order's event
	LedgerRows    int // ledger rows for the order
	MailsSent     int // invoice mails actually sent for the order
	MailsReplayed int // times the mail's record answered instead of the mailer
}

// counts are what run prints, for the test.
type counts struct {
	Redelivery     sceneCounts // scene 1: three deliveries of one event
	CrashAfterMail sceneCounts // scene 2: crash after the mail, before the commit
}

// orderCreated is the event's payload.
type orderCreated struct {
	Type        string `json:"type"`
	EventID     string `json:"event_id"`
	Order       string `json:"order"`
	AmountCents int    `json:"amount_cents"`
}

// mailer stands in for the mail provider: the effect outside the database.
type mailer struct {
	mu   sync.Mutex
	sent map[string]int // order → mails sent
}

func (m *mailer) sendInvoice(order, key string) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.sent[order]++
	// A real provider would get key as its own idempotency key.
	return fmt.Sprintf("mail-%s-%d", key, m.sent[order])
}

func (m *mailer) count(order string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sent[order]
}

// errCrash simulates the process dying inside the handler: Postgres rolls the open
// transaction back, the offset is never committed.
var errCrash = errors.New("process died before the database commit")

type app struct {
	w       io.Writer
	coord   *pgidem.Coordinator
	pool    *pgxpool.Pool
	brokers []string
	mailer  *mailer
	counts  map[string]*sceneCounts // order → its scene's counts
}

func run(ctx context.Context, w io.Writer) (counts, error) {
	var out counts
	scratch, err := dbserver.NewScratch(ctx, "pgidem_consumer_")
	if err != nil {
		return out, err
	}
	defer scratch.Close(ctx)
	pool := scratch.Pool
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (
		id bigserial PRIMARY KEY, order_id text NOT NULL, amount_cents int NOT NULL, event_id text NOT NULL)`); err != nil {
		return out, err
	}
	coord, err := pgidem.NewCoordinator(pool, nil)
	if err != nil {
		return out, err
	}

	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, topic))
	if err != nil {
		return out, err
	}
	defer cluster.Close()

	a := &app{w: w, coord: coord, pool: pool, brokers: cluster.ListenAddrs(),
		mailer: &mailer{sent: map[string]int{}},
		counts: map[string]*sceneCounts{"order-9": &out.Redelivery, "order-10": &out.CrashAfterMail}}
	if err := a.scene1(ctx); err != nil {
		return out, err
	}
	if err := a.scene2(ctx); err != nil {
		return out, err
	}
	for order, c := range a.counts {
		c.MailsSent = a.mailer.count(order)
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM ledger WHERE order_id = $1`, order).Scan(&c.LedgerRows); err != nil {
			return out, err
		}
	}
	fmt.Fprintf(w, "scene 1: deliveries=%d ledger rows=%d mails sent=%d\n",
		out.Redelivery.Deliveries, out.Redelivery.LedgerRows, out.Redelivery.MailsSent)
	fmt.Fprintf(w, "scene 2: deliveries=%d ledger rows=%d mails sent=%d mails replayed from their record=%d\n",
		out.CrashAfterMail.Deliveries, out.CrashAfterMail.LedgerRows, out.CrashAfterMail.MailsSent, out.CrashAfterMail.MailsReplayed)
	return out, nil
}

// scene1: the producer retries, member A crashes before committing its offset, and the
// rebalance hands A's uncommitted batch to member B.
func (a *app) scene1(ctx context.Context) error {
	fmt.Fprintln(a.w, "scene 1  one order.created event, three deliveries")
	ev := orderCreated{Type: "order.created", EventID: "evt-9", Order: "order-9", AmountCents: 4200}
	// The broker's ack is lost in a timeout, so the producer sends the event again: the
	// log holds two copies with the same event id.
	if err := a.produce(ctx, ev, ev); err != nil {
		return err
	}
	fmt.Fprintln(a.w, "  producer: ack timed out, event sent again (2 copies in the log)")

	memberA, err := a.member("A")
	if err != nil {
		return err
	}
	if _, err := a.consume(ctx, memberA, "A", 1, false, "first delivery"); err != nil {
		memberA.Close()
		return err
	}
	// Crash before the offset commit: the member goes away without committing.
	memberA.Close()
	fmt.Fprintln(a.w, "  member A dies before committing its offset")

	memberB, err := a.member("B")
	if err != nil {
		return err
	}
	defer memberB.Close()
	recs, err := a.consume(ctx, memberB, "B", 2, false, "rebalance replays A's uncommitted batch", "the producer's retry copy")
	if err != nil {
		return err
	}
	return memberB.CommitRecords(ctx, recs...)
}

// scene2: the handler sends the mail, then the process dies before the database commit.
func (a *app) scene2(ctx context.Context) error {
	fmt.Fprintln(a.w, "scene 2  crash after the mail, before the database commit")
	ev := orderCreated{Type: "order.created", EventID: "evt-10", Order: "order-10", AmountCents: 1300}
	if err := a.produce(ctx, ev); err != nil {
		return err
	}
	memberC, err := a.member("C")
	if err != nil {
		return err
	}
	_, err = a.consume(ctx, memberC, "C", 1, true, "first delivery")
	memberC.Close()
	if !errors.Is(err, errCrash) {
		return fmt.Errorf("scene 2: want the simulated crash, got %v", err)
	}
	fmt.Fprintln(a.w, "  member C dies: ledger row and inbox row roll back, the offset is not committed")

	memberD, err := a.member("D")
	if err != nil {
		return err
	}
	defer memberD.Close()
	recs, err := a.consume(ctx, memberD, "D", 1, false, "redelivery after the crash")
	if err != nil {
		return err
	}
	return memberD.CommitRecords(ctx, recs...)
}

func (a *app) produce(ctx context.Context, events ...orderCreated) error {
	producer, err := kgo.NewClient(kgo.SeedBrokers(a.brokers...), kgo.DefaultProduceTopic(topic))
	if err != nil {
		return err
	}
	defer producer.Close()
	for _, ev := range events {
		value, err := json.Marshal(ev)
		if err != nil {
			return err
		}
		rec := &kgo.Record{Key: []byte(ev.Order), Value: value,
			Headers: []kgo.RecordHeader{{Key: "event-id", Value: []byte(ev.EventID)}}}
		if err := producer.ProduceSync(ctx, rec).FirstErr(); err != nil {
			return fmt.Errorf("produce: %w", err)
		}
	}
	return nil
}

// member joins the consumer group. Offsets are committed by hand, after the handler's
// transaction committed: at-least-once delivery, made exactly-once by the handler.
func (a *app) member(name string) (*kgo.Client, error) {
	return kgo.NewClient(
		kgo.SeedBrokers(a.brokers...),
		kgo.ClientID("billing-"+name),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topic),
		kgo.DisableAutoCommit(),
		kgo.FetchMaxWait(100*time.Millisecond),
	)
}

// consume handles the next n records one by one and returns them; why labels each
// delivery. crashAfterMail makes the handler die after sending the mail.
func (a *app) consume(ctx context.Context, cl *kgo.Client, name string, n int, crashAfterMail bool, why ...string) ([]*kgo.Record, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < n {
		fetches := cl.PollRecords(ctx, 1)
		if err := fetches.Err0(); err != nil {
			return recs, fmt.Errorf("member %s: poll: %w", name, err)
		}
		for _, rec := range fetches.Records() {
			recs = append(recs, rec)
			label := why[min(len(recs), len(why))-1]
			if err := a.handle(ctx, name, rec, crashAfterMail, label); err != nil {
				return recs, err
			}
		}
	}
	return recs, nil
}

// handle is the consumer's handler: inbox for the ledger row, key for the mail, both in one
// transaction.
func (a *app) handle(ctx context.Context, member string, rec *kgo.Record, crashAfterMail bool, why string) error {
	var ev orderCreated
	if err := json.Unmarshal(rec.Value, &ev); err != nil {
		return err
	}
	var eventID string
	for _, h := range rec.Headers {
		if h.Key == "event-id" {
			eventID = string(h.Value)
		}
	}
	c := a.counts[ev.Order]
	c.Deliveries++
	prefix := fmt.Sprintf("  delivery %d  member %s  offset %d  %s  (%s): ", c.Deliveries, member, rec.Offset, eventID, why)

	var mail pgidem.Result[string]
	handle := func(ctx context.Context, tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO ledger (order_id, amount_cents, event_id) VALUES ($1, $2, $3)`,
			ev.Order, ev.AmountCents, eventID); err != nil {
			return err
		}
		var err error
		mail, err = pgidem.DoResult(ctx, a.coord, "mail", ev.Order+".invoice", mailTTL, nil,
			func(ctx context.Context) (string, error) {
				_, key, _ := pgidem.KeyFromContext(ctx)
				return a.mailer.sendInvoice(ev.Order, key), nil
			})
		if err != nil {
			return err
		}
		if crashAfterMail {
			return errCrash
		}
		return nil
	}
	handled, err := a.coord.InboxHandle(ctx, group, eventID, &pgidem.InboxOpts{Payload: rec.Value}, handle)
	if errors.Is(err, pgidem.ErrInvalidPayload) {
		// JSON that jsonb refuses (a \u0000 in a string, say) would fail every delivery:
		// record the message without its payload.
		handled, err = a.coord.InboxHandle(ctx, group, eventID, nil, handle)
	}
	mailNote := ""
	switch {
	case mail.Value == "":
	case mail.Replayed:
		c.MailsReplayed++
		mailNote = "invoice mail replayed from its record (" + mail.Value + "), not sent again"
	default:
		mailNote = "invoice mail sent (" + mail.Value + ")"
	}
	switch {
	case errors.Is(err, errCrash):
		fmt.Fprintln(a.w, prefix+"inbox new, ledger row written, "+mailNote+" — then the process dies")
		return err
	case err != nil:
		return err
	case !handled:
		fmt.Fprintln(a.w, prefix+"inbox duplicate, skipped")
	default:
		fmt.Fprintln(a.w, prefix+"inbox new, ledger row committed, "+mailNote)
	}
	return nil
}
