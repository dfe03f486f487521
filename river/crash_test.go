package pgidemriver_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

const (
	crashEnvURL = "PGIDEMRIVER_CRASH_CHILD_URL"
)

// crashChild runs the child half of TestCrashBeforeCompletion when the test binary is
// re-executed for it, and reports whether it did. The child works the job through the
// middleware — the effect happens and its record completes — and then, before River's
// executor hands the result to its batched completer, prints "done" and blocks until the
// parent SIGKILLs it: River never learns that the job completed.
func crashChild() bool {
	url := os.Getenv(crashEnvURL)
	if url == "" {
		return false
	}
	fail := func(err error) {
		fmt.Println("error:", err)
		os.Exit(3)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		fail(err)
	}
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: testLease})
	if err != nil {
		fail(err)
	}
	mw, err := pgidemriver.NewMiddleware(coord, nil)
	if err != nil {
		fail(err)
	}
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: pool})
	river.AddWorker(workers, &shipWorker{coord: coord, inTx: func(context.Context, int64) {
		fmt.Println("in tx")
		select {} // the parent kills us mid-transaction
	}})
	hold := river.WorkerMiddlewareFunc(func(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
		if job.Kind != (InvoiceArgs{}).Kind() {
			return doInner(ctx)
		}
		if err := doInner(ctx); err != nil {
			fail(err)
		}
		fmt.Println("done")
		select {} // the parent kills us here
	})
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		FetchCooldown:          10 * time.Millisecond,
		FetchPollInterval:      pollInterval,
		LeaderElectionDisabled: true, // the rescuer is the parent's
		Middleware:             []rivertype.Middleware{hold, mw},
		Queues:                 map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 1}},
		TestOnly:               true,
		Workers:                workers,
	})
	if err != nil {
		fail(err)
	}
	if err := client.Start(ctx); err != nil {
		fail(err)
	}
	select {}
}

// TestCrashBeforeCompletion: a worker process is SIGKILLed after the effect and before
// River records the job's completion. River's rescuer redelivers the job; the retry
// replays the record instead of repeating the effect.
func TestCrashBeforeCompletion(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.insert(t, InvoiceArgs{OrderID: 9}, nil)

	runChildUntil(t, b.db.URL, "done")

	require.Equal(t, 1, b.effects(t))
	require.Equal(t, rivertype.JobStateRunning, b.job(t, id).State, "River never recorded the completion")
	rec, err := b.coord.Lookup(b.ctx, "mail.invoice", "order-9.invoice")
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status, "the effect's record did complete")

	// A surviving worker's leader rescues the job: it runs again and replays.
	mw, outs := b.newMiddleware(t, nil)
	var bodyRuns atomic.Int32
	workers := river.NewWorkers()
	pgidemriver.AddWorker(workers, mw, &effectWorker[InvoiceArgs]{pool: b.db.Pool,
		before: func(context.Context, *river.Job[InvoiceArgs]) error { bodyRuns.Add(1); return nil }})
	cfg := riverConfig(t, workers, mw)
	cfg.JobTimeout = 500 * time.Millisecond
	cfg.RescueStuckJobsAfter = time.Second
	b.waitRunningFor(t, id, cfg.RescueStuckJobsAfter+200*time.Millisecond)
	b.startClient(t, cfg)

	job := b.waitJob(t, id, rivertype.JobStateCompleted)
	replayed := outs.waitFor(t, pgidemriver.ActionReplayed)
	require.Equal(t, id, replayed.Job.ID)
	require.Equal(t, 2, job.Attempt)
	require.Equal(t, 1, b.effects(t), "the effect was replayed, not repeated")
	require.Zero(t, bodyRuns.Load())
	rec, err = b.coord.Lookup(b.ctx, "mail.invoice", "order-9.invoice")
	require.NoError(t, err)
	require.Equal(t, 1, rec.Attempts)
	require.JSONEq(t, string(replayed.Output), string(job.Output()), "the retry carries the first run's receipt")
}

// runChildUntil re-executes the test binary as a crash child working jobs on dbURL, waits
// until it prints want, and SIGKILLs it.
func runChildUntil(t *testing.T, dbURL, want string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashEnvURL+"="+dbURL)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err)
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	require.Equal(t, want, strings.TrimSpace(line), "child output")
}
