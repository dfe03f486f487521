package pgidemriver_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// NoopArgs are a job naming a distinct effect per job; it does nothing (or sleeps for
// Sleep, standing in for a call to another service).
type NoopArgs struct {
	N     int           `json:"n"`
	Sleep time.Duration `json:"sleep,omitempty"`
}

func (NoopArgs) Kind() string { return "bench.noop" }

func (a NoopArgs) IdempotencyKey() string { return fmt.Sprintf("noop-%d", a.N) }

type noopWorker struct {
	river.WorkerDefaults[NoopArgs]
}

func (*noopWorker) Work(ctx context.Context, job *river.Job[NoopArgs]) error {
	if job.Args.Sleep > 0 {
		select {
		case <-time.After(job.Args.Sleep):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// BenchmarkRiverThroughput works b.N jobs through a River client, without and with the
// middleware (every job a fresh key: reserve + complete), and reports jobs/s. The jobs are
// inserted before the timer starts; the timer covers the client working all of them. Four
// set-ups of a no-op job, from River's defaults to a client fetching as fast as River
// allows, and one of a job that waits (docs/performance.md has a table of them):
//
//   - RiverDefaults: 100 workers, River's default fetch cooldown (100 ms) and poll
//     interval (1 s). River fetches at most one full set of workers per cooldown, so both
//     variants are capped near 1000 jobs/s.
//   - Tuned: 50 workers fetching every 10 ms, a queue set up for throughput; each fetch
//     takes the slots free at that moment, so the middleware's added latency per job
//     shows as slots still busy.
//   - Busy: 100 workers fetching every 10 ms, where the machine starts to run out of CPU.
//   - Saturated: 200 workers, River's shortest fetch cooldown (1 ms) and a 5 ms poll: the
//     machine's CPU is the limit, so the ratio is the cost of the middleware's work
//     itself (two committed row writes per job beside River's own).
//   - Call50ms: the Busy queue, but each job waits 50 ms, like a job calling another
//     service: the workers are the limit, and the middleware's latency per job counts
//     against the job's own.
//
// The command docs/performance.md reports:
//
//	go test -run '^$' -bench RiverThroughput -benchtime 10000x -count 6 ./river/
func BenchmarkRiverThroughput(b *testing.B) {
	configs := []struct {
		name              string
		workers           int
		cooldown, pollInt time.Duration // zero: River's defaults
		sleep             time.Duration // how long each job waits
	}{
		{"RiverDefaults", 100, 0, 0, 0},
		{"Tuned", 50, 10 * time.Millisecond, 10 * time.Millisecond, 0},
		{"Busy", 100, 10 * time.Millisecond, 10 * time.Millisecond, 0},
		{"Saturated", 200, river.FetchCooldownMin, 5 * time.Millisecond, 0},
		{"Call50ms", 100, 10 * time.Millisecond, 10 * time.Millisecond, 50 * time.Millisecond},
	}
	for _, cfg := range configs {
		for _, withMiddleware := range []bool{false, true} {
			name := cfg.name + "/Plain"
			if withMiddleware {
				name = cfg.name + "/Middleware"
			}
			b.Run(name, func(b *testing.B) { benchRiver(b, cfg.workers, cfg.cooldown, cfg.pollInt, cfg.sleep, withMiddleware) })
		}
	}
}

func benchRiver(b *testing.B, maxWorkers int, cooldown, pollInterval, sleep time.Duration, withMiddleware bool) {
	ctx := context.Background()
	db := testdb.New(b)
	if _, err := pgidemriver.MigrateRiver(ctx, db.Pool, nil); err != nil {
		b.Fatal(err)
	}
	// pgxpool's default (4 connections on this machine) would queue the workers'
	// statements; both variants get the same larger pool.
	pool := db.NewPool(b, 20)
	coord, err := pgidem.NewCoordinator(pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	workers := river.NewWorkers()
	var middleware []rivertype.Middleware
	if withMiddleware {
		mw, err := pgidemriver.NewMiddleware(coord, nil)
		if err != nil {
			b.Fatal(err)
		}
		pgidemriver.AddWorker(workers, mw, &noopWorker{})
		middleware = append(middleware, mw)
	} else {
		river.AddWorker(workers, &noopWorker{})
	}
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		FetchCooldown:     cooldown, // zero: River's default
		FetchPollInterval: pollInterval,
		Logger:            slog.New(slog.DiscardHandler),
		Middleware:        middleware,
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: maxWorkers}},
		TestOnly:          true,
		Workers:           workers,
	})
	if err != nil {
		b.Fatal(err)
	}
	params := make([]river.InsertManyParams, b.N)
	for i := range params {
		params[i] = river.InsertManyParams{Args: NoopArgs{N: i, Sleep: sleep}}
	}
	for start := 0; start < len(params); start += 1000 {
		if _, err := client.InsertManyFast(ctx, params[start:min(start+1000, len(params))]); err != nil {
			b.Fatal(err)
		}
	}

	// Completions are counted from River's own events (sent once its completer has written
	// them), so the harness puts no queries of its own on the database while timing.
	events, unsubscribe := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: b.N,
		Kinds:    []river.EventKind{river.EventKindJobCompleted},
	})
	defer unsubscribe()

	b.ResetTimer()
	begin := time.Now()
	if err := client.Start(ctx); err != nil {
		b.Fatal(err)
	}
	timeout := time.After(5 * time.Minute)
	for range b.N {
		select {
		case <-events:
		case <-timeout:
			b.Fatal("jobs did not complete within 5 minutes")
		}
	}
	elapsed := time.Since(begin)
	b.StopTimer()
	var done int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE state = 'completed'").Scan(&done); err != nil {
		b.Fatal(err)
	}
	if done != b.N {
		b.Fatalf("%d jobs completed, want %d", done, b.N)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "jobs/s")
	stopCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := client.Stop(stopCtx); err != nil {
		b.Fatal(err)
	}
}
