// Command riverworker runs an invoice mailer on a real River queue with pgidem's River
// integration (package pgidemriver), then plays the lab's three redelivery scenes on River
// itself: River's stuck-job rescuer is the visibility timeout, and a worker process killed
// with SIGKILL (this program re-executed as a child) is the crash.
//
//	go run ./examples/riverworker     # or: make demo
//
// It creates its own database on the server found like the tests find theirs
// (DATABASE_URL, libpq PG* variables, postgres://postgres@127.0.0.1:5432), runs pgidem's
// and River's migrations, and drops it at the end. A mail is a row in a mails table (it
// survives the worker process, like a mail handed to a provider); its receipt is em_<n>.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/internal/dbserver"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// childEnv, when set to "<database URL> <queue>", makes this program the crashing worker
// of scene 1 instead of the demo.
const childEnv = "RIVERWORKER_CHILD"

func main() {
	if spec := os.Getenv(childEnv); spec != "" {
		runChild(spec)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	if _, err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "riverworker:", err)
		os.Exit(1)
	}
}

// InvoiceArgs is the mail.invoice job: send order OrderID's invoice. Its key names the
// effect — the order's invoice — so a redelivery and a second job for the same order both
// replay the first mail.
type InvoiceArgs struct {
	OrderID int64 `json:"order_id"`
	// Scene and KeyStyle exist for the scenes: Scene isolates each row's records (the
	// namespace), KeyStyle varies what the key is made of.
	Scene    string `json:"scene,omitempty"`
	KeyStyle string `json:"key_style,omitempty"` // "" → order-9.invoice, "colon" → order-9:invoice, "nul" → invalid
}

// Kind is the job kind.
func (InvoiceArgs) Kind() string { return "mail.invoice" }

// IdempotencyKey names the effect: one invoice per order.
func (a InvoiceArgs) IdempotencyKey() string {
	switch a.KeyStyle {
	case "colon":
		return fmt.Sprintf("order-%d:invoice", a.OrderID)
	case "nul": // a key that cannot be stored: the job fails loudly, no mail
		return fmt.Sprintf("order-%d\x00invoice", a.OrderID)
	}
	return fmt.Sprintf("order-%d.invoice", a.OrderID)
}

// IdempotencyNamespace keeps each scene's records apart; the real job uses its kind.
func (a InvoiceArgs) IdempotencyNamespace() string { return a.Scene }

// IdempotencyTTL keeps invoice records for 8 days: longer than this client's retry
// schedule (5 attempts) plus River's 7 days of discarded-job retention, so CheckTTL is
// quiet.
func (InvoiceArgs) IdempotencyTTL() time.Duration { return 8 * 24 * time.Hour }

// InsertOpts gives invoices 5 attempts.
func (InvoiceArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{MaxAttempts: 5} }

// jobIDInvoiceArgs is the same job without a key: the middleware falls back to the job id.
type jobIDInvoiceArgs struct {
	OrderID int64 `json:"order_id"`
}

func (jobIDInvoiceArgs) Kind() string { return "mail.invoice" }

// orderArgs lets one worker serve both args types.
type orderArgs interface {
	river.JobArgs
	order() int64
}

func (a InvoiceArgs) order() int64      { return a.OrderID }
func (a jobIDInvoiceArgs) order() int64 { return a.OrderID }

// mailWorker sends the invoice mail: a row in mails, numbered per scene row, whose receipt
// it records as the job's output. slow, when set, runs after the mail is sent (scene 2).
type mailWorker[T orderArgs] struct {
	river.WorkerDefaults[T]
	pool *pgxpool.Pool
	row  string
	slow func(ctx context.Context)
	// coord, when set, also writes the invoice row with WorkInTx (the main demo).
	coord *pgidem.Coordinator
}

