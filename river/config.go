package pgidemriver

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"github.com/riverqueue/river/rivertype"

	"github.com/pgidem/pgidem/pgidem"
)

// Defaults for [Config]. A zero Config field takes the Default.
const (
	// TTLDefault is the default [Config.TTL]: how long a job's effect record counts after
	// the job's effect completed. Compare it with the redelivery horizon [Middleware.CheckTTL]
	// computes.
	TTLDefault = 24 * time.Hour

	// SQLTimeoutDefault is the default [Config.SQLTimeout].
	SQLTimeoutDefault = 10 * time.Second

	// WaitTimeoutDefault is the default [Config.WaitTimeout], used under
	// [pgidem.InFlightWait].
	WaitTimeoutDefault = 30 * time.Second

	// SnoozeMinDefault is the default [Config.SnoozeMin].
	SnoozeMinDefault = 100 * time.Millisecond

	// SnoozeMaxDefault is the default [Config.SnoozeMax].
	SnoozeMaxDefault = 5 * time.Second

	// JobIDKeyPrefix starts the key of a job that names no effect ([KeySourceJobID]):
	// the key is JobIDKeyPrefix followed by the job id in decimal, e.g. "job-42".
	JobIDKeyPrefix = "job-"
)

// Config configures a [Middleware]. The zero value is valid: every zero field takes its
// documented default. [NewMiddleware] copies it.
type Config struct {
	// TTL is how long a job's effect record counts after the effect completed; within it a
	// redelivery or a second job with the same key replays instead of running. It must
	// outlive River's redelivery horizon for the job ([Middleware.CheckTTL] warns when it
	// does not). Per kind overrides: [TTLArgs]. Default [TTLDefault] (24 h). It must be at
	// least the coordinator's [pgidem.Config.MinTTL], or [NewMiddleware] returns an error.
	TTL time.Duration

	// InFlight is what an execution does when another execution holds the key with a live
	// lease. That happens when the stuck-job rescuer re-runs a slow job, or with two jobs
	// for one effect.
	//   - [pgidem.InFlightRaise] (the default, also for [pgidem.InFlightDefault]): return
	//     river.JobSnooze with the holder's remaining lease as delay, clamped to
	//     [SnoozeMin, SnoozeMax] so a duplicate of a fast job comes back soon.
	//     A snooze uses no attempt (River's rule), so the job comes back and replays once
	//     the holder completed — or takes over if the holder died.
	//   - [pgidem.InFlightWait]: block until the holder finishes and replay its outcome,
	//     at most WaitTimeout; then snooze as above. A waiting job occupies a worker slot.
	InFlight pgidem.InFlightPolicy

	// WaitTimeout bounds the wait under [pgidem.InFlightWait]. Default
	// [WaitTimeoutDefault] (30 s), the middleware's own (not the coordinator's
	// [pgidem.Config.WaitTimeout]); a negative one makes [NewMiddleware] return an error
	// matching [pgidem.ErrInvalidArgument].
	WaitTimeout time.Duration

	// SnoozeMin is the shortest snooze delay; a holder whose lease is about to expire is
	// given at least this long. Default [SnoozeMinDefault] (100 ms); a negative one, or one
	// above SnoozeMax, makes [NewMiddleware] return an error matching
	// [pgidem.ErrInvalidArgument].
	SnoozeMin time.Duration

	// SnoozeMax is the longest snooze delay. A job snoozed behind a live holder comes back
	// at least this often to replay the holder's outcome once it completed. A live holder
	// renews its lease, so its remaining lease says nothing about when it will finish.
	// Default [SnoozeMaxDefault] (5 s), or SnoozeMin when that is longer; set, it must not
	// be below SnoozeMin.
	SnoozeMax time.Duration

	// SQLTimeout bounds the reservation step of each execution: the middleware's
	// statements before the worker runs (reserving the key, reading a completed record for
	// a replay, taking over an expired lease). Under [pgidem.InFlightWait] it bounds the
	// wait as well, and that step gets SQLTimeout + WaitTimeout. River runs worker
	// middleware before it applies JobTimeout, so without it the middleware's context has
	// no deadline.
	//
	// It never bounds the worker: the timer stops as soon as the worker starts. The
	// worker's context is then cancelled only by the job's own context (JobTimeout, client
	// shutdown), or with cause [pgidem.ErrLeaseLost] for as long as the worker runs. That
	// cause comes when renewals stall until a tenth of a lease before it ends, or a renewal
	// finds the record taken over; the cause alone does not prove a takeover. Nor does it
	// bound the finishing write, which the coordinator bounds with
	// [pgidem.Config.FinishTimeout].
	//
	// A reservation step that runs out of time fails the job (River retries it). The error
	// names Config.SQLTimeout and matches context.DeadlineExceeded; the worker does not run
	// and no reservation is left behind. For that, a reserving write already sent when the
	// time runs out is not abandoned: pgidem waits for its outcome, at most
	// [pgidem.Config.FinishTimeout], and releases what it reserved. With a store that
	// hangs (a table lock, a server that stopped answering) the step can therefore last
	// up to that long beyond SQLTimeout. Default [SQLTimeoutDefault] (10 s);
	// negative values are rejected by [NewMiddleware].
	SQLTimeout time.Duration

	// KeyFunc derives the key from the raw job row for jobs whose args do not implement
	// [KeyArgs] (or whose type is not registered). It returns ok false when it has no key
	// for the job; namespace "" means the default namespace (the canonical kind of the
	// registered args type, else the job kind; see [NamespaceArgs]). Called concurrently;
	// must not modify the job. Default nil: args, then the job id.
	KeyFunc func(job *rivertype.JobRow) (namespace, key string, ok bool)

	// ExcludeKinds lists job kinds the middleware passes straight to the worker without a
	// reservation — for example workers that make their effect exactly-once themselves
	// with [WorkTx]. A canonical kind listed here also excludes its kind aliases once the
	// args type is registered. [SweepKind] is always excluded.
	ExcludeKinds []string

	// Logger receives the middleware's warnings (job-id fallback once per kind, TTL checks,
	// lease loss) and errors (a panic in the Hook). Default: the coordinator's
	// [pgidem.Config.Logger].
	Logger *slog.Logger

	// Hook receives an [Outcome] for every execution. One that also implements
	// [StartHook] sees each execution start too, and its context becomes the execution's.
	// Default: none.
	Hook Hook
}

