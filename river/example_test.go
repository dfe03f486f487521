package pgidemriver_test

import (
	"context"
	"fmt"
	"log"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// InvoiceMailArgs name the effect their job performs: every job for one order sends one
// invoice mail.
type InvoiceMailArgs struct {
	OrderID int64 `json:"order_id"`
}

func (InvoiceMailArgs) Kind() string { return "example.invoice_mail" }

// IdempotencyKey implements pgidemriver.KeyArgs.
func (a InvoiceMailArgs) IdempotencyKey() string { return fmt.Sprintf("order-%d.invoice", a.OrderID) }

// InvoiceMailWorker "sends" the mail and records the provider's receipt.
type InvoiceMailWorker struct {
	river.WorkerDefaults[InvoiceMailArgs]
	sent atomic.Int32
}

func (w *InvoiceMailWorker) Work(ctx context.Context, job *river.Job[InvoiceMailArgs]) error {
	_, key, _ := pgidem.KeyFromContext(ctx) // hand it to the mail provider as its own key
	n := w.sent.Add(1)
	return pgidemriver.RecordOutput(ctx, fmt.Sprintf("em_%d for %s", n, key))
}

// A producer that retried enqueued the same invoice twice. The first job sends the mail;
// the second replays the first one's receipt without running the worker. The hook sees
// the middleware's action and pgidem's outcome of each job.
func ExampleMiddleware() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	if _, err := pgidemriver.MigrateRiver(ctx, db.Pool, nil); err != nil {
		log.Fatal(err)
	}

	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	outcomes := make(chan pgidemriver.Outcome, 2)
	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{
		Hook: pgidemriver.HookFunc(func(_ context.Context, out *pgidemriver.Outcome) { outcomes <- *out }),
	})
	if err != nil {
		log.Fatal(err)
	}
	workers := river.NewWorkers()
	worker := &InvoiceMailWorker{}
	pgidemriver.AddWorker(workers, mw, worker)
	client, err := river.NewClient(riverpgxv5.New(db.Pool), &river.Config{
		Logger:     slog.New(slog.DiscardHandler),
		Middleware: []rivertype.Middleware{mw},
		Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}},
		Workers:    workers,
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := client.Start(ctx); err != nil {
		log.Fatal(err)
	}
	defer func() {
		if err := client.Stop(ctx); err != nil {
			log.Fatal(err)
		}
	}()

	for range 2 {
		if _, err := client.Insert(ctx, InvoiceMailArgs{OrderID: 9}, nil); err != nil {
			log.Fatal(err)
		}
	}
	for range 2 {
		select {
		case out := <-outcomes:
			fmt.Printf("%s (pgidem: %s): %s\n", out.Action, out.Outcome, out.Output)
		case <-time.After(time.Minute):
			log.Fatal("no outcome")
		}
	}
	fmt.Println("mails sent:", worker.sent.Load())
	// Output:
	// executed (pgidem: executed): "em_1 for order-9.invoice"
	// replayed (pgidem: replayed): "em_1 for order-9.invoice"
	// mails sent: 1
}
