package pgidem_test

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/benchsql"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// Scale benchmarks: 16 callers, alternating slices of scaleSliceTime, scaleSlices per
// side after one warm-up slice each.
const (
	scaleCallers   = 16
	scaleSlices    = 8
	scaleSliceTime = time.Second
	// scaleSmall is the records of the small table BenchmarkScale compares against.
	scaleSmall = 10_000
)

// scaleRecords returns the records of the large table: PGIDEM_SCALE_RECORDS, default 10
// million.
func scaleRecords(b *testing.B) int {
	s := os.Getenv("PGIDEM_SCALE_RECORDS")
	if s == "" {
		return 10_000_000
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < scaleSmall {
		b.Fatalf("PGIDEM_SCALE_RECORDS=%q: want a number of at least %d", s, scaleSmall)
	}
	return n
}

// fillRecords inserts n completed records (namespace, keys "f0"…) that expire in
// expiresIn (negative: already expired), then vacuums and analyzes the table.
func fillRecords(b *testing.B, pool *pgxpool.Pool, namespace string, n int, expiresIn time.Duration) {
	ctx := context.Background()
	const chunk = 1_000_000
	for from := 0; from < n; from += chunk {
		_, err := pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, result,
				expires_at, created_at, updated_at, completed_at)
			SELECT $1, 'f' || i, 'completed', gen_random_uuid(), 1, '"em_1"',
				now() + $4 * interval '1 microsecond', now(), now(), now()
			FROM generate_series($2::int, $3::int - 1) AS i`, namespace, from, min(from+chunk, n), expiresIn.Microseconds())
		if err != nil {
			b.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE pgidem_record`); err != nil {
		b.Fatal(err)
	}
}

// latencySide is one contestant of a scale cell: call runs one call.
type latencySide struct {
	name string
	call func(ctx context.Context) error
}

// runLatencySlice runs side from scaleCallers goroutines for scaleSliceTime and returns
// each call's latency.
func runLatencySlice(ctx context.Context, b *testing.B, side latencySide) []time.Duration {
	var mu sync.Mutex
	var all []time.Duration
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	deadline := time.Now().Add(scaleSliceTime)
	for range scaleCallers {
		wg.Go(func() {
			var mine []time.Duration
			for time.Now().Before(deadline) {
				start := time.Now()
				if err := side.call(ctx); err != nil {
					once.Do(func() { firstErr = fmt.Errorf("%s: %w", side.name, err) })
					return
				}
				mine = append(mine, time.Since(start))
			}
			mu.Lock()
			all = append(all, mine...)
			mu.Unlock()
		})
	}
	wg.Wait()
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	return all
}

// runLatencyCell runs sides in alternating slices (the first side rotating) and returns
// each side's latencies over its counted slices. before, when set, is called before each
// slice of a side (with its index) and after, with the slice's latencies, after it.
func runLatencyCell(b *testing.B, sides []latencySide, before func(side int) func()) [][]time.Duration {
	ctx := context.Background()
	out := make([][]time.Duration, len(sides))
	for round := -1; round < scaleSlices; round++ {
		for j := range sides {
			k := (j + max(round, 0)) % len(sides)
			stop := func() {}
			if before != nil {
				stop = before(k)
			}
			lat := runLatencySlice(ctx, b, sides[k])
			stop()
			if round >= 0 {
				out[k] = append(out[k], lat...)
			}
		}
	}
	return out
}

// p99 returns the 99th percentile of lat in milliseconds.
func p99(lat []time.Duration) float64 {
	if len(lat) == 0 {
		return 0
	}
	s := slices.Clone(lat)
	slices.Sort(s)
	return float64(s[len(s)*99/100]) / float64(time.Millisecond)
}

