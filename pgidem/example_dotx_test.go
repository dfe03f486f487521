package pgidem_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// A payment job books its ledger row and the key's record in one transaction: both commit
// together or not at all. The redelivered job replays the booking's id without a second
// ledger row.
func ExampleDoTx() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, ref text, cents bigint)`); err != nil {
		log.Fatal(err)
	}
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	book := func(ctx context.Context, tx pgx.Tx) (int64, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO ledger (ref, cents) VALUES ('order-9', 4200) RETURNING id`).Scan(&id)
		return id, err
	}
	for delivery := 1; delivery <= 2; delivery++ {
		tx, err := db.Pool.Begin(ctx)
		if err != nil {
			log.Fatal(err)
		}
		res, err := pgidem.DoTxResult(ctx, coord, tx, "ledger", "order-9.book", 24*time.Hour, nil, book)
		if err != nil {
			_ = tx.Rollback(ctx)
			log.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: booking %d (replayed=%t)\n", delivery, res.Value, res.Replayed)
	}
	var rows int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("ledger rows:", rows)
	// Output:
	// delivery 1: booking 1 (replayed=false)
	// delivery 2: booking 1 (replayed=true)
	// ledger rows: 1
}
