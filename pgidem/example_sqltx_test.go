package pgidem_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver; lib/pq works the same

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// dbtx and queries are what sqlc generates for database/sql: queries run on a *sql.DB or,
// through WithTx, on a *sql.Tx.
type dbtx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

type queries struct{ db dbtx }

func (q *queries) WithTx(tx *sql.Tx) *queries { return &queries{db: tx} }

const createPayment = `INSERT INTO payments (order_ref, cents) VALUES ($1, $2) RETURNING id`

func (q *queries) CreatePayment(ctx context.Context, orderRef string, cents int64) (int64, error) {
	var id int64
	err := q.db.QueryRowContext(ctx, createPayment, orderRef, cents).Scan(&id)
	return id, err
}

// A consumer that writes its rows through database/sql (here sqlc-style generated code)
// records the payment and pgidem's record in the same *sql.Tx. The message is delivered
// twice: the second transaction replays the first payment's id instead of inserting a
// second row.
func ExampleDoSQLTx() {
	ctx := context.Background()
	tdb, drop, err := testdb.Create(ctx, true) // a fresh database with pgidem's migrations
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(tdb.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	db, err := sql.Open("pgx", tdb.URL)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE payments (id bigserial PRIMARY KEY, order_ref text, cents bigint)`); err != nil {
		log.Fatal(err)
	}
	q := &queries{db: db}

	handle := func(orderRef string, cents int64) (pgidem.Result[int64], error) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return pgidem.Result[int64]{}, err
		}
		defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op
		res, err := pgidem.DoSQLTxResult(ctx, coord, tx, "payments", orderRef+".capture", 24*time.Hour, nil,
			func(ctx context.Context, tx *sql.Tx) (int64, error) {
				return q.WithTx(tx).CreatePayment(ctx, orderRef, cents)
			})
		if err != nil {
			return res, err
		}
		return res, tx.Commit() // the payment row and the record commit together
	}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := handle("order-9", 4200)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: payment %d (%s)\n", delivery, res.Value, res.Outcome)
	}
	var rows int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM payments`).Scan(&rows); err != nil {
		log.Fatal(err)
	}
	fmt.Println("payment rows:", rows)
	// Output:
	// delivery 1: payment 1 (executed)
	// delivery 2: payment 1 (replayed)
	// payment rows: 1
}