func (w *mailWorker[T]) Work(ctx context.Context, job *river.Job[T]) error {
	receipt, err := sendMail(context.WithoutCancel(ctx), w.pool, w.row, job.Args.order())
	if err != nil {
		return err
	}
	if err := pgidemriver.RecordOutput(ctx, receipt); err != nil {
		return err
	}
	if w.slow != nil {
		w.slow(ctx)
	}
	if w.coord == nil {
		return nil
	}
	// The invoice row, its record and the job's completion commit together. Its namespace
	// differs from the middleware's, which holds the mail's key.
	_, err = pgidemriver.WorkInTx(ctx, w.coord, job, "invoices", fmt.Sprintf("order-%d", job.Args.order()), 8*24*time.Hour, nil,
		func(ctx context.Context, tx pgx.Tx) (int64, error) {
			var id int64
			err := tx.QueryRow(ctx, "INSERT INTO invoices (order_id, receipt) VALUES ($1, $2) RETURNING id", job.Args.order(), receipt).Scan(&id)
			return id, err
		})
	return err
}

// sendMail "sends" a mail: a committed row, numbered per row, receipt em_<n>.
func sendMail(ctx context.Context, pool *pgxpool.Pool, row string, order int64) (string, error) {
	var n int
	err := pool.QueryRow(ctx, `INSERT INTO mails (row_name, order_id, n)
		SELECT $1, $2, count(*) + 1 FROM mails WHERE row_name = $1 RETURNING n`, row, order).Scan(&n)
	return fmt.Sprintf("em_%d", n), err
}

const schema = `
CREATE TABLE mails (id bigserial PRIMARY KEY, row_name text NOT NULL, order_id bigint NOT NULL, n int NOT NULL);
CREATE TABLE invoices (id bigserial PRIMARY KEY, order_id bigint NOT NULL, receipt text NOT NULL);`

// Row is one printed line's numbers, for the test.
type Row struct {
	Scene      int
	Name       string
	Deliveries int               // executions of the job(s), snoozes included
	Mails      int               // mails sent
	Receipts   map[string]string // execution (A, B, C) → receipt (scene 2)
	Err        error             // the error River got (invalid key row)
	Unfinished int               // jobs not completed (invalid key row)
	Invoices   int               // invoice rows (the main demo)
	Swept      int64             // expired records the sweeper deleted (the main demo)
}

// demo holds what every part shares.
type demo struct {
	pool *pgxpool.Pool
	url  string
	w    io.Writer
}

func run(ctx context.Context, w io.Writer) ([]Row, error) {
	scratch, err := dbserver.NewScratch(ctx, "pgidem_riverworker_")
	if err != nil {
		return nil, err
	}
	defer scratch.Close(ctx)
	// River's migrations under pgidem's advisory lock, then the demo's own tables.
	if _, err := pgidemriver.MigrateRiver(ctx, scratch.Pool, nil); err != nil {
		return nil, err
	}
	if _, err := scratch.Pool.Exec(ctx, schema); err != nil {
		return nil, err
	}
	d := &demo{pool: scratch.Pool, url: scratch.URL, w: w}
	var rows []Row
	for _, part := range []func(context.Context) ([]Row, error){d.invoices, d.scene1, d.scene2, d.scene3} {
		r, err := part(ctx)
		rows = append(rows, r...)
		if err != nil {
			return rows, err
		}
	}
	return rows, nil
}

// newCoordinator returns a coordinator with a short lease (so a snooze — the holder's
// remaining lease — is short) and hook, if not nil.
func (d *demo) newCoordinator(hook pgidem.Hook) (*pgidem.Coordinator, error) {
	return pgidem.NewCoordinator(d.pool, &pgidem.Config{Lease: time.Second, Hook: hook})
}

// clientConfig is the River config every part uses: fast polling for a demo, River's own
// logs off, and River's staggered maintenance start-up off (TestOnly) so the rescuer runs
// as soon as a client is elected leader.
func clientConfig(queue string, workers *river.Workers, middleware ...rivertype.Middleware) *river.Config {
	return &river.Config{
		FetchCooldown:        10 * time.Millisecond,
		FetchPollInterval:    50 * time.Millisecond,
		JobTimeout:           time.Second,
		Logger:               slog.New(slog.DiscardHandler),
		MaxAttempts:          5,
		Middleware:           middleware,
		Queues:               map[string]river.QueueConfig{queue: {MaxWorkers: 2}},
		RescueStuckJobsAfter: 2 * time.Second,
		TestOnly:             true,
		Workers:              workers,
	}
}

