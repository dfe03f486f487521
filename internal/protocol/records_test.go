package protocol

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// fakeClock is a clock whose time moves only when a sweep sleeps (by the sleep) or a
// statement runs (by step per reading); it records every sleep.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	step   time.Duration
	sleeps []time.Duration
}

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now = f.now.Add(f.step)
	return f.now
}

func (f *fakeClock) Sleep(ctx context.Context, d time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sleeps = append(f.sleeps, d)
	f.now = f.now.Add(d)
	return ctx.Err()
}

// sweepFixture returns an engine on a fresh database holding n expired records, with a
// fake clock that advances step at each reading.
func sweepFixture(t *testing.T, n int, step time.Duration) (*Engine, *fakeClock) {
	t.Helper()
	db := testdb.New(t)
	c, err := newTestEngine(db.Pool, Settings{})
	require.NoError(t, err)
	_, err = db.Pool.Exec(context.Background(), `
		INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
		SELECT 'ns', 'k' || i, 'completed', gen_random_uuid(), '1', now() - interval '1 second', now() - interval '1 hour'
		FROM generate_series(1, $1) AS i`, n)
	require.NoError(t, err)
	fc := &fakeClock{now: time.Unix(0, 0), step: step}
	c.clock = fc
	return c, fc
}

// A paced sweep sleeps after each full batch until the batch's rows fit the rate, less the
// time the batch took, and reports the rate it reached on its clock.
func TestSweepPacesFullBatches(t *testing.T) {
	t.Parallel()
	c, fc := sweepFixture(t, 25, time.Millisecond) // each clock reading advances 1 ms
	res, err := c.Sweep(context.Background(), &SweepOpts{BatchSize: 10, RowsPerSecond: 100})
	require.NoError(t, err)
	require.Equal(t, int64(25), res.Records)
	// Batches of 10, 10 and 5: a sleep after each full batch, none after the last. A batch
	// of 10 at 100 rows/s is due 100 ms after it started; its two readings took 1 ms.
	require.Equal(t, []time.Duration{99 * time.Millisecond, 99 * time.Millisecond}, fc.sleeps)
	// Swept over the sleeps plus 8 readings of 1 ms (start, 3 batches × 2, end... counted
	// from the first reading): 25 rows in 205 ms.
	require.InDelta(t, 25/0.205, res.RowsPerSecond, 1)
}

// Pause is the shortest sleep between batches, also when the rate allows less; unpaced,
// only Pause applies, and without either a sweep never sleeps.
func TestSweepPauseAndUnpaced(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		opts   SweepOpts
		sleeps []time.Duration
	}{
		{"PauseAboveRate", SweepOpts{BatchSize: 10, RowsPerSecond: 1000, Pause: 50 * time.Millisecond},
			[]time.Duration{50 * time.Millisecond, 50 * time.Millisecond}},
		{"RateAbovePause", SweepOpts{BatchSize: 10, RowsPerSecond: 50, Pause: 50 * time.Millisecond},
			[]time.Duration{200 * time.Millisecond, 200 * time.Millisecond}},
		{"UnpacedWithPause", SweepOpts{BatchSize: 10, RowsPerSecond: SweepUnpaced, Pause: time.Millisecond},
			[]time.Duration{time.Millisecond, time.Millisecond}},
		{"Unpaced", SweepOpts{BatchSize: 10, RowsPerSecond: SweepUnpaced}, nil},
		{"DefaultRate", SweepOpts{BatchSize: 10},
			[]time.Duration{10 * time.Second / SweepRowsPerSecondDefault, 10 * time.Second / SweepRowsPerSecondDefault}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c, fc := sweepFixture(t, 25, 0) // the clock stands still but for the sleeps
			res, err := c.Sweep(context.Background(), &tc.opts)
			require.NoError(t, err)
			require.Equal(t, int64(25), res.Records)
			require.Equal(t, tc.sleeps, fc.sleeps)
		})
	}
}

// MaxBatches bounds the batches per table; a rate below SweepUnpaced is refused.
func TestSweepMaxBatchesAndInvalidRate(t *testing.T) {
	t.Parallel()
	c, fc := sweepFixture(t, 25, 0)
	res, err := c.Sweep(context.Background(), &SweepOpts{BatchSize: 10, MaxBatches: 2, RowsPerSecond: 100})
	require.NoError(t, err)
	require.Equal(t, int64(20), res.Records)
	require.Equal(t, []time.Duration{100 * time.Millisecond}, fc.sleeps, "a sleep between batches, none after the last")
	_, err = c.Sweep(context.Background(), &SweepOpts{RowsPerSecond: -2})
	require.ErrorIs(t, err, ErrInvalidArgument)
}

// The adaptive order reserves first in a namespace of fresh keys and reads first once most
// of its calls find a record.
func TestAdaptiveOrderFollowsReplayShare(t *testing.T) {
	t.Parallel()
	s := newOrderStats()
	require.True(t, s.reserveFirst("jobs"), "a namespace without history reserves first")
	for range 200 {
		s.observe("replays", true)
	}
	require.False(t, s.reserveFirst("replays"))
	mixed := newOrderStats()
	for i := range 200 { // half and half stays on the reserving side
		mixed.observe("mixed", i%2 == 0)
		require.True(t, mixed.reserveFirst("mixed"))
	}
	for range 200 {
		s.observe("replays", false)
	}
	require.True(t, s.reserveFirst("replays"), "fresh keys again: back to reserving first")
}
