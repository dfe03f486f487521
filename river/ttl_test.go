package pgidemriver_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math"
	"strings"
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

// WeeklyArgs keep their records for a week and retry three times.
type WeeklyArgs struct{}

func (WeeklyArgs) Kind() string                  { return "report.weekly" }
func (WeeklyArgs) IdempotencyKey() string        { return "week" }
func (WeeklyArgs) IdempotencyTTL() time.Duration { return 7 * 24 * time.Hour }
func (WeeklyArgs) InsertOpts() river.InsertOpts  { return river.InsertOpts{MaxAttempts: 3} }

// ShortTTLArgs ask for a TTL the coordinator refuses (below its one-minute MinTTL).
type ShortTTLArgs struct{}

func (ShortTTLArgs) Kind() string                  { return "report.short" }
func (ShortTTLArgs) IdempotencyKey() string        { return "short" }
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

func TestNewClientChecksTTL(t *testing.T) {
	t.Parallel()
	mw, logs, pool := offlineMiddleware(t)
	mw.Register(InvoiceArgs{})

	client, err := pgidemriver.NewClient(riverpgxv5.New(pool), &river.Config{Middleware: []rivertype.Middleware{mw}})
	require.NoError(t, err)
	require.NotNil(t, client)
	require.Contains(t, logs.String(), "record TTL is shorter than River's redelivery horizon")
	require.Contains(t, logs.String(), "job_kind=mail.invoice")

	// Installed as a plugin (River's preferred field) or through the deprecated
	// WorkerMiddleware: checked too, once each even when listed twice. It used to be
	// checked only in Middleware.
	for _, config := range []*river.Config{
		{Plugins: []rivertype.Plugin{mw, mw}},
		{WorkerMiddleware: []rivertype.WorkerMiddleware{mw}}, // the deprecated field, on purpose
	} {
		logs.Reset()
		_, err := pgidemriver.NewClient(riverpgxv5.New(pool), config)
		require.NoError(t, err)
		require.Equal(t, 1, strings.Count(logs.String(), "job_kind=mail.invoice"), logs.String())
	}
}

// Register says at once when a kind's TTLArgs TTL is one the coordinator refuses, rather
// than leaving every job of the kind to fail; it panics with a clear message on nil args.
func TestRegisterRefusedTTL(t *testing.T) {
	t.Parallel()
	mw, logs, _ := offlineMiddleware(t)
	mw.Register(WeeklyArgs{})
	require.Empty(t, logs.String())
	mw.Register(ShortTTLArgs{})
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "job_kind=report.short")
	require.PanicsWithValue(t, "pgidemriver: Register: nil job args", func() { mw.Register(nil) })
}

// longKind is a kind River accepts but longer than a pgidem namespace (64 bytes).
const longKind = "billing.invoices.monthly_statement_for_enterprise_customers_with_addenda"

type LongKindArgs struct{}

func (LongKindArgs) Kind() string           { return longKind }
func (LongKindArgs) IdempotencyKey() string { return "k" }

type LongKindNamedArgs struct{ LongKindArgs }

func (LongKindNamedArgs) Kind() string                 { return longKind + ".named" }
func (LongKindNamedArgs) IdempotencyNamespace() string { return "billing.statements" }

// A registered kind too long to be its own namespace is logged at error when registered:
// every job of it would fail before its worker runs. Not when the args name their
// namespace.
func TestRegisterKindTooLongForNamespace(t *testing.T) {
	t.Parallel()
	require.Greater(t, len(longKind), pgidem.MaxNamespaceBytesDefault)
	mw, logs, _ := offlineMiddleware(t)
	mw.Register(LongKindNamedArgs{})
	require.Empty(t, logs.String())
	mw.Register(LongKindArgs{})
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), "job_kind="+longKind)
}

type LongKindUnkeyedArgs struct{}

func (LongKindUnkeyedArgs) Kind() string { return longKind + ".unkeyed" }

// Args without a key method take their namespace from Config.KeyFunc when it is set, so a
// long kind is no error there.
func TestRegisterLongKindWithKeyFunc(t *testing.T) {
	t.Parallel()
	mw, logs, _ := offlineMiddleware(t, func(cfg *pgidemriver.Config) {
		cfg.KeyFunc = func(job *rivertype.JobRow) (string, string, bool) { return "statements", fmt.Sprint(job.ID), true }
	})
	mw.Register(LongKindUnkeyedArgs{})
	require.Empty(t, logs.String())
	mw.Register(LongKindArgs{}) // keyed: the kind is its namespace whatever KeyFunc says
	require.Contains(t, logs.String(), "level=ERROR")
}