// invoices is the program itself: the mail.invoice job keyed by order, under the
// middleware, writing its invoice row with WorkInTx, with the periodic sweeper.
func (d *demo) invoices(ctx context.Context) ([]Row, error) {
	fmt.Fprintln(d.w, "river worker  mail.invoice keyed by order: middleware, WorkInTx, periodic sweeper")
	coord, err := d.newCoordinator(nil)
	if err != nil {
		return nil, err
	}
	// Three expired records from long ago, for the sweeper to find.
	if _, err := d.pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, expires_at, completed_at)
		SELECT 'mail.invoice', 'order-' || i || '.invoice', 'completed', gen_random_uuid(), now() - interval '1 day', now() - interval '9 days'
		FROM generate_series(1, 3) AS i`); err != nil {
		return nil, err
	}
	mw, err := pgidemriver.NewMiddleware(coord, nil)
	if err != nil {
		return nil, err
	}
	sweeper, err := pgidemriver.NewSweepWorker(coord, nil)
	if err != nil {
		return nil, err
	}
	const queue = "invoices"
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &mailWorker[InvoiceArgs]{pool: d.pool, row: queue, coord: coord})
	river.AddWorker(workers, sweeper)
	config := clientConfig(queue, workers, mw)
	sweep, err := pgidemriver.NewSweepPeriodicJob(&pgidemriver.SweepPeriodicJobOpts{Queue: queue})
	if err != nil {
		return nil, err
	}
	config.PeriodicJobs = []*river.PeriodicJob{sweep}
	for _, warning := range mw.CheckTTL(ctx, config) {
		fmt.Fprintf(d.w, "  TTL warning: %s ttl=%s horizon=%s\n", warning.Kind, warning.TTL, warning.Horizon)
	}
	// pgidemriver.NewClient logs the same check when it creates the client.
	client, err := pgidemriver.NewClient(riverpgxv5.New(d.pool), config)
	if err != nil {
		return nil, err
	}
	if err := client.Start(ctx); err != nil {
		return nil, err
	}
	defer stopClient(client)

	// The producer retries: two jobs for order 7.
	var ids []int64
	for range 2 {
		res, err := client.Insert(ctx, InvoiceArgs{OrderID: 7, Scene: "mail.invoice"}, &river.InsertOpts{Queue: queue})
		if err != nil {
			return nil, err
		}
		ids = append(ids, res.Job.ID)
	}
	for _, id := range ids {
		if _, err := d.waitJob(ctx, id, rivertype.JobStateCompleted); err != nil {
			return nil, err
		}
	}
	sweeps, err := d.waitKind(ctx, pgidemriver.SweepKind, rivertype.JobStateCompleted)
	if err != nil {
		return nil, err
	}
	r := Row{Scene: 0, Name: "two jobs for order 7", Deliveries: 2}
	var out pgidem.SweepResult
	if err := json.Unmarshal(sweeps.Output(), &out); err != nil {
		return nil, err
	}
	r.Swept = out.Records
	if err := d.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM mails WHERE row_name = $1), (SELECT count(*) FROM invoices)`, queue).
		Scan(&r.Mails, &r.Invoices); err != nil {
		return nil, err
	}
	fmt.Fprintf(d.w, "  %-44s mails sent=%d invoice rows=%d (WorkInTx) planted expired records swept=%d\n", r.Name, r.Mails, r.Invoices, r.Swept)
	return []Row{r}, nil
}