// BenchmarkScale compares the p99 latency of 16 callers on a table of PGIDEM_SCALE_RECORDS
// records (default 10 million) with the same on a table of 10 thousand: two databases on
// one server, through pools of 32 connections, alternating one-second slices. It reports
// both p99s and their ratio (large ÷ small) for fresh keys and for replays of random
// records of the table; for replays also the same ratio of the floor's read
// (floorReplay), which shows what the table's size costs any reader.
//
//	make bench-scale
func BenchmarkScale(b *testing.B) {
	n := scaleRecords(b)
	type table struct {
		coord *pgidem.Coordinator
		pool  *pgxpool.Pool
		n     int
	}
	var tables []table
	for _, size := range []int{scaleSmall, n} {
		db := testdb.New(b)
		pool := db.NewPool(b, 32)
		fillRecords(b, pool, "replay", size, 24*time.Hour)
		coord, err := pgidem.NewCoordinator(pool, nil)
		if err != nil {
			b.Fatal(err)
		}
		tables = append(tables, table{coord, pool, size})
	}
	fn := func(context.Context) (string, error) { return "em_1", nil }
	prefix := benchsql.KeyPrefix()
	var seq atomic.Int64
	// cell runs call on both tables; floor, when set, too, as the hand-written baseline.
	cell := func(b *testing.B, call, floor func(ctx context.Context, t table) error) {
		var sides []latencySide
		for _, f := range []func(context.Context, table) error{call, floor} {
			for _, t := range tables {
				if f != nil {
					sides = append(sides, latencySide{strconv.Itoa(t.n), func(ctx context.Context) error { return f(ctx, t) }})
				}
			}
		}
		lat := runLatencyCell(b, sides, nil)
		small, large := p99(lat[0]), p99(lat[1])
		b.ReportMetric(small, "p99-small-ms")
		b.ReportMetric(large, "p99-large-ms")
		b.ReportMetric(large/small, "p99-ratio")
		if floor != nil {
			b.ReportMetric(p99(lat[3])/p99(lat[2]), "floor-p99-ratio")
		}
		b.ReportMetric(float64(n), "records")
	}
	replayKey := func(t table) string { return "f" + strconv.Itoa(mrand.IntN(t.n)) }
	b.Run("fresh/callers=16", func(b *testing.B) {
		cell(b, func(ctx context.Context, t table) error {
			_, err := pgidem.Do(ctx, t.coord, "fresh", prefix+strconv.FormatInt(seq.Add(1), 10), testTTL, nil, fn)
			return err
		}, nil)
	})
	b.Run("replay/callers=16", func(b *testing.B) {
		cell(b, func(ctx context.Context, t table) error {
			res, err := pgidem.DoResult(ctx, t.coord, "replay", replayKey(t), testTTL, nil, fn)
			if err == nil && res.Outcome != pgidem.OutcomeReplayed {
				err = fmt.Errorf("outcome %s, want replayed", res.Outcome)
			}
			return err
		}, func(ctx context.Context, t table) error { return floorReplay(ctx, t.pool, "replay", replayKey(t)) })
	})
}

