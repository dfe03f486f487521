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

// River's default retention periods (River v0.51), used by [Middleware.CheckTTL] for a
// river.Config field left zero.
const (
	// DiscardedJobRetentionDefault is River's default DiscardedJobRetentionPeriod (7 days).
	DiscardedJobRetentionDefault = 7 * 24 * time.Hour
	// CompletedJobRetentionDefault is River's default CompletedJobRetentionPeriod (24 h).
	CompletedJobRetentionDefault = 24 * time.Hour
	// CancelledJobRetentionDefault is River's default CancelledJobRetentionPeriod (24 h).
	CancelledJobRetentionDefault = 24 * time.Hour
	// RescueStuckJobsAfterDefault is River's default RescueStuckJobsAfter (1 h); River adds
	// the client's JobTimeout to it when JobTimeout is set and RescueStuckJobsAfter is not.
	RescueStuckJobsAfterDefault = time.Hour
)

// HorizonInfinite is the horizon [Middleware.CheckTTL] reports when River keeps finished
// jobs forever (a retention period of -1): such a job can be retried by hand at any time.
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
	// Rescue is how long River's rescuer waits before it retries a job still running:
	// the client's RescueStuckJobsAfter, else [RescueStuckJobsAfterDefault] plus its
	// JobTimeout. A job whose effect completed but whose completion River lost (a crash
	// after the worker returned) is redelivered that much later.
	Rescue time.Duration
	// Retries is the longest total delay of River's retry schedule across MaxAttempts
	// ([RetryHorizon]).
	Retries time.Duration
	// DiscardedRetention is how long River keeps a discarded job, during which it can be
	// retried by hand; [HorizonInfinite] when kept forever.
	DiscardedRetention time.Duration
	// CompletedRetention is the longer of how long River keeps a completed and a cancelled
	// job, during which river.Client.JobRetry can run it again by hand (it then replays
	// the record while the record lasts); [HorizonInfinite] when kept forever. It counts
	// from the job's end, which can come Rescue + Retries after the effect.
	CompletedRetention time.Duration
	// Horizon is Rescue + Retries + the longer of DiscardedRetention and
	// CompletedRetention, or [HorizonInfinite].
	Horizon time.Duration
}

// CheckTTL compares the record TTL of every job kind registered with m ([AddWorker],
// [Middleware.Register]) with its redelivery horizon under riverConfig, and logs a warning
// for each kind whose TTL is shorter. It returns the warnings, sorted by kind; none means
// every registered kind is covered. It does not touch the database.
//
// The horizon is how long after the effect completed a delivery of the same job can still
// come. It adds three parts:
//   - the rescuer's delay for a job whose completion River lost
//     (riverConfig.RescueStuckJobsAfter, [TTLWarning.Rescue]).
//   - River's retry schedule across the kind's MaxAttempts ([RetryHorizon], with
//     riverConfig.RetryPolicy).
//   - the longest time River then keeps the finished job, during which River's JobRetry
//     can run it again by hand: the discarded, completed and cancelled job retention
//     periods.
//
// [NewClient] runs it when it creates the client. Otherwise call it with the river.Config
// you pass to river.NewClient, before Client.Start; River has no hook that would let the
// middleware run it by itself. "TTL horizon" in the package documentation says how to
// choose TTLs. A worker that overrides NextRetry is not seen. Safe for concurrent use,
// also with [Middleware.Register].
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

	retention := retentionOrDefault(riverConfig.DiscardedJobRetentionPeriod, DiscardedJobRetentionDefault)
	completed := max(retentionOrDefault(riverConfig.CompletedJobRetentionPeriod, CompletedJobRetentionDefault),
		retentionOrDefault(riverConfig.CancelledJobRetentionPeriod, CancelledJobRetentionDefault))
	rescue := riverConfig.RescueStuckJobsAfter
	if rescue <= 0 { // as River's client does
		rescue = RescueStuckJobsAfterDefault + max(riverConfig.JobTimeout, 0)
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
		horizon := saturatingSum(rescue, retries, max(retention, completed))
		if ttl >= horizon {
			continue
		}
		w := TTLWarning{Kind: kind, TTL: ttl, MaxAttempts: maxAttempts, Rescue: rescue, Retries: retries,
			DiscardedRetention: retention, CompletedRetention: completed, Horizon: horizon}
		warnings = append(warnings, w)
		horizonText := "infinite (finished jobs are kept forever)"
		if horizon != HorizonInfinite {
			horizonText = horizon.Round(time.Minute).String()
		}
		m.config.Logger.WarnContext(ctx, "pgidemriver: record TTL is shorter than River's redelivery horizon; "+
			"a late retry or a job retried by hand would run the effect again",
			slog.String("job_kind", kind), slog.Duration("ttl", ttl), slog.Int("max_attempts", maxAttempts),
			slog.Duration("rescue", rescue), slog.Duration("retries", retries.Round(time.Minute)),
			slog.Duration("discarded_retention", retention), slog.Duration("completed_retention", completed),
			slog.String("horizon", horizonText))
	}
	return warnings
}