// scene1: the worker process sends the invoice and is killed before River records the job
// completed; River's rescuer redelivers it to a healthy worker.
func (d *demo) scene1(ctx context.Context) ([]Row, error) {
	fmt.Fprintln(d.w, "scene 1  crash before the ack: the worker sends the mail and is killed before River records completion")
	var rows []Row
	for _, keyed := range []bool{false, true} {
		queue := "scene1-plain"
		name := "plain handler"
		if keyed {
			queue, name = "scene1-keyed", "handler under an idempotency key = job id"
		}
		insert, err := river.NewClient(riverpgxv5.New(d.pool), &river.Config{})
		if err != nil {
			return rows, err
		}
		res, err := insert.Insert(ctx, jobIDInvoiceArgs{OrderID: 9}, &river.InsertOpts{Queue: queue})
		if err != nil {
			return rows, err
		}
		id := res.Job.ID

		// A worker process works the job and is SIGKILLed after the mail.
		if err := d.crashChild(ctx, queue); err != nil {
			return rows, err
		}
		// A healthy worker's leader rescues the job once it has run past
		// RescueStuckJobsAfter, and works the redelivery.
		workers, mw, err := d.scene1Workers(queue, keyed)
		if err != nil {
			return rows, err
		}
		config := clientConfig(queue, workers, mw...)
		if err := d.waitRunningFor(ctx, id, config.RescueStuckJobsAfter+200*time.Millisecond); err != nil {
			return rows, err
		}
		client, err := river.NewClient(riverpgxv5.New(d.pool), config)
		if err != nil {
			return rows, err
		}
		if err := client.Start(ctx); err != nil {
			return rows, err
		}
		job, err := d.waitJob(ctx, id, rivertype.JobStateCompleted)
		stopClient(client)
		if err != nil {
			return rows, err
		}
		r := Row{Scene: 1, Name: name, Deliveries: job.Attempt}
		if err := d.pool.QueryRow(ctx, "SELECT count(*) FROM mails WHERE row_name = $1", queue).Scan(&r.Mails); err != nil {
			return rows, err
		}
		fmt.Fprintf(d.w, "  %-44s deliveries=%d mails sent=%d\n", name, r.Deliveries, r.Mails)
		rows = append(rows, r)
	}
	return rows, nil
}

// scene1Workers returns scene 1's workers for queue: the plain handler, or the same
// handler under the middleware keyed by the job id (its args name no effect).
func (d *demo) scene1Workers(queue string, keyed bool) (*river.Workers, []rivertype.Middleware, error) {
	workers := river.NewWorkers()
	river.AddWorker(workers, &mailWorker[jobIDInvoiceArgs]{pool: d.pool, row: queue})
	if !keyed {
		return workers, nil, nil
	}
	coord, err := d.newCoordinator(nil)
	if err != nil {
		return nil, nil, err
	}
	mw, err := pgidemriver.NewMiddleware(coord, nil)
	if err != nil {
		return nil, nil, err
	}
	return workers, []rivertype.Middleware{mw}, nil
}

// crashChild starts this program as the worker process of scene 1 for queue, waits until
// it reports the mail sent and the job's work done, and kills it with SIGKILL.
func (d *demo) crashChild(ctx context.Context, queue string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), childEnv+"="+d.url+" "+queue)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	line, readErr := bufio.NewReader(stdout).ReadString('\n')
	_ = cmd.Process.Signal(syscall.SIGKILL)
	_ = cmd.Wait()
	if readErr != nil || strings.TrimSpace(line) != "done" {
		return fmt.Errorf("crash child: got %q (%v), want \"done\"", line, readErr)
	}
	return nil
}

// runChild is the worker process of scene 1: it works the queue's job, and once the
// worker (and the middleware, when keyed) returned — the mail sent, the record completed —
// it prints "done" and blocks before River's completer records the job, until killed.
func runChild(spec string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "riverworker child:", err)
		os.Exit(3)
	}
	// The queue name is the last word; the URL before it may itself contain spaces.
	i := strings.LastIndexByte(spec, ' ')
	if i < 0 {
		fail(fmt.Errorf("bad %s %q", childEnv, spec))
	}
	url, queue := spec[:i], spec[i+1:]
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fail(err)
	}
	d := &demo{pool: pool, url: url}
	workers, mw, err := d.scene1Workers(queue, queue == "scene1-keyed")
	if err != nil {
		fail(err)
	}
	hold := river.WorkerMiddlewareFunc(func(ctx context.Context, _ *rivertype.JobRow, doInner func(context.Context) error) error {
		if err := doInner(ctx); err != nil {
			fail(err)
		}
		fmt.Println("done")
		select {} // killed here, before River records the completion
	})
	config := clientConfig(queue, workers, append([]rivertype.Middleware{hold}, mw...)...)
	config.LeaderElectionDisabled = true // the rescuer is the surviving worker's
	client, err := river.NewClient(riverpgxv5.New(pool), config)
	if err != nil {
		fail(err)
	}
	if err := client.Start(ctx); err != nil {
		fail(err)
	}
	select {}
}

