package pgidem_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgidem/pgidem/internal/benchsql"
	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// The floor: the fewest statements that make an effect happen once, written by hand as an
// application without a library would. A fresh key is two durable statements, the
// reservation and the owner-conditional completion; a replay is one indexed read of the
// stored result. Both sides encode and decode the same JSON value.
const (
	// floorReserveSQL reserves a fresh key: $1 namespace, $2 key, $3 owner, $4 lease and
	// $5 TTL in microseconds. No row comes back when the key exists.
	floorReserveSQL = `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at)
VALUES ($1, $2, 'in_progress', $3, 1, now() + $4 * interval '1 microsecond', now() + ($4 + $5) * interval '1 microsecond')
ON CONFLICT (namespace, key) DO NOTHING
RETURNING owner`

	// floorCompleteSQL stores the result if the reservation is still the caller's: $1
	// namespace, $2 key, $3 owner, $4 result, $5 TTL in microseconds.
	floorCompleteSQL = `UPDATE pgidem_record SET status = 'completed', result = $4, lease_expires_at = NULL,
	completed_at = now(), expires_at = now() + $5 * interval '1 microsecond', updated_at = now()
WHERE namespace = $1 AND key = $2 AND owner = $3 AND status = 'in_progress'`

	// floorReadSQL reads a stored result: $1 namespace, $2 key.
	floorReadSQL = `SELECT status, result FROM pgidem_record WHERE namespace = $1 AND key = $2`
)

// floorFresh runs a fresh key on the floor: reserve, the effect's value, complete.
func floorFresh(ctx context.Context, pool *pgxpool.Pool, namespace, key string) error {
	owner := pgtype.UUID{Valid: true}
	_, _ = rand.Read(owner.Bytes[:])
	var got pgtype.UUID
	if err := pool.QueryRow(ctx, floorReserveSQL, namespace, key, owner,
		pgidem.LeaseDefault.Microseconds(), testTTL.Microseconds()).Scan(&got); err != nil {
		return fmt.Errorf("floor reserve %s: %w", key, err)
	}
	result, err := json.Marshal("em_1")
	if err != nil {
		return err
	}
	tag, err := pool.Exec(ctx, floorCompleteSQL, namespace, key, owner, result, testTTL.Microseconds())
	if err == nil && tag.RowsAffected() != 1 {
		err = errors.New("floor complete: the reservation is gone")
	}
	return err
}

// floorReplay runs a replay on the floor: read the record and decode its result.
func floorReplay(ctx context.Context, pool *pgxpool.Pool, namespace, key string) error {
	var status string
	var result []byte
	if err := pool.QueryRow(ctx, floorReadSQL, namespace, key).Scan(&status, &result); err != nil {
		return err
	}
	var v string
	if err := json.Unmarshal(result, &v); err != nil || status != "completed" || v != "em_1" {
		return fmt.Errorf("floor replay %s: %s %q %v", key, status, v, err)
	}
	return nil
}

// floorSide is one of the contestants of a cell: call runs one call of caller g.
type floorSide struct {
	name string
	call func(ctx context.Context, g, i int) error
}

// floorSideStats is what a side did over its slices.
type floorSideStats struct {
	calls   int64
	elapsed time.Duration
	mallocs uint64
}

func (s floorSideStats) perSecond() float64 { return float64(s.calls) / s.elapsed.Seconds() }
func (s floorSideStats) allocsPerCall() float64 {
	return float64(s.mallocs) / float64(max(s.calls, 1))
}

// Slices of the cells: each side runs floorSlices slices of floorSliceTime, alternating
// with the others, after one warm-up slice each that is not counted.
const (
	floorSlices    = 8
	floorSliceTime = 500 * time.Millisecond
)

// floorOrder is the order in which round runs the slices of n sides (n even): a balanced
// Latin square (Williams), so that over n rounds each side runs once in each position and,
// within the rounds, once right after each other side. What one side leaves behind (dirty
// pages, WAL to flush) falls on each of the others alike.
func floorOrder(round, n int) []int {
	if n%2 != 0 {
		panic("floorOrder: an odd number of sides")
	}
	order := make([]int, n)
	for j := range n {
		first := 0 // the first row: 0, 1, n-1, 2, n-2, ...
		switch {
		case j%2 == 1:
			first = (j + 1) / 2
		case j > 0:
			first = n - j/2
		}
		order[j] = (first + round) % n
	}
	return order
}

// runFloorCell runs sides in alternating slices with callers goroutines each.
func runFloorCell(b *testing.B, callers int, sides []floorSide) []floorSideStats {
	ctx := context.Background()
	stats := make([]floorSideStats, len(sides))
	for round := -1; round < floorSlices; round++ {
		for _, k := range floorOrder(max(round, 0), len(sides)) {
			st := runFloorSlice(ctx, b, callers, sides[k])
			if round >= 0 {
				stats[k].calls += st.calls
				stats[k].elapsed += st.elapsed
				stats[k].mallocs += st.mallocs
			}
		}
	}
	return stats
}