// saturatingSum adds durations, saturating at [HorizonInfinite].
func saturatingSum(ds ...time.Duration) time.Duration {
	var total time.Duration
	for _, d := range ds {
		if d >= HorizonInfinite-total {
			return HorizonInfinite
		}
		total += d
	}
	return total
}

// retentionOrDefault reads a river.Config retention period: 0 means River's default, a
// negative value (-1) keeps jobs forever.
func retentionOrDefault(set, def time.Duration) time.Duration {
	switch {
	case set < 0:
		return HorizonInfinite
	case set == 0:
		return def
	}
	return set
}

// RetryHorizon returns the longest total time River's retry schedule can spread a job's
// maxAttempts attempts over: the sum of the delays after failures 1 to maxAttempts-1.
// policy nil or a *river.DefaultClientRetryPolicy means River's default schedule, whose
// delay after the n-th failure is n⁴ seconds with up to 10 % jitter either way (River
// v0.51, retry_policy.go); the upper bound of the jitter is used. Another policy is asked
// through NextRetry for a job with n-1 recorded errors, once per attempt up to
// [RetryHorizonPolicyCalls] attempts; a time before the call counts at the default
// schedule's delay, as River then uses its default policy. Beyond those attempts each
// further attempt is counted at the last delay (a policy's delays usually grow to a cap).
// Saturates at [HorizonInfinite].
func RetryHorizon(policy river.ClientRetryPolicy, maxAttempts int) time.Duration {
	var total time.Duration
	add := func(d time.Duration) { total = saturatingSum(total, max(d, 0)) }
	defaultDelay := func(n int) time.Duration {
		seconds := math.Pow(float64(n), 4) * 1.1
		if seconds >= HorizonInfinite.Seconds() {
			return HorizonInfinite
		}
		return time.Duration(seconds * float64(time.Second))
	}
	_, isDefault := policy.(*river.DefaultClientRetryPolicy)
	var errs []rivertype.AttemptError // grown once, resliced per attempt
	var last time.Duration
	for n := 1; n < maxAttempts && total < HorizonInfinite; n++ {
		if policy == nil || isDefault {
			add(defaultDelay(n))
			continue
		}
		if n > RetryHorizonPolicyCalls {
			// Attempts n to maxAttempts-1 at the last delay, saturating.
			if remaining := time.Duration(maxAttempts - n); last > 0 {
				if remaining > (HorizonInfinite-total)/last {
					total = HorizonInfinite
				} else {
					total += last * remaining
				}
			}
			break
		}
		if n > 1 {
			errs = append(errs, rivertype.AttemptError{Attempt: n - 1})
		}
		now := time.Now()
		job := &rivertype.JobRow{Attempt: n, AttemptedAt: &now, MaxAttempts: maxAttempts,
			Errors: errs[: n-1 : n-1], State: rivertype.JobStateRunning}
		last = policy.NextRetry(job).Sub(now)
		if last < 0 {
			last = defaultDelay(n)
		}
		add(last)
	}
	return total
}

// RetryHorizonPolicyCalls is the most attempts [RetryHorizon] asks a custom retry policy
// about (10 000).
const RetryHorizonPolicyCalls = 10_000
