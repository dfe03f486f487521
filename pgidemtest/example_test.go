package pgidemtest_test

import (
	"context"
	"fmt"
	"log"
	"strings"
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

// printT stands in for a test function's *testing.T here: it prints what a failing
// helper reports, where t would fail the test (without the record's expiry time, which
// differs from run to run).
type printT struct{}

func (printT) Errorf(format string, args ...any) {
	msg, _, _ := strings.Cut(fmt.Sprintf(format, args...), ", expires")
	fmt.Println(msg)
}
func (printT) FailNow() {}
func (printT) Helper()  {}

// A test delivers the same work twice and asks the record what happened: completed once,
// with the first delivery's receipt. In a test, pass the test function's t as tb.
func ExampleRequireCompleted() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // in your tests: a database with pgidem's migrations
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
	fmt.Println("mails sent:", sent)

	var t printT
	rec := pgidemtest.RequireCompleted(ctx, t, coord, "mail", "order-9.invoice",
		&pgidemtest.RequireOpts{Attempts: 1, Result: "em_1"}) // passes: prints nothing
	fmt.Printf("record %s with %s\n", rec.Status, rec.Result)
	pgidemtest.RequireNoRecord(ctx, t, coord, "mail", "order-10.invoice") // passes
	// A wrong expectation fails the test and shows the record:
	pgidemtest.RequireCompleted(ctx, t, coord, "mail", "order-9.invoice", &pgidemtest.RequireOpts{Result: "em_2"})
	// Output:
	// mails sent: 1
	// record completed with "em_1"
	// pgidemtest: mail/order-9.invoice: want the result "em_2"; found status completed, attempts 1, result "em_1"
}
