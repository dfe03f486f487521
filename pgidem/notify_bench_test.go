package pgidem_test

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

// BenchmarkWakeup measures how long after a holder's fn returns a caller waiting for the
// key (in another coordinator) returns the replayed value: polling only (the default
// backoff from 10 ms to 1 s) against notifications. The holder keeps the key for 100 ms,
// so a poller is well into its backoff. It reports the p50 and p99 of that delay, which
// includes the holder's completing write, and the p50 counted from the holder's return
// (its completion committed).
func BenchmarkWakeup(b *testing.B) {
	for _, side := range []struct {
		name     string
		pollOnly bool
	}{{"polling", true}, {"notified", false}} {
		b.Run(side.name, func(b *testing.B) {
			db := testdb.New(b)
			ctx := context.Background()
			holder, err := pgidem.NewCoordinator(db.Pool, nil)
			if err != nil {
				b.Fatal(err)
			}
			waiter, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{PollOnly: side.pollOnly})
			if err != nil {
				b.Fatal(err)
			}
			delays := make([]time.Duration, 0, b.N)
			afterCommit := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				key := "k" + strconv.Itoa(i)
				started, finished, committed := make(chan struct{}), make(chan time.Time, 1), make(chan time.Time, 1)
				go func() {
					_, err := pgidem.Do(ctx, holder, "bench", key, testTTL, nil, func(context.Context) (int, error) {
						close(started)
						time.Sleep(100 * time.Millisecond)
						finished <- time.Now()
						return i, nil
					})
					committed <- time.Now()
					if err != nil {
						b.Error(err)
					}
				}()
				<-started
				got, err := pgidem.Do(ctx, waiter, "bench", key, testTTL, nil, func(context.Context) (int, error) { return -1, nil })
				returned := time.Now()
				if err != nil || got != i {
					b.Fatalf("waiter got %d, %v", got, err)
				}
				delays = append(delays, returned.Sub(<-finished))
				afterCommit = append(afterCommit, returned.Sub(<-committed))
			}
			b.StopTimer()
			slices.Sort(delays)
			b.ReportMetric(float64(delays[len(delays)/2].Microseconds())/1000, "p50-ms")
			b.ReportMetric(float64(delays[(len(delays)*99)/100].Microseconds())/1000, "p99-ms")
			slices.Sort(afterCommit)
			b.ReportMetric(float64(afterCommit[len(afterCommit)/2].Microseconds())/1000, "p50-after-commit-ms")
		})
	}
}
