// Command lab reproduces the three redelivery scenes that make effects run twice, on real
// Postgres with an in-process queue that delivers at least once (visibility timeout, ack,
// redelivery), and shows what an idempotency key held by pgidem changes.
//
//	go run ./examples/lab     # or: make demo
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
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/pgidem"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "lab:", err)
		os.Exit(1)
	}
}

// row is one printed line's numbers, for the test.
type row struct {
	Scene      int
	Name       string
	Deliveries int
	Mails      int
	Receipts   map[string]string // worker → receipt (scene 2)
	Err        error             // the error a worker got (invalid key row)
	Unacked    int               // jobs left unacknowledged
}

// lab holds what every scene shares.
type lab struct {
	coord *pgidem.Coordinator
	w     io.Writer
}

// mailer counts the invoice mails it sends: the side effect that must happen once.
type mailer struct {
	sent  atomic.Int32
	delay time.Duration
}

func (m *mailer) send(order int) string {
	time.Sleep(m.delay)
	return fmt.Sprintf("em_%d", m.sent.Add(1))
}

const ttl = 24 * time.Hour

func run(ctx context.Context, w io.Writer) ([]row, error) {
	scratch, err := dbserver.NewScratch(ctx, "pgidem_lab_")
	if err != nil {
		return nil, err
	}
	defer scratch.Close(ctx)
	pool := scratch.Pool

	// A short lease keeps the raise row's retry quick; the heartbeat keeps slow workers'
	// reservations alive however long they run.
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: time.Second})
	if err != nil {
		return nil, err
	}
	l := &lab{coord: coord, w: w}
	var rows []row
	for _, scene := range []func(context.Context) ([]row, error){l.scene1, l.scene2, l.scene3} {
		r, err := scene(ctx)
		if err != nil {
			return rows, err
		}
		rows = append(rows, r...)
	}
	return rows, nil
}

// scene1: the worker sends the invoice and dies before acking; the queue redelivers.
func (l *lab) scene1(ctx context.Context) ([]row, error) {
	fmt.Fprintln(l.w, "scene 1  crash before the ack: the worker sends the mail and dies before acking")
	var rows []row
	for _, keyed := range []bool{false, true} {
		q := newQueue(100 * time.Millisecond)
		m := &mailer{}
		q.enqueue(9)
		handle := func(d delivery) error {
			if !keyed {
				m.send(d.order)
				return nil
			}
			_, err := pgidem.Do(ctx, l.coord, "scene1", fmt.Sprintf("job-%d", d.jobID), ttl, nil,
				func(context.Context) (string, error) { return m.send(d.order), nil })
			return err
		}
		// First delivery: the effect happens, then the worker crashes (no ack).
		d, _ := q.receiveWait(time.Second)
		if err := handle(d); err != nil {
			return nil, err
		}
		// The redelivery after the visibility timeout, to a healthy worker that acks.
		d, _ = q.receiveWait(time.Second)
		if err := handle(d); err != nil {
			return nil, err
		}
		q.ack(d)
		deliveries := q.deliveries()
		name := "plain handler"
		if keyed {
			name = "handler under an idempotency key = job id"
		}
		r := row{Scene: 1, Name: name, Deliveries: deliveries, Mails: int(m.sent.Load())}
		fmt.Fprintf(l.w, "  %-44s deliveries=%d mails sent=%d\n", name, r.Deliveries, r.Mails)
		rows = append(rows, r)
	}
	return rows, nil
}

