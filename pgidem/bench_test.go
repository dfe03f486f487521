package pgidem_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/benchsql"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// The baselines (internal/benchsql) send the statements pgidem sends, through the same
// pool, with none of the library around them: the ratio pgidem/baseline from one run is the
// library's overhead. A fresh key costs an indexed read (miss), the reserving insert and
// the completing update; a replay costs the indexed read alone. Replay/minimal-read is the
// cheapest possible indexed read of a result, to compare a replay with one indexed read.
const benchMinimalReadSQL = benchsql.MinimalReadSQL

// benchBaselineFresh sends by hand the three statements of a fresh key through pool.
func benchBaselineFresh(ctx context.Context, b testing.TB, pool *pgxpool.Pool, key string) {
	err := benchsql.Fresh(ctx, pool, benchsql.ReadFirst, "bench", key, nil, pgidem.LeaseDefault, testTTL,
		func() ([]byte, error) { return []byte(`"em_1"`), nil })
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkDoConcurrent runs fresh keys from 50 goroutines over a pool of 20 connections:
// the hand-written statements (one of each per call), pgidem with batching off
// (MaxBatch 1), and pgidem as configured by default (concurrent reserving inserts and
// completions share statements). ns/op is wall time per call across all goroutines, so
// calls/s = 1e9 / ns/op.
//
//	go test -run '^$' -bench DoConcurrent -count 6 ./pgidem/
func BenchmarkDoConcurrent(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	pool := db.NewPool(b, 20)
	fn := func(context.Context) (string, error) { return "em_1", nil }
	variants := []struct {
		name string
		call func(key string)
	}{
		{"baseline", func(key string) { benchBaselineFresh(ctx, b, pool, key) }},
	}
	for _, maxBatch := range []int{1, pgidem.MaxBatchDefault} {
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{MaxBatch: maxBatch})
		if err != nil {
			b.Fatal(err)
		}
		variants = append(variants, struct {
			name string
			call func(key string)
		}{fmt.Sprintf("MaxBatch=%d", maxBatch), func(key string) {
			if _, err := pgidem.Do(ctx, coord, "bench", key, testTTL, nil, fn); err != nil {
				b.Fatal(err)
			}
		}})
	}
	for _, v := range variants {
		b.Run(v.name, func(b *testing.B) {
			prefix := benchsql.KeyPrefix()
			var n atomic.Int64
			b.SetParallelism(25) // 25 per GOMAXPROCS: 50 goroutines on this 2-core machine
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					v.call(prefix + strconv.FormatInt(n.Add(1), 10))
				}
			})
		})
	}
}

// BenchmarkDo times pgidem and its raw-pgx baseline interleaved, one call of each per
// iteration, so both see the same moment of the machine (fsync latency on a shared disk
// drifts by tens of percent within a run). It reports each side's ns/op and the ratio.
func BenchmarkDo(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	if err != nil {
		b.Fatal(err)
	}
	fn := func(context.Context) (string, error) { return "em_1", nil }

	doFresh := func(key string) {
		if _, err := pgidem.Do(ctx, coord, "bench", key, testTTL, nil, fn); err != nil {
			b.Fatal(err)
		}
	}
	baselineFresh := func(key string) { benchBaselineFresh(ctx, b, db.Pool, key) }
	doReplay := func() {
		if _, err := pgidem.Do(ctx, coord, "bench", "replayed", testTTL, nil, fn); err != nil {
			b.Fatal(err)
		}
	}
	baselineReplay := func() {
		if _, err := benchsql.Replay(ctx, db.Pool, benchsql.ReadFirst, "bench", "replayed", pgidem.LeaseDefault, testTTL); err != nil {
			b.Fatal(err)
		}
	}
	minimalRead := func() {
		var result []byte
		if err := db.Pool.QueryRow(ctx, benchMinimalReadSQL, "bench", "replayed").Scan(&result); err != nil {
			b.Fatal(err)
		}
	}

	// Warm the fresh database (caches, prepared statements) so neither side pays for
	// coming first.
	prefix := benchsql.KeyPrefix()
	for i := range 200 {
		doFresh(prefix + "w" + strconv.Itoa(i))
		baselineFresh(prefix + "v" + strconv.Itoa(i))
	}
	doReplay()

	b.Run("FreshKey", func(b *testing.B) {
		prefix := benchsql.KeyPrefix()
		var pg, base time.Duration
		i := 0
		for b.Loop() {
			i++
			start := time.Now()
			doFresh(prefix + "p" + strconv.Itoa(i))
			mid := time.Now()
			baselineFresh(prefix + "b" + strconv.Itoa(i))
			pg, base = pg+mid.Sub(start), base+time.Since(mid)
		}
		report(b, i, map[string]time.Duration{"pgidem": pg, "baseline": base})
	})
	b.Run("Replay", func(b *testing.B) {
		var pg, base, minimal time.Duration
		i := 0
		for b.Loop() {
			i++
			t0 := time.Now()
			doReplay()
			t1 := time.Now()
			baselineReplay()
			t2 := time.Now()
			minimalRead()
			pg, base, minimal = pg+t1.Sub(t0), base+t2.Sub(t1), minimal+time.Since(t2)
		}
		report(b, i, map[string]time.Duration{"pgidem": pg, "baseline": base, "minimal-read": minimal})
	})
}

// report adds each side's mean time per call and pgidem's ratio to each baseline.
func report(b *testing.B, n int, sides map[string]time.Duration) {
	if n == 0 {
		return
	}
	for name, d := range sides {
		b.ReportMetric(float64(d.Nanoseconds())/float64(n), name+"-ns/op")
		if name != "pgidem" {
			b.ReportMetric(float64(sides["pgidem"])/float64(d), "ratio-vs-"+name)
		}
	}
}

func micros(d interface{ Microseconds() int64 }) int64 { return d.Microseconds() }
