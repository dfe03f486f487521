package pgidemtest_test

import (
	"context"
	"fmt"
	"log"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	"github.com/pgidem/pgidem/pgidemtest"
)

// sendInvoice is the code under test: it mails an order's invoice once, however often it
// is delivered.
func sendInvoice(ctx context.Context, coord *pgidem.Coordinator, order int, sent *int) (string, error) {
	return pgidem.Do(ctx, coord, "mail", fmt.Sprintf("order-%d.invoice", order), 24*time.Hour, nil,
		func(context.Context) (string, error) {
			*sent++
			return fmt.Sprintf("em_%d", *sent), nil
		})
}

// A test delivers the same work twice and asks the record what happened: completed once,
// with the first delivery's receipt. In a test function, pass its *testing.T as tb.
func ExampleRequireCompleted() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}

	sent := 0
	for range 2 {
		if _, err := sendInvoice(ctx, coord, 9, &sent); err != nil {
			log.Fatal(err)
		}
	}

	var tb testing.TB = &testing.T{} // a test function's t
	rec := pgidemtest.RequireCompleted(ctx, tb, coord, "mail", "order-9.invoice",
		&pgidemtest.RequireOpts{Attempts: 1, Result: "em_1"})
	pgidemtest.RequireNoRecord(ctx, tb, coord, "mail", "order-10.invoice")
	fmt.Printf("mails sent: %d, record %s with %s\n", sent, rec.Status, rec.Result)
	// Output:
	// mails sent: 1, record completed with "em_1"
}
