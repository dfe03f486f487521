package pgidemriver_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// Test timing. None of it is asserted: waits poll for a state and give up after waitCap.
const (
	testLease     = time.Second // short, so a snooze (the holder's remaining lease) is short
	testTTL       = time.Hour
	pollInterval  = 50 * time.Millisecond
	waitCap       = 90 * time.Second // failure, not a timing assertion
	effectsSchema = `CREATE TABLE effects (id bigserial PRIMARY KEY, key text NOT NULL, job_id bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())`
)

// InvoiceArgs name their effect: one invoice mail per order.
type InvoiceArgs struct {
	OrderID int64 `json:"order_id"`
	// NULKey makes the key contain a NUL character (jsonb cannot carry one in the args).
	NULKey bool `json:"nul_key,omitempty"`
}

func (InvoiceArgs) Kind() string { return "mail.invoice" }

func (a InvoiceArgs) IdempotencyKey() string {
	if a.NULKey {
		return fmt.Sprintf("order-%d\x00invoice", a.OrderID)
	}
	return fmt.Sprintf("order-%d.invoice", a.OrderID)
}

// PlainArgs name no effect: the middleware falls back to the job id.
type PlainArgs struct {
	OrderID int64 `json:"order_id"`
}

func (PlainArgs) Kind() string { return "mail.plain" }

// effectWorker performs the effect — a committed row in effects, standing in for a mail —
// and runs the test's optional hook first.
type effectWorker[T river.JobArgs] struct {
	river.WorkerDefaults[T]
	pool   *pgxpool.Pool
	before func(ctx context.Context, job *river.Job[T]) error // nil: none
	after  func(ctx context.Context, job *river.Job[T]) error // nil: none; after the effect
}

func (w *effectWorker[T]) Work(ctx context.Context, job *river.Job[T]) error {
	if w.before != nil {
		if err := w.before(ctx, job); err != nil {
			return err
		}
	}
	key := "none"
	if _, k, ok := pgidem.KeyFromContext(ctx); ok {
		key = k
	}
	var id int64
	// The effect is "sent" even if the job's context was cancelled: like a mail already
	// handed to the provider.
	err := w.pool.QueryRow(context.WithoutCancel(ctx), "INSERT INTO effects (key, job_id) VALUES ($1, $2) RETURNING id", key, job.ID).Scan(&id)
	if err != nil {
		return err
	}
	if err := pgidemriver.RecordOutput(ctx, fmt.Sprintf("em_%d", id)); err != nil {
		return err
	}
	if w.after != nil {
		return w.after(ctx, job)
	}
	return nil
}

type bundle struct {
	ctx   context.Context
	db    *testdb.DB
	coord *pgidem.Coordinator
	// events counts the coordinator's events by kind.
	events *eventCounter
}

type eventCounter struct {
	mu     sync.Mutex
	counts map[pgidem.EventKind]int64
	notify chan pgidem.EventKind
}

func (c *eventCounter) OnEvent(_ context.Context, e pgidem.Event) {
	c.mu.Lock()
	c.counts[e.Kind] += e.Count
	c.mu.Unlock()
	select {
	case c.notify <- e.Kind:
	default:
	}
}

func (c *eventCounter) get(kind pgidem.EventKind) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.counts[kind]
}

// setup returns a fresh database with pgidem's and River's migrations, an effects table,
// and a coordinator with a short lease.
func setup(t *testing.T) *bundle {
	t.Helper()
	ctx := context.Background()
	db := testdb.New(t)
	_, err := pgidemriver.MigrateRiver(ctx, db.Pool, nil)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, effectsSchema)
	require.NoError(t, err)
	events := &eventCounter{counts: map[pgidem.EventKind]int64{}, notify: make(chan pgidem.EventKind, 100)}
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Lease: testLease, Hook: events, Logger: testLogger(t)})
	require.NoError(t, err)
	return &bundle{ctx: ctx, db: db, coord: coord, events: events}
}

// testLogger logs warnings and errors through t.Log.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}

// riverConfig returns a fast-polling client config for workers with mws as global
// middleware.
func riverConfig(t *testing.T, workers *river.Workers, mws ...rivertype.Middleware) *river.Config {
	return &river.Config{
		FetchCooldown:     10 * time.Millisecond,
		FetchPollInterval: pollInterval,
		Logger:            slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelError})),
		Middleware:        mws,
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 4}},
		TestOnly:          true,
		Workers:           workers,
	}
}

// startClient creates and starts a client and stops it at cleanup.
func (b *bundle) startClient(t *testing.T, config *river.Config) *river.Client[pgx.Tx] {
	t.Helper()
	client, err := river.NewClient(riverpgxv5.New(b.db.Pool), config)
	require.NoError(t, err)
	require.NoError(t, client.Start(b.ctx))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		require.NoError(t, client.Stop(ctx))
	})
	return client
}

// insert inserts a job through an insert-only client and returns its id.
func (b *bundle) insert(t *testing.T, args river.JobArgs, opts *river.InsertOpts) int64 {
	t.Helper()
	client, err := river.NewClient(riverpgxv5.New(b.db.Pool), &river.Config{})
	require.NoError(t, err)
	res, err := client.Insert(b.ctx, args, opts)
	require.NoError(t, err)
	return res.Job.ID
}

// job reads a job row.
func (b *bundle) job(t *testing.T, id int64) *rivertype.JobRow {
	t.Helper()
	client, err := river.NewClient(riverpgxv5.New(b.db.Pool), &river.Config{})
	require.NoError(t, err)
	job, err := client.JobGet(b.ctx, id)
	require.NoError(t, err)
	return job
}