// NewMiddleware returns a middleware storing its records through coord. config may be nil
// for all defaults; it is copied. It returns an error matching [pgidem.ErrInvalidArgument]
// and naming the Config field when a setting is invalid (or coord is nil). It does not
// touch the database.
func NewMiddleware(coord *pgidem.Coordinator, config *Config) (*Middleware, error) {
	if coord == nil {
		return nil, invalid("NewMiddleware: coord is nil")
	}
	var cfg Config
	if config != nil {
		cfg = *config
	}
	cfg.TTL = cmp.Or(cfg.TTL, TTLDefault)
	cfg.InFlight = cmp.Or(cfg.InFlight, pgidem.InFlightRaise)
	cfg.WaitTimeout = cmp.Or(cfg.WaitTimeout, WaitTimeoutDefault)
	cfg.SnoozeMin = cmp.Or(cfg.SnoozeMin, SnoozeMinDefault)
	cfg.SnoozeMax = cmp.Or(cfg.SnoozeMax, max(SnoozeMaxDefault, cfg.SnoozeMin))
	cfg.SQLTimeout = cmp.Or(cfg.SQLTimeout, SQLTimeoutDefault)
	if cfg.Logger == nil {
		cfg.Logger = coord.Config().Logger
	}
	switch {
	case cfg.TTL < coord.Config().MinTTL:
		return nil, invalid("Config.TTL %s is below the coordinator's MinTTL %s", cfg.TTL, coord.Config().MinTTL)
	case cfg.InFlight != pgidem.InFlightRaise && cfg.InFlight != pgidem.InFlightWait:
		return nil, invalid("Config.InFlight %d is not a known policy", cfg.InFlight)
	case cfg.WaitTimeout < 0:
		return nil, invalid("Config.WaitTimeout %s must not be negative", cfg.WaitTimeout)
	case cfg.SnoozeMin < 0 || cfg.SnoozeMax < cfg.SnoozeMin:
		return nil, invalid("Config.SnoozeMin %s and Config.SnoozeMax %s must satisfy 0 <= min <= max", cfg.SnoozeMin, cfg.SnoozeMax)
	case cfg.SQLTimeout < 0:
		return nil, invalid("Config.SQLTimeout %s must not be negative", cfg.SQLTimeout)
	}
	exclude := map[string]bool{SweepKind: true}
	for _, kind := range cfg.ExcludeKinds {
		exclude[kind] = true
	}
	cfg.ExcludeKinds = append([]string(nil), cfg.ExcludeKinds...)
	startHook, _ := cfg.Hook.(StartHook)
	return &Middleware{coord: coord, config: cfg, startHook: startHook, exclude: exclude, kinds: map[string]*kindInfo{}}, nil
}

// Config returns a copy of the middleware's configuration with defaults filled in.
func (m *Middleware) Config() Config {
	cfg := m.config
	cfg.ExcludeKinds = append([]string(nil), cfg.ExcludeKinds...)
	return cfg
}

// invalid returns a configuration error matching pgidem.ErrInvalidArgument.
func invalid(format string, args ...any) error {
	return fmt.Errorf("pgidemriver: %s: %w", fmt.Sprintf(format, args...), pgidem.ErrInvalidArgument)
}