// BenchmarkSweepLoad measures what a sweep costs concurrent callers: a table holding a
// million expired records, 16 callers (half replays, half fresh keys), and one-second
// slices alternating between callers alone and callers while Sweep runs with its default
// pace. It reports the callers' p99 both ways, the relative increase, and the sweep's
// rows per second.
//
//	make bench-scale
func BenchmarkSweepLoad(b *testing.B) {
	db := testdb.New(b)
	pool := db.NewPool(b, 32)
	fillRecords(b, pool, "expired", 1_000_000, -time.Hour)
	fillRecords(b, pool, "replay", scaleSmall, 24*time.Hour)
	coord, err := pgidem.NewCoordinator(pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	fn := func(context.Context) (string, error) { return "em_1", nil }
	prefix := benchsql.KeyPrefix()
	var seq, i atomic.Int64
	call := func(ctx context.Context) error {
		if i.Add(1)%2 == 0 {
			_, err := pgidem.Do(ctx, coord, "replay", "f"+strconv.Itoa(mrand.IntN(scaleSmall)), testTTL, nil, fn)
			return err
		}
		_, err := pgidem.Do(ctx, coord, "fresh", prefix+strconv.FormatInt(seq.Add(1), 10), testTTL, nil, fn)
		return err
	}
	var swept int64
	var sweepTime time.Duration
	sweeping := func(side int) func() {
		if side == 0 {
			return func() {}
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		start := time.Now()
		go func() {
			defer close(done)
			res, err := coord.Sweep(ctx, nil)
			if res != nil {
				swept += res.Records
			}
			if err != nil && ctx.Err() == nil {
				b.Error(err)
			}
		}()
		return func() { cancel(); <-done; sweepTime += time.Since(start) }
	}
	lat := runLatencyCell(b, []latencySide{{"alone", call}, {"sweeping", call}}, sweeping)
	alone, during := p99(lat[0]), p99(lat[1])
	b.ReportMetric(alone, "p99-alone-ms")
	b.ReportMetric(during, "p99-sweeping-ms")
	b.ReportMetric(during/alone-1, "p99-increase")
	b.ReportMetric(float64(swept)/sweepTime.Seconds(), "sweep-rows/s")
}

// churnDuration returns how long BenchmarkChurn runs: PGIDEM_CHURN_DURATION, default 10
// minutes.
func churnDuration(b *testing.B) time.Duration {
	s := os.Getenv("PGIDEM_CHURN_DURATION")
	if s == "" {
		return 10 * time.Minute
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < time.Minute {
		b.Fatalf("PGIDEM_CHURN_DURATION=%q: want a duration of at least 1m", s)
	}
	return d
}

// BenchmarkChurn measures what steady churn leaves in the table: fresh keys at 500 calls
// per second with a 30 s TTL, a sweep every 5 s at its default pace, and autovacuum, for
// PGIDEM_CHURN_DURATION (default 10 minutes). The server is a throwaway cluster of its own
// (clusterPool), so its autovacuum settings are known whatever the shared test
// server's are: Postgres's defaults, or tuned (autovacuum_naptime 10 s, and on
// pgidem_record autovacuum_vacuum_scale_factor 0.02). It reports the table's size (with its
// indexes and TOAST) over the size of a packed copy of its live records with the same
// indexes (size-ratio), the live records, and the autovacuum runs.
//
//	make bench-scale
func BenchmarkChurn(b *testing.B) {
	for _, tuned := range []bool{false, true} {
		name := "autovacuum=default"
		if tuned {
			name = "autovacuum=tuned"
		}
		b.Run(name, func(b *testing.B) { churn(b, tuned) })
	}
}

// churnTuning is the autovacuum tuning of BenchmarkChurn's tuned case.
var churnTuning = []string{
	`ALTER SYSTEM SET autovacuum_naptime = '10s'`,
	`SELECT pg_reload_conf()`,
	`ALTER TABLE pgidem_record SET (autovacuum_vacuum_scale_factor = 0.02)`,
}

func churn(b *testing.B, tuned bool) {
	const (
		rate = 500 // calls per second
		ttl  = 30 * time.Second
	)
	_, pool := clusterPool(b, 32)
	if tuned {
		for _, stmt := range churnTuning {
			if _, err := pool.Exec(context.Background(), stmt); err != nil {
				b.Fatal(err)
			}
		}
	}
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Lease: 5 * time.Second, MinTTL: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), churnDuration(b))
	defer cancel()
	fn := func(context.Context) (string, error) { return "em_1", nil }
	prefix := benchsql.KeyPrefix()
	var seq atomic.Int64
	var swept int64
	var wg sync.WaitGroup
	wg.Go(func() { // the callers, paced
		tick := time.NewTicker(time.Second / rate)
		defer tick.Stop()
		sem := make(chan struct{}, scaleCallers)
		var calls sync.WaitGroup
		defer calls.Wait()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			sem <- struct{}{}
			calls.Go(func() {
				defer func() { <-sem }()
				_, err := pgidem.Do(context.WithoutCancel(ctx), coord, "churn", prefix+strconv.FormatInt(seq.Add(1), 10), ttl, nil, fn)
				if err != nil {
					b.Error(err)
				}
			})
		}
	})
	wg.Go(func() { // the sweeper
		tick := time.NewTicker(5 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			res, err := coord.Sweep(ctx, nil)
			swept += res.Records
			if err != nil && ctx.Err() == nil {
				b.Error(err)
			}
		}
	})
	wg.Wait()

	bg := context.Background()
	var total, live int64
	var autovacuums int64
	if err := pool.QueryRow(bg, `SELECT pg_total_relation_size('pgidem_record'),
			(SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'pgidem_record'::regclass)`).Scan(&total, &autovacuums); err != nil {
		b.Fatal(err)
	}
	var liveRecords int64
	for _, stmt := range []string{
		`CREATE TABLE churn_live (LIKE pgidem_record INCLUDING INDEXES)`,
		`INSERT INTO churn_live SELECT * FROM pgidem_record WHERE expires_at > now()`,
	} {
		tag, err := pool.Exec(bg, stmt)
		if err != nil {
			b.Fatal(err)
		}
		liveRecords += tag.RowsAffected()
	}
	if err := pool.QueryRow(bg, `SELECT pg_total_relation_size('churn_live')`).Scan(&live); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(total)/float64(live), "size-ratio")
	b.ReportMetric(float64(liveRecords), "live-records")
	b.ReportMetric(float64(autovacuums), "autovacuums")
	b.ReportMetric(float64(swept), "swept-rows")
}
