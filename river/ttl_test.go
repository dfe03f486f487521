package pgidemriver_test

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
	pgidemriver "github.com/pgidem/pgidem/river"
)

// WeeklyArgs keep their records for a week and retry three times.
type WeeklyArgs struct{}

func (WeeklyArgs) Kind() string { return "report.weekly" }

func (WeeklyArgs) IdempotencyKey() string { return "week" }

func (WeeklyArgs) IdempotencyTTL() time.Duration { return 7 * 24 * time.Hour }

func (WeeklyArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{MaxAttempts: 3} }

// ShortTTLArgs ask for a TTL the coordinator refuses (below its one-minute MinTTL).
type ShortTTLArgs struct{}

func (ShortTTLArgs) Kind() string { return "report.short" }

func (ShortTTLArgs) IdempotencyKey() string { return "short" }

func (ShortTTLArgs) IdempotencyTTL() time.Duration { return 30 * time.Second }

type constantPolicy time.Duration

func (p constantPolicy) NextRetry(*rivertype.JobRow) time.Time {
	return time.Now().Add(time.Duration(p))
}

func TestRetryHorizon(t *testing.T) {
	t.Parallel()
	// River's default: n^4 s after the n-th failure, +10 % jitter at most.
	require.Equal(t, time.Duration((1+16)*1.1*float64(time.Second)), pgidemriver.RetryHorizon(nil, 3))
	require.Equal(t, pgidemriver.RetryHorizon(nil, 3), pgidemriver.RetryHorizon(&river.DefaultClientRetryPolicy{}, 3))
	require.Zero(t, pgidemriver.RetryHorizon(nil, 1))
	// 25 attempts (River's default) span about three weeks.
	require.InDelta(t, 22.4, pgidemriver.RetryHorizon(nil, river.MaxAttemptsDefault).Hours()/24, 0.1)

	got := pgidemriver.RetryHorizon(constantPolicy(10*time.Second), 3)
	require.InDelta(t, (20 * time.Second).Seconds(), got.Seconds(), 0.5)
}

func TestCheckTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// NewCoordinator and CheckTTL never touch the database.
	pool, err := pgxpool.New(ctx, "postgres://127.0.0.1:1/none")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	coord, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)
	mw, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{Logger: testLogger(t)})
	require.NoError(t, err)
	mw.Register(InvoiceArgs{}, WeeklyArgs{}, pgidemriver.SweepArgs{})

	// River's defaults: 25 attempts and 7 days of discarded retention outlive 24 h.
	warnings := mw.CheckTTL(ctx, &river.Config{})
	require.Len(t, warnings, 2)
	require.Equal(t, "mail.invoice", warnings[0].Kind)
	require.Equal(t, pgidemriver.TTLDefault, warnings[0].TTL)
	require.Equal(t, river.MaxAttemptsDefault, warnings[0].MaxAttempts)
	require.Equal(t, pgidemriver.DiscardedJobRetentionDefault, warnings[0].DiscardedRetention)
	require.Equal(t, pgidemriver.CompletedJobRetentionDefault, warnings[0].CompletedRetention)
	require.Equal(t, pgidemriver.RescueStuckJobsAfterDefault, warnings[0].Rescue)
	require.Equal(t, warnings[0].Rescue+warnings[0].Retries+warnings[0].DiscardedRetention, warnings[0].Horizon)
	require.Equal(t, "report.weekly", warnings[1].Kind)
	require.Equal(t, 3, warnings[1].MaxAttempts)
	require.Equal(t, 7*24*time.Hour, warnings[1].TTL)

	// Few attempts and short retention periods: both kinds covered.
	short := &river.Config{MaxAttempts: 5, DiscardedJobRetentionPeriod: 12 * time.Hour,
		CompletedJobRetentionPeriod: 12 * time.Hour, CancelledJobRetentionPeriod: 12 * time.Hour}
	require.Empty(t, mw.CheckTTL(ctx, short))

	// A completed job is kept (and can be retried by hand) for its retention counted from
	// its end, which comes after the rescuer's delay when River lost the completion: 24 h
	// of completed retention is not covered by a 24 h TTL, even with short retries.
	warnings = mw.CheckTTL(ctx, &river.Config{MaxAttempts: 5, DiscardedJobRetentionPeriod: 12 * time.Hour})
	require.Len(t, warnings, 1)
	require.Equal(t, "mail.invoice", warnings[0].Kind)
	require.Equal(t, time.Hour+warnings[0].Retries+24*time.Hour, warnings[0].Horizon)

	// The rescuer's delay is River's: RescueStuckJobsAfter, else an hour plus JobTimeout.
	// A record that outlives the retention alone, but not the rescue before it, warns.
	month := 30 * 24 * time.Hour
	mw30, err := pgidemriver.NewMiddleware(coord, &pgidemriver.Config{TTL: month, Logger: testLogger(t)})
	require.NoError(t, err)
	mw30.Register(InvoiceArgs{})
	warnings = mw30.CheckTTL(ctx, &river.Config{MaxAttempts: 2, RescueStuckJobsAfter: 48 * time.Hour,
		CompletedJobRetentionPeriod: month, DiscardedJobRetentionPeriod: time.Hour})
	require.Len(t, warnings, 1)
	require.Equal(t, 48*time.Hour, warnings[0].Rescue)
	require.Equal(t, 48*time.Hour+warnings[0].Retries+month, warnings[0].Horizon)
	warnings = mw30.CheckTTL(ctx, &river.Config{MaxAttempts: 2, JobTimeout: 2 * time.Hour,
		CompletedJobRetentionPeriod: month - 2*time.Hour, DiscardedJobRetentionPeriod: time.Hour})
	require.Len(t, warnings, 1)
	require.Equal(t, 3*time.Hour, warnings[0].Rescue)
	require.Empty(t, mw30.CheckTTL(ctx, &river.Config{MaxAttempts: 2, JobTimeout: -1,
		CompletedJobRetentionPeriod: month - 2*time.Hour, DiscardedJobRetentionPeriod: time.Hour}),
		"no job timeout: River's rescuer waits its default hour")

	// Discarded jobs kept forever can be retried by hand forever.
	warnings = mw.CheckTTL(ctx, &river.Config{MaxAttempts: 5, DiscardedJobRetentionPeriod: -1})
	require.Len(t, warnings, 2)
	require.Equal(t, pgidemriver.HorizonInfinite, warnings[0].Horizon)

	// So can completed and cancelled jobs (River's JobRetry runs a finished job again): a
	// record must outlive their retention too.
	warnings = mw.CheckTTL(ctx, &river.Config{MaxAttempts: 5, DiscardedJobRetentionPeriod: 12 * time.Hour,
		CompletedJobRetentionPeriod: -1})
	require.Len(t, warnings, 2)
	require.Equal(t, pgidemriver.HorizonInfinite, warnings[0].Horizon)
	warnings = mw.CheckTTL(ctx, &river.Config{MaxAttempts: 5, DiscardedJobRetentionPeriod: 12 * time.Hour,
		CancelledJobRetentionPeriod: month})
	require.Len(t, warnings, 2)
	require.Equal(t, month, warnings[0].CompletedRetention)
	require.Equal(t, time.Hour+warnings[0].Retries+month, warnings[0].Horizon)
}

// A custom retry policy is asked at most RetryHorizonPolicyCalls times; a huge MaxAttempts
// (the usual way to say "retry forever") is counted at the last delay instead of taking
// time quadratic in it.
func TestRetryHorizonHugeMaxAttempts(t *testing.T) {
	t.Parallel()
	got := pgidemriver.RetryHorizon(constantPolicy(time.Hour), 1_000_000)
	require.InDelta(t, float64(999_999), got.Hours(), 1)
	require.Equal(t, pgidemriver.HorizonInfinite, pgidemriver.RetryHorizon(constantPolicy(time.Hour), math.MaxInt))
	// River replaces a retry time in the past with its default policy's.
	require.Equal(t, pgidemriver.RetryHorizon(nil, 25), pgidemriver.RetryHorizon(constantPolicy(-time.Second), 25))
	require.Equal(t, pgidemriver.HorizonInfinite, pgidemriver.RetryHorizon(constantPolicy(-time.Second), math.MaxInt))
}
