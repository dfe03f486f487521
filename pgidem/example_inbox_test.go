package pgidem_test

import (
	"context"
	"fmt"
	"log"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// A consumer applies each message's writes once: InboxHandle records the message id and
// runs the handler in the same transaction, so a redelivered message is skipped.
func ExampleCoordinator_InboxHandle() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE stock (sku text PRIMARY KEY, qty int)`); err != nil {
		log.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `INSERT INTO stock VALUES ('mug', 10)`); err != nil {
		log.Fatal(err)
	}
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	reserveMug := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE stock SET qty = qty - 1 WHERE sku = 'mug'`)
		return err
	}
	opts := &pgidem.InboxOpts{Payload: []byte(`{"sku":"mug","qty":1}`)}
	for delivery := 1; delivery <= 2; delivery++ {
		handled, err := coord.InboxHandle(ctx, "stock-service", "msg-41", opts, reserveMug)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: handled=%t\n", delivery, handled)
	}
	var qty int
	if err := db.Pool.QueryRow(ctx, `SELECT qty FROM stock WHERE sku = 'mug'`).Scan(&qty); err != nil {
		log.Fatal(err)
	}
	fmt.Println("mugs left:", qty)
	// Output:
	// delivery 1: handled=true
	// delivery 2: handled=false
	// mugs left: 9
}