// runFloorSlice runs side from callers goroutines for floorSliceTime.
func runFloorSlice(ctx context.Context, b *testing.B, callers int, side floorSide) floorSideStats {
	var before, after runtime.MemStats
	var calls atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	runtime.ReadMemStats(&before)
	start := time.Now()
	deadline := start.Add(floorSliceTime)
	for g := range callers {
		wg.Go(func() {
			for i := 0; time.Now().Before(deadline); i++ {
				if err := side.call(ctx, g, i); err != nil {
					once.Do(func() { firstErr = fmt.Errorf("%s: %w", side.name, err) })
					return
				}
				calls.Add(1)
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	if firstErr != nil {
		b.Fatal(firstErr)
	}
	return floorSideStats{calls: calls.Load(), elapsed: elapsed, mallocs: after.Mallocs - before.Mallocs}
}

// replayKeys is how many completed records the replay cells read, at random.
const replayKeys = 1000

// BenchmarkFloor compares pgidem, configured by default, with the floor (the statements
// above, by hand) through one pool of 32 connections, alternating half-second slices in
// one process so the disk's fsync drift cancels. Each sub-benchmark reports both sides'
// calls per second, the ratio pgidem ÷ floor, and allocations per call; ns/op is pgidem's
// wall time per call (1e9 / calls per second). The mixed cell (half replays, half fresh
// keys, 16 callers) runs pgidem three ways — default, always read first, always reserve
// first — and reports the default's ratio to the better of the other two.
//
//	make bench
func BenchmarkFloor(b *testing.B) {
	db := testdb.New(b)
	ctx := context.Background()
	pool := db.NewPool(b, 32)
	coord := newFloorCoordinator(b, pool, pgidem.OrderAdaptive)
	fn := func(context.Context) (string, error) { return "em_1", nil }
	prefix := benchsql.KeyPrefix()
	// Keys are unique across slices and sides, and every side's land at the same place in
	// the primary key: the prefix, one zero-padded sequence for all sides, then the side.
	var seq atomic.Int64
	freshKey := func(side string) string {
		var buf [64]byte
		digits := strconv.AppendInt(buf[32:32], seq.Add(1), 10)
		key := append(buf[:0], prefix...) // 8 characters: the digits start past the padding
		for range 12 - len(digits) {
			key = append(key, '0')
		}
		return string(append(append(key, digits...), side...))
	}
	pgidemCall := func(c *pgidem.Coordinator, namespace, key string) error {
		v, err := pgidem.Do(ctx, c, namespace, key, testTTL, nil, fn)
		if err == nil && v != "em_1" {
			err = fmt.Errorf("pgidem: %s/%s returned %q", namespace, key, v)
		}
		return err
	}
	for i := range replayKeys { // records to replay, completed by hand
		for _, ns := range []string{"replay", "mixed"} {
			if err := floorFresh(ctx, pool, ns, "r"+strconv.Itoa(i)); err != nil {
				b.Fatal(err)
			}
		}
	}
	replayKey := func() string { return "r" + strconv.Itoa(mrand.IntN(replayKeys)) }

	for _, callers := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("fresh/callers=%d", callers), func(b *testing.B) {
			stats := runFloorCell(b, callers, []floorSide{
				{"pgidem", func(context.Context, int, int) error { return pgidemCall(coord, "fresh", freshKey("p")) }},
				{"floor", func(ctx context.Context, _, _ int) error { return floorFresh(ctx, pool, "fresh", freshKey("f")) }},
			})
			reportFloor(b, stats[0], stats[1])
		})
	}
	for _, callers := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("replay/callers=%d", callers), func(b *testing.B) {
			stats := runFloorCell(b, callers, []floorSide{
				{"pgidem", func(context.Context, int, int) error { return pgidemCall(coord, "replay", replayKey()) }},
				{"floor", func(ctx context.Context, _, _ int) error { return floorReplay(ctx, pool, "replay", replayKey()) }},
			})
			reportFloor(b, stats[0], stats[1])
		})
	}
	b.Run("mixed/callers=16", func(b *testing.B) {
		mixed := func(name string, c *pgidem.Coordinator) floorSide {
			return floorSide{name, func(_ context.Context, _, i int) error {
				if i%2 == 0 {
					return pgidemCall(c, "mixed", replayKey())
				}
				return pgidemCall(c, "mixed", freshKey(name))
			}}
		}
		stats := runFloorCell(b, 16, []floorSide{
			mixed("d", coord),
			mixed("r", newFloorCoordinator(b, pool, pgidem.OrderReadFirst)),
			mixed("i", newFloorCoordinator(b, pool, pgidem.OrderReserveFirst)),
			{"floor", func(ctx context.Context, _, i int) error {
				if i%2 == 0 {
					return floorReplay(ctx, pool, "mixed", replayKey())
				}
				return floorFresh(ctx, pool, "mixed", freshKey("f"))
			}},
		})
		reportFloor(b, stats[0], stats[3])
		b.ReportMetric(stats[1].perSecond(), "read-first-calls/s")
		b.ReportMetric(stats[2].perSecond(), "reserve-first-calls/s")
		b.ReportMetric(stats[0].perSecond()/max(stats[1].perSecond(), stats[2].perSecond()), "ratio-vs-best-order")
	})
}

func newFloorCoordinator(b *testing.B, pool *pgxpool.Pool, order pgidem.CallOrder) *pgidem.Coordinator {
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{Order: order})
	if err != nil {
		b.Fatal(err)
	}
	return coord
}

// reportFloor reports pgidem's and the floor's throughput, their ratio and allocations.
func reportFloor(b *testing.B, pg, floor floorSideStats) {
	b.ReportMetric(1e9/pg.perSecond(), "ns/op")
	b.ReportMetric(pg.perSecond(), "pgidem-calls/s")
	b.ReportMetric(floor.perSecond(), "floor-calls/s")
	b.ReportMetric(pg.perSecond()/floor.perSecond(), "ratio")
	b.ReportMetric(pg.allocsPerCall(), "pgidem-allocs/call")
	b.ReportMetric(floor.allocsPerCall(), "floor-allocs/call")
}