// scene2: River's rescuer re-runs a job worker A is still running (it ignores the
// cancellation at JobTimeout): execution B runs beside A.
func (d *demo) scene2(ctx context.Context) ([]Row, error) {
	fmt.Fprintln(d.w, "scene 2  two workers, one job: River's rescuer re-runs the job while worker A still runs")
	var rows []Row
	for _, policy := range []pgidem.InFlightPolicy{pgidem.InFlightWait, pgidem.InFlightRaise} {
		r, err := d.scene2Row(ctx, policy)
		if err != nil {
			return rows, err
		}
		rows = append(rows, r)
	}
	return rows, nil
}

func (d *demo) scene2Row(ctx context.Context, policy pgidem.InFlightPolicy) (Row, error) {
	queue := "scene2-" + policy.String()
	r := Row{Scene: 2, Name: "in_flight=" + policy.String(), Receipts: map[string]string{}}
	waited := make(chan struct{}, 1)
	coord, err := d.newCoordinator(pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventWaited {
			select {
			case waited <- struct{}{}:
			default:
			}
		}
	}))
	if err != nil {
		return r, err
	}
	var (
		mu       sync.Mutex
		names    = []string{"A", "B", "C", "D", "E"}
		outcomes = make(chan pgidemriver.Outcome, 10)
	)
	// Executions are named A, B, C in the order they start: an outer middleware names each
	// one in its context, where the pgidem middleware's hook finds it.
	namer := river.WorkerMiddlewareFunc(func(ctx context.Context, _ *rivertype.JobRow, doInner func(context.Context) error) error {
		mu.Lock()
		name := "?"
		if len(names) > 0 {
			name, names = names[0], names[1:]
		}
		mu.Unlock()
		return doInner(context.WithValue(ctx, executionKey{}, name))
	})
	hook := pgidemriver.HookFunc(func(ctx context.Context, out *pgidemriver.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		r.Deliveries++
		name, _ := ctx.Value(executionKey{}).(string)
		switch out.Action {
		case pgidemriver.ActionExecuted:
			r.Receipts[name] = unquote(out.Output)
		case pgidemriver.ActionReplayed:
			r.Receipts[name] = unquote(out.Output)
			if !out.Waited {
				r.Receipts[name] += " (replayed)"
			}
		case pgidemriver.ActionSnoozed:
			r.Receipts[name] = "in progress, snoozed"
		default:
			r.Receipts[name] = fmt.Sprintf("%s: %v", out.Action, out.Err)
		}
		outcomes <- *out
	})
	// A long minimum snooze keeps the snoozed execution parked until worker A finishes.
	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{InFlight: policy, SnoozeMin: 2 * time.Second, Hook: hook})
	if err != nil {
		return r, err
	}
	release := make(chan struct{})
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &mailWorker[InvoiceArgs]{pool: d.pool, row: queue, slow: func(context.Context) {
		select { // a slow mail server: worker A keeps running until B has been answered
		case <-release:
		case <-time.After(time.Minute):
		}
	}})

	configA := clientConfig(queue, workers, namer, mw)
	configA.LeaderElectionDisabled = true // no rescuer until worker A has run a while
	clientA, err := river.NewClient(riverpgxv5.New(d.pool), configA)
	if err != nil {
		return r, err
	}
	if err := clientA.Start(ctx); err != nil {
		return r, err
	}
	defer stopClient(clientA)
	res, err := clientA.Insert(ctx, InvoiceArgs{OrderID: 9, Scene: queue}, &river.InsertOpts{Queue: queue})
	if err != nil {
		return r, err
	}
	id := res.Job.ID
	if err := d.waitRunningFor(ctx, id, configA.RescueStuckJobsAfter+200*time.Millisecond); err != nil {
		return r, err
	}
	clientB, err := river.NewClient(riverpgxv5.New(d.pool), clientConfig(queue, workers, namer, mw))
	if err != nil {
		return r, err
	}
	if err := clientB.Start(ctx); err != nil { // its rescuer runs at once
		return r, err
	}
	defer stopClient(clientB)

	// Answer: B waits for A (wait), or is snoozed (raise) — then A may finish.
	if policy == pgidem.InFlightWait {
		select {
		case <-waited:
		case <-ctx.Done():
			return r, ctx.Err()
		}
	} else {
		if err := waitOutcome(ctx, outcomes, pgidemriver.ActionSnoozed); err != nil {
			return r, err
		}
		if _, err := d.waitJob(ctx, id, rivertype.JobStateAvailable, rivertype.JobStateScheduled); err != nil {
			return r, err
		}
	}
	close(release)
	if err := waitOutcome(ctx, outcomes, pgidemriver.ActionReplayed); err != nil {
		return r, err
	}
	if _, err := d.waitJob(ctx, id, rivertype.JobStateCompleted); err != nil {
		return r, err
	}
	if err := d.pool.QueryRow(ctx, "SELECT count(*) FROM mails WHERE row_name = $1", queue).Scan(&r.Mails); err != nil {
		return r, err
	}
	mu.Lock()
	defer mu.Unlock()
	fmt.Fprintf(d.w, "  %-44s %s mails sent=%d\n", r.Name, formatReceipts(r.Receipts), r.Mails)
	return r, nil
}

