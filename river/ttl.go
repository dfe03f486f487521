package pgidemriver

import (
	"context"
	"log/slog"
	"math"
	"sort"
	"time"

	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"
)

// DiscardedJobRetentionDefault is River's default river.Config.DiscardedJobRetentionPeriod
// (7 days, River v0.51), used by [Middleware.CheckTTL] when the config leaves it zero.
const DiscardedJobRetentionDefault = 7 * 24 * time.Hour

// HorizonInfinite is the horizon [Middleware.CheckTTL] reports when discarded jobs are
// kept forever (river.Config.DiscardedJobRetentionPeriod -1): a discarded job can be
// retried by hand at any time.
const HorizonInfinite = time.Duration(math.MaxInt64)

// TTLWarning reports a job kind whose record TTL is shorter than its redelivery horizon: a
// delivery of the job after the record expired runs the effect again.
type TTLWarning struct {
	// Kind is the job kind.
	Kind string
	// TTL is the record TTL the middleware uses for the kind.
	TTL time.Duration
	// MaxAttempts is the kind's max attempts (the args' InsertOpts, else the client's).
	MaxAttempts int
	// Retries is the longest total delay of River's retry schedule across MaxAttempts
	// ([RetryHorizon]).
	Retries time.Duration
	// DiscardedRetention is how long River keeps a discarded job, during which it can be
	// retried by hand; [HorizonInfinite] when kept forever.
	DiscardedRetention time.Duration
	// Horizon is Retries + DiscardedRetention, or [HorizonInfinite].
	Horizon time.Duration
}

// CheckTTL compares the record TTL of every job kind registered with m ([AddWorker],
// [Middleware.Register]) with its redelivery horizon under riverConfig — River's retry
// schedule across the kind's MaxAttempts ([RetryHorizon], with riverConfig.RetryPolicy),
// plus riverConfig.DiscardedJobRetentionPeriod, during which a discarded job can still be
// retried by hand — and logs a warning for each kind whose TTL is shorter. It returns the
// warnings, sorted by kind; none means every registered kind is covered.
//
// [NewClient] runs it when it creates the client. Otherwise call it with the river.Config
// you pass to river.NewClient, before Client.Start: River v0.51 has no hook that runs when
// a client starts and lists its registered workers (the Workers bundle is opaque, and
// HookPeriodicJobsStart runs only on the leader), so the middleware cannot run the check
// by itself. It does not touch the database.
//
// The horizon is deliberately conservative: it assumes every attempt before the last
// could be the one whose completion River lost. With River's defaults (25 attempts, about
// 3 weeks of retries, 7 days of discarded retention) it is about a month, longer than
// [TTLDefault]: give effect jobs fewer attempts, a longer TTL ([TTLArgs], [Config.TTL]),
// or a shorter discarded retention. A worker that overrides NextRetry is not seen.
func (m *Middleware) CheckTTL(ctx context.Context, riverConfig *river.Config) []TTLWarning {
	if riverConfig == nil {
		riverConfig = &river.Config{}
	}
	m.mu.RLock()
	seen := map[*kindInfo]bool{}
	var infos []*kindInfo
	for _, info := range m.kinds {
		if !seen[info] {
			seen[info] = true
			infos = append(infos, info)
		}
	}
	m.mu.RUnlock()
	sort.Slice(infos, func(i, j int) bool { return infos[i].args.Kind() < infos[j].args.Kind() })

	retention := riverConfig.DiscardedJobRetentionPeriod
	switch {
	case retention == 0:
		retention = DiscardedJobRetentionDefault
	case retention < 0:
		retention = HorizonInfinite
	}

	var warnings []TTLWarning
	for _, info := range infos {
		kind := info.args.Kind()
		if m.exclude[kind] {
			continue
		}
		ttl := m.config.TTL
		if info.ttl > 0 {
			ttl = info.ttl
		}
		maxAttempts := riverConfig.MaxAttempts
		if withOpts, ok := info.args.(river.JobArgsWithInsertOpts); ok && withOpts.InsertOpts().MaxAttempts > 0 {
			maxAttempts = withOpts.InsertOpts().MaxAttempts
		}
		if maxAttempts <= 0 {
			maxAttempts = river.MaxAttemptsDefault
		}
		retries := RetryHorizon(riverConfig.RetryPolicy, maxAttempts)
		horizon := HorizonInfinite
		if retention != HorizonInfinite && retries < HorizonInfinite-retention {
			horizon = retries + retention
		}
		if ttl >= horizon {
			continue
		}
		w := TTLWarning{Kind: kind, TTL: ttl, MaxAttempts: maxAttempts, Retries: retries,
			DiscardedRetention: retention, Horizon: horizon}
		warnings = append(warnings, w)
		horizonText := "infinite (discarded jobs are kept forever)"
		if horizon != HorizonInfinite {
			horizonText = horizon.Round(time.Minute).String()
		}
		m.config.Logger.WarnContext(ctx, "pgidemriver: record TTL is shorter than River's redelivery horizon; "+
			"a late retry or a hand-retried discarded job would run the effect again",
			slog.String("job_kind", kind), slog.Duration("ttl", ttl), slog.Int("max_attempts", maxAttempts),
			slog.Duration("retries", retries.Round(time.Minute)),
			slog.Duration("discarded_retention", retention), slog.String("horizon", horizonText))
	}
	return warnings
}

// RetryHorizon returns the longest total time River's retry schedule can spread a job's
// maxAttempts attempts over: the sum of the delays after failures 1 to maxAttempts-1.
// policy nil or a *river.DefaultClientRetryPolicy means River's default schedule, whose
// delay after the n-th failure is n⁴ seconds with up to 10 % jitter either way (River
// v0.51, retry_policy.go); the upper bound of the jitter is used. Another policy is asked
// through NextRetry for a job with n-1 recorded errors, once per attempt. Saturates at
// [HorizonInfinite].
func RetryHorizon(policy river.ClientRetryPolicy, maxAttempts int) time.Duration {
	var total time.Duration
	add := func(d time.Duration) {
		if d > 0 {
			if total > HorizonInfinite-d {
				total = HorizonInfinite
				return
			}
			total += d
		}
	}
	_, isDefault := policy.(*river.DefaultClientRetryPolicy)
	for n := 1; n < maxAttempts && total < HorizonInfinite; n++ {
		if policy == nil || isDefault {
			seconds := math.Pow(float64(n), 4) * 1.1
			if seconds >= HorizonInfinite.Seconds() {
				add(HorizonInfinite)
				continue
			}
			add(time.Duration(seconds * float64(time.Second)))
			continue
		}
		now := time.Now()
		job := &rivertype.JobRow{Attempt: n, AttemptedAt: &now, MaxAttempts: maxAttempts,
			Errors: make([]rivertype.AttemptError, n-1), State: rivertype.JobStateRunning}
		add(policy.NextRetry(job).Sub(now))
	}
	return total
}
