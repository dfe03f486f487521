// Command reconcile shows DoOpts.Reconcile: a worker charges a card at a payment provider
// and dies before pgidem records the charge; the next delivery asks the provider, by the
// same idempotency key, whether the charge happened, and records it instead of charging
// twice.
//
//	go run ./examples/reconcile
//
// It creates its own database on the server found like the tests find theirs (DATABASE_URL,
// libpq PG* variables, postgres://postgres@127.0.0.1:5432), migrates it, and drops it at the
// end.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/pgidem"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "reconcile:", err)
		os.Exit(1)
	}
}

// provider is a fake payment provider that dedupes charges by idempotency key and can be
// asked about one, as Stripe-like APIs can.
type provider struct {
	mu      sync.Mutex
	charges map[string]string // idempotency key → charge id
}

func (p *provider) charge(key string, cents int) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	id := fmt.Sprintf("ch_%d_%d", len(p.charges)+1, cents)
	p.charges[key] = id
	return id
}

func (p *provider) lookup(key string) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	id, ok := p.charges[key]
	return id, ok
}

const (
	ttl   = 24 * time.Hour
	lease = time.Second
)

// result is what the run did, for the test.
type result struct {
	Charges  int
	ChargeID string
	Outcome  pgidem.Outcome
}

func run(ctx context.Context, w io.Writer) (result, error) {
	scratch, err := dbserver.NewScratch(ctx, "pgidem_reconcile_")
	if err != nil {
		return result{}, err
	}
	defer scratch.Close(ctx)
	p := &provider{charges: map[string]string{}}
	charge := func(ctx context.Context) (string, error) {
		_, key, _ := pgidem.KeyFromContext(ctx)
		return p.charge(key, 4200), nil
	}

	if err := crashAfterCharge(ctx, scratch.URL, p); err != nil {
		return result{}, err
	}
	fmt.Fprintln(w, "worker 1 charged the card and died before recording it")

	coord, err := pgidem.NewCoordinator(scratch.Pool, &pgidem.Config{Lease: lease})
	if err != nil {
		return result{}, err
	}
	opts := &pgidem.DoOpts{Reconcile: func(ctx context.Context, t pgidem.Takeover) (any, bool, error) {
		id, ok := p.lookup(t.Key)
		fmt.Fprintf(w, "worker 2 (attempt %d) asks the provider about %s: found=%v\n", t.Attempt, t.Key, ok)
		return id, ok, nil
	}}
	res, err := pgidem.DoResult(ctx, coord, "payments", "order-7.charge", ttl, opts, charge)
	if err != nil {
		return result{}, err
	}
	fmt.Fprintf(w, "worker 2 recorded %s (outcome %s); charges at the provider: %d\n", res.Value, res.Outcome, len(p.charges))
	return result{Charges: len(p.charges), ChargeID: res.Value, Outcome: res.Outcome}, nil
}

// crashAfterCharge plays worker 1: it reserves the key, charges the card, and then loses
// its database (its pool closes, as when the process dies), so the record stays in
// progress until its lease runs out.
func crashAfterCharge(ctx context.Context, url string, p *provider) error {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: lease, Logger: quiet})
	if err != nil {
		pool.Close()
		return err
	}
	charged := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(ctx, coord, "payments", "order-7.charge", ttl, nil, func(ctx context.Context) (string, error) {
			_, key, _ := pgidem.KeyFromContext(ctx)
			p.charge(key, 4200)
			close(charged)
			<-ctx.Done() // the process "dies" here: nothing after the charge is recorded
			return "", context.Cause(ctx)
		})
		done <- err
	}()
	<-charged
	pool.Close()
	if err := <-done; !errors.Is(err, pgidem.ErrLeaseLost) {
		return fmt.Errorf("worker 1 ended with %v, want a lost lease", err)
	}
	return nil
}