// scene3: a retrying producer enqueues two jobs for order 9; what the key is made of
// decides whether the invoice goes out twice.
func (d *demo) scene3(ctx context.Context) ([]Row, error) {
	fmt.Fprintln(d.w, "scene 3  what the key is made of: a retrying producer enqueues two jobs for order 9")
	var rows []Row
	for _, tc := range []struct {
		name, queue, keyStyle string
	}{
		{"key = job id", "scene3-jobid", ""},
		{"key = order-9:invoice (no reserved chars)", "scene3-colon", "colon"},
		{"key = order-9.invoice", "scene3-dot", ""},
		{`key = "order-9\x00invoice" (invalid)`, "scene3-nul", "nul"},
	} {
		r := Row{Scene: 3, Name: tc.name}
		coord, err := d.newCoordinator(nil)
		if err != nil {
			return rows, err
		}
		var mu sync.Mutex
		mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{Hook: pgidemriver.HookFunc(func(_ context.Context, out *pgidemriver.Outcome) {
			mu.Lock()
			defer mu.Unlock()
			r.Deliveries++
			if out.Err != nil && !errors.As(out.Err, new(*river.JobSnoozeError)) {
				r.Err = out.Err
			}
		})})
		if err != nil {
			return rows, err
		}
		workers := river.NewWorkers()
		var args river.JobArgs = InvoiceArgs{OrderID: 9, Scene: tc.queue, KeyStyle: tc.keyStyle}
		if tc.queue == "scene3-jobid" {
			river.AddWorker(workers, &mailWorker[jobIDInvoiceArgs]{pool: d.pool, row: tc.queue})
			args = jobIDInvoiceArgs{OrderID: 9}
		} else {
			pgidemriver.AddWorker(workers, mw, &mailWorker[InvoiceArgs]{pool: d.pool, row: tc.queue})
		}
		config := clientConfig(tc.queue, workers, mw)
		config.LeaderElectionDisabled = true
		config.Queues[tc.queue] = river.QueueConfig{MaxWorkers: 1}
		client, err := river.NewClient(riverpgxv5.New(d.pool), config)
		if err != nil {
			return rows, err
		}
		if err := client.Start(ctx); err != nil {
			return rows, err
		}
		var ids []int64
		for range 2 { // the producer's retry enqueues the job twice
			res, err := client.Insert(ctx, args, &river.InsertOpts{Queue: tc.queue})
			if err != nil {
				stopClient(client)
				return rows, err
			}
			ids = append(ids, res.Job.ID)
		}
		for _, id := range ids {
			// Done: completed, or failed and waiting for River's retry.
			job, err := d.waitJob(ctx, id, rivertype.JobStateCompleted, rivertype.JobStateRetryable)
			if err != nil {
				stopClient(client)
				return rows, err
			}
			if job.State != rivertype.JobStateCompleted {
				r.Unfinished++
			}
		}
		stopClient(client)
		if err := d.pool.QueryRow(ctx, "SELECT count(*) FROM mails WHERE row_name = $1", tc.queue).Scan(&r.Mails); err != nil {
			return rows, err
		}
		mu.Lock()
		if r.Err != nil && !errors.Is(r.Err, pgidem.ErrInvalidKey) {
			mu.Unlock()
			return rows, r.Err
		}
		if r.Err != nil {
			fmt.Fprintf(d.w, "  %-44s ErrInvalidKey, mails sent=%d, jobs not completed=%d (fails loudly; River retries, then discards)\n", r.Name, r.Mails, r.Unfinished)
		} else {
			fmt.Fprintf(d.w, "  %-44s mails sent=%d\n", r.Name, r.Mails)
		}
		mu.Unlock()
		rows = append(rows, r)
	}
	return rows, nil
}

