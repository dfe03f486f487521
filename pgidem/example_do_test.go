package pgidem_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// A worker sends an invoice mail under a key that names the effect. The queue redelivers the
// job (the worker died before acking): the second delivery replays the receipt instead of
// sending a second mail.
func ExampleDo() {
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
	sendInvoice := func(ctx context.Context) (string, error) {
		_, key, _ := pgidem.KeyFromContext(ctx) // hand it to the mail provider as its own key
		sent++
		return fmt.Sprintf("em_%d for %s", sent, key), nil
	}
	for delivery := 1; delivery <= 2; delivery++ {
		res, err := pgidem.DoResult(ctx, coord, "mail", "order-9.invoice", 24*time.Hour, nil, sendInvoice)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("delivery %d: %s (replayed=%t)\n", delivery, res.Value, res.Replayed)
	}
	fmt.Println("mails sent:", sent)
	// Output:
	// delivery 1: em_1 for order-9.invoice (replayed=false)
	// delivery 2: em_1 for order-9.invoice (replayed=true)
	// mails sent: 1
}

// An ordinary error releases the key so the next delivery tries again; a Permanent one is
// stored and replayed.
func ExamplePermanent() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true)
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	charge := func(context.Context) (string, error) {
		return "", pgidem.Permanent(errors.New("card declined"))
	}
	for range 2 {
		res, err := pgidem.DoResult(ctx, coord, "payments", "order-9.charge", 24*time.Hour, nil, charge)
		fmt.Printf("err=%v permanent=%t replayed=%t\n", err, errors.Is(err, pgidem.ErrPermanent), res.Replayed)
	}
	// Output:
	// err=card declined permanent=true replayed=false
	// err=card declined permanent=true replayed=true
}

// An unstorable key is rejected before anything runs: it never means an unprotected effect.
func ExampleDo_invalidKey() {
	ctx := context.Background()
	db, drop, err := testdb.Create(ctx, true)
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		log.Fatal(err)
	}
	_, err = pgidem.Do(ctx, coord, "mail", "order-9\x00invoice", 24*time.Hour, nil,
		func(context.Context) (string, error) { panic("not reached") })
	fmt.Println(errors.Is(err, pgidem.ErrInvalidKey))
	fmt.Println(err)
	// Output:
	// true
	// pgidem: invalid idempotency key: key contains control character U+0000 at byte 7
}