// scene2: the visibility timeout expires while worker A is still sending; worker B receives
// the same job and runs it in parallel.
func (l *lab) scene2(ctx context.Context) ([]row, error) {
	fmt.Fprintln(l.w, "scene 2  two workers, one job: the visibility timeout expires while worker A still runs")
	var rows []row
	for _, policy := range []pgidem.InFlightPolicy{pgidem.InFlightWait, pgidem.InFlightRaise} {
		q := newQueue(150 * time.Millisecond)
		m := &mailer{delay: 600 * time.Millisecond} // a slow mail server
		q.enqueue(9)
		opts := &pgidem.DoOpts{InFlight: policy}
		handle := func(d delivery) (pgidem.Result[string], error) {
			return pgidem.DoResult(ctx, l.coord, "scene2-"+policy.String(), "order-9.invoice", ttl, opts,
				func(context.Context) (string, error) { return m.send(d.order), nil })
		}

		receipts := map[string]string{}
		var mu sync.Mutex
		record := func(worker, receipt string) {
			mu.Lock()
			receipts[worker] = receipt
			mu.Unlock()
		}
		var wg sync.WaitGroup
		var firstErr error
		worker := func(name string, d delivery) {
			res, err := handle(d)
			receipt := res.Value
			if res.Replayed && name >= "C" {
				receipt += " (replayed)"
			}
			var inProgress *pgidem.InProgressError
			switch {
			case errors.As(err, &inProgress):
				record(name, "in progress, requeued")
				q.requeue(d, inProgress.RetryAfter)
			case err != nil:
				mu.Lock()
				firstErr = errors.Join(firstErr, err)
				mu.Unlock()
			default:
				record(name, receipt)
				q.ack(d) // A's ack is refused: its receipt went stale when B received the job
			}
		}
		dA, _ := q.receiveWait(time.Second)
		wg.Go(func() { worker("A", dA) })
		dB, _ := q.receiveWait(time.Second) // visible again after the timeout
		wg.Go(func() { worker("B", dB) })
		wg.Wait()
		if firstErr != nil {
			return nil, firstErr
		}
		// Whoever is left unacked is redelivered: under raise, B's requeue comes back.
		for names := []string{"C", "D", "E"}; q.pending() > 0 && len(names) > 0; names = names[1:] {
			d, ok := q.receiveWait(3 * time.Second)
			if !ok {
				break
			}
			worker(names[0], d)
			if firstErr != nil {
				return nil, firstErr
			}
		}
		deliveries := q.deliveries()
		r := row{Scene: 2, Name: "in_flight=" + policy.String(), Deliveries: deliveries, Mails: int(m.sent.Load()), Receipts: receipts}
		fmt.Fprintf(l.w, "  %-44s %s mails sent=%d\n", r.Name, formatReceipts(receipts), r.Mails)
		rows = append(rows, r)
	}
	return rows, nil
}

func formatReceipts(receipts map[string]string) string {
	var parts []string
	for _, name := range []string{"A", "B", "C", "D", "E"} {
		if v, ok := receipts[name]; ok {
			parts = append(parts, name+": "+v)
		}
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// scene3: a retrying producer enqueues two jobs for order 9; what the key is made of
// decides whether the invoice goes out twice.
func (l *lab) scene3(ctx context.Context) ([]row, error) {
	fmt.Fprintln(l.w, "scene 3  what the key is made of: a retrying producer enqueues two jobs for order 9")
	var rows []row
	for i, tc := range []struct {
		name string
		key  func(d delivery) string
	}{
		{"key = job id", func(d delivery) string { return fmt.Sprintf("job-%d", d.jobID) }},
		{"key = order-9:invoice (no reserved chars)", func(d delivery) string { return fmt.Sprintf("order-%d:invoice", d.order) }},
		{"key = order-9.invoice", func(d delivery) string { return fmt.Sprintf("order-%d.invoice", d.order) }},
		{`key = "order-9\x00invoice" (invalid)`, func(d delivery) string { return fmt.Sprintf("order-%d\x00invoice", d.order) }},
	} {
		q := newQueue(time.Hour)
		m := &mailer{}
		q.enqueue(9)
		q.enqueue(9) // the producer's retry
		var lastErr error
		for {
			d, ok := q.receive()
			if !ok {
				break
			}
			_, err := pgidem.Do(ctx, l.coord, fmt.Sprintf("scene3-%d", i), tc.key(d), ttl, nil,
				func(context.Context) (string, error) { return m.send(d.order), nil })
			if err != nil {
				// Fail loudly: no ack, so the job stays in the queue to be retried or
				// dead-lettered; the effect never runs unprotected.
				lastErr = err
				continue
			}
			q.ack(d)
		}
		deliveries := q.deliveries()
		r := row{Scene: 3, Name: tc.name, Deliveries: deliveries, Mails: int(m.sent.Load()), Err: lastErr, Unacked: q.pending()}
		if lastErr != nil && !errors.Is(lastErr, pgidem.ErrInvalidKey) {
			return nil, lastErr
		}
		if lastErr != nil {
			fmt.Fprintf(l.w, "  %-44s ErrInvalidKey, mails sent=%d, jobs left unacked=%d (fails loudly, never unprotected)\n", r.Name, r.Mails, r.Unacked)
		} else {
			fmt.Fprintf(l.w, "  %-44s mails sent=%d\n", r.Name, r.Mails)
		}
		rows = append(rows, r)
	}
	return rows, nil
}