// waitJob polls until the job is in one of states and returns it.
func (b *bundle) waitJob(t *testing.T, id int64, states ...rivertype.JobState) *rivertype.JobRow {
	t.Helper()
	deadline := time.Now().Add(waitCap)
	for {
		job := b.job(t, id)
		for _, s := range states {
			if job.State == s {
				return job
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %d still %s after %s, want one of %v", id, job.State, waitCap, states)
		}
		time.Sleep(pollInterval)
	}
}

// waitRunningFor polls until the job has been running for longer than d by the database
// clock (what the rescuer compares).
func (b *bundle) waitRunningFor(t *testing.T, id int64, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(waitCap)
	for {
		var ok bool
		require.NoError(t, b.db.Pool.QueryRow(b.ctx,
			`SELECT state = 'running' AND attempted_at < now() - $2 * interval '1 microsecond' FROM river_job WHERE id = $1`,
			id, d.Microseconds()).Scan(&ok))
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %d not running for %s after %s", id, d, waitCap)
		}
		time.Sleep(pollInterval)
	}
}

func (b *bundle) effects(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT count(*) FROM effects").Scan(&n))
	return n
}

// outcomes collects the middleware's outcomes and signals each on a channel.
type outcomes struct {
	mu   sync.Mutex
	all  []pgidemriver.Outcome
	ch   chan pgidemriver.Outcome
	seen atomic.Int64
}

func newOutcomes() *outcomes { return &outcomes{ch: make(chan pgidemriver.Outcome, 100)} }

func (o *outcomes) OnOutcome(_ context.Context, out *pgidemriver.Outcome) {
	o.mu.Lock()
	o.all = append(o.all, *out)
	o.mu.Unlock()
	o.seen.Add(1)
	select {
	case o.ch <- *out:
	default:
	}
}

func (o *outcomes) list() []pgidemriver.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]pgidemriver.Outcome(nil), o.all...)
}

// waitFor receives outcomes until one matches action.
func (o *outcomes) waitFor(t *testing.T, action pgidemriver.Action) pgidemriver.Outcome {
	t.Helper()
	timer := time.NewTimer(waitCap)
	defer timer.Stop()
	for {
		select {
		case out := <-o.ch:
			if out.Action == action {
				return out
			}
		case <-timer.C:
			t.Fatalf("no %s outcome after %s", action, waitCap)
		}
	}
}

func (b *bundle) newMiddleware(t *testing.T, config *pgidemriver.Config) (*pgidemriver.Middleware, *outcomes) {
	t.Helper()
	var cfg pgidemriver.Config
	if config != nil {
		cfg = *config
	}
	outs := newOutcomes()
	cfg.Hook = outs
	cfg.Logger = testLogger(t)
	mw, err := pgidemriver.NewMiddleware(b.coord, &cfg)
	require.NoError(t, err)
	return mw, outs
}

// invoiceMiddleware is newMiddleware with InvoiceArgs registered, as most tests need.
func (b *bundle) invoiceMiddleware(t *testing.T, config *pgidemriver.Config) (*pgidemriver.Middleware, *outcomes) {
	t.Helper()
	mw, outs := b.newMiddleware(t, config)
	mw.Register(InvoiceArgs{})
	return mw, outs
}

// syncBuffer is a bytes.Buffer safe for the concurrent writes of a logger shared with a
// River client's goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func jobRow(id int64, kind, args string) *rivertype.JobRow {
	return &rivertype.JobRow{ID: id, Kind: kind, EncodedArgs: []byte(args), Attempt: 1, State: rivertype.JobStateRunning}
}

// failCompletions makes every completing write of a record fail, as a store outage that
// outlasts the finishing write's retries would.
// failCompletions makes every write that completes or fails a record fail, until the time
// in the one-row table outage (default: forever).
func failCompletions(t *testing.T, b *bundle) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `
CREATE TABLE outage (until timestamptz NOT NULL);
INSERT INTO outage VALUES ('infinity');
CREATE FUNCTION fail_completion() RETURNS trigger LANGUAGE plpgsql AS
	$$BEGIN IF clock_timestamp() < (SELECT until FROM outage) THEN RAISE EXCEPTION 'injected outage'; END IF; RETURN NEW; END$$;
CREATE TRIGGER fail_completion BEFORE UPDATE ON pgidem_record
	FOR EACH ROW WHEN (NEW.status <> 'in_progress') EXECUTE FUNCTION fail_completion()`)
	require.NoError(t, err)
}

// workUntilCancelled works a mail.invoice job for orderID whose worker waits for its
// context to end and returns its error. running closes when the worker starts, cancelled
// when its context ended; errCh receives Work's error.
func workUntilCancelled(b *bundle, mw *pgidemriver.Middleware, orderID int) (running, cancelled chan struct{}, errCh chan error) {
	running, cancelled, errCh = make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		errCh <- mw.Work(b.ctx, jobRow(1, "mail.invoice", fmt.Sprintf(`{"order_id":%d}`, orderID)), func(ctx context.Context) error {
			close(running)
			defer close(cancelled)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(15 * testLease): // failure cap, not a timing assertion
				return errors.New("never cancelled")
			}
		})
	}()
	return running, cancelled, errCh
}

// offlineMiddleware returns a middleware whose coordinator's pool never connects (creating
// a coordinator, a middleware or a client, registering and CheckTTL do not touch the
// database), logging to the returned buffer.
func offlineMiddleware(t *testing.T, configure ...func(*pgidemriver.Config)) (*pgidemriver.Middleware, *bytes.Buffer, *pgxpool.Pool) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://127.0.0.1:1/none")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	coord, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)
	var logs bytes.Buffer
	cfg := &pgidemriver.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	for _, f := range configure {
		f(cfg)
	}
	mw, err := pgidemriver.NewMiddleware(coord, cfg)
	require.NoError(t, err)
	return mw, &logs, pool
}