// executionKey is the context key of scene 2's execution names.
type executionKey struct{}

func formatReceipts(receipts map[string]string) string {
	var parts []string
	for _, name := range []string{"A", "B", "C", "D", "E"} {
		if v, ok := receipts[name]; ok {
			parts = append(parts, name+": "+v)
		}
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

func unquote(output []byte) string {
	var s string
	if err := json.Unmarshal(output, &s); err != nil {
		return string(output)
	}
	return s
}

func waitOutcome(ctx context.Context, outcomes <-chan pgidemriver.Outcome, action pgidemriver.Action) error {
	for {
		select {
		case out := <-outcomes:
			if out.Action == action {
				return nil
			}
		case <-ctx.Done():
			return fmt.Errorf("waiting for a %s execution: %w", action, ctx.Err())
		}
	}
}

func stopClient(client *river.Client[pgx.Tx]) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = client.Stop(ctx)
}

// waitJob polls until the job is in one of states.
func (d *demo) waitJob(ctx context.Context, id int64, states ...rivertype.JobState) (*rivertype.JobRow, error) {
	client, err := river.NewClient(riverpgxv5.New(d.pool), &river.Config{})
	if err != nil {
		return nil, err
	}
	for {
		job, err := client.JobGet(ctx, id)
		if err != nil {
			return nil, err
		}
		for _, s := range states {
			if job.State == s {
				return job, nil
			}
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return nil, fmt.Errorf("job %d still %s: %w", id, job.State, err)
		}
	}
}

// waitKind polls until a job of kind is in state.
func (d *demo) waitKind(ctx context.Context, kind string, state rivertype.JobState) (*rivertype.JobRow, error) {
	client, err := river.NewClient(riverpgxv5.New(d.pool), &river.Config{})
	if err != nil {
		return nil, err
	}
	for {
		res, err := client.JobList(ctx, river.NewJobListParams().Kinds(kind).States(state).First(1))
		if err != nil {
			return nil, err
		}
		if len(res.Jobs) > 0 {
			return res.Jobs[0], nil
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return nil, fmt.Errorf("no %s job %s: %w", kind, state, err)
		}
	}
}

// waitRunningFor polls until the job has been running longer than d by the database clock,
// which is what River's rescuer compares.
func (d *demo) waitRunningFor(ctx context.Context, id int64, dur time.Duration) error {
	for {
		var ok bool
		if err := d.pool.QueryRow(ctx, `SELECT state = 'running' AND attempted_at < now() - $2 * interval '1 microsecond'
			FROM river_job WHERE id = $1`, id, dur.Microseconds()).Scan(&ok); err != nil {
			return err
		}
		if ok {
			return nil
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return fmt.Errorf("job %d not running for %s: %w", id, dur, err)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
