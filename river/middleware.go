package pgidemriver

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/riverqueue/river"
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

// KeyArgs is implemented by job args that name the effect their job performs, for example
// "order-9.invoice". Two jobs whose args return the same key (in the same namespace) run
// the effect once. The key is computed from the job's args as decoded from
// [rivertype.JobRow.EncodedArgs] (the middleware runs before River decodes them), so the
// args type must be known to the middleware: register its worker with [AddWorker], or call
// [Middleware.Register]. An empty or otherwise invalid key fails the job with an error
// matching [pgidem.ErrInvalidKey]; the worker is not run.
type KeyArgs interface {
	IdempotencyKey() string
}

// NamespaceArgs may be implemented by job args besides [KeyArgs] to choose the record's
// namespace. Default (or an empty result): the canonical kind of the registered args type
// (its Kind method), also for a job inserted under one of its kind aliases
// (river.JobArgsWithKindAliases), so a kind rename does not split the keys of one effect
// across two namespaces. Jobs of different kinds that perform the same effect return the
// same namespace so their keys collide on purpose. The namespace is limited like any
// pgidem namespace ([pgidem.Config.MaxNamespaceBytes]); an invalid one fails the job with
// an error matching [pgidem.ErrInvalidKey] without running the worker. That includes the
// default: River allows kinds of up to 127 characters (more bytes when not ASCII), pgidem
// namespaces 64 bytes by default, so a longer kind needs this method with [KeyArgs] (it
// is not consulted without it), a [Config.KeyFunc] that names a namespace, or
// [Config.ExcludeKinds]; [Middleware.Register] logs an error for a registered kind that
// would fail.
type NamespaceArgs interface {
	IdempotencyNamespace() string
}

// TTLArgs may be implemented by job args (with a value or a pointer receiver) to override
// [Config.TTL] for their kind. It is called once, when the type is registered, on the
// value given to [Middleware.Register] ([AddWorker] gives the zero value), so it must not
// depend on field values. A result of 0 or less means [Config.TTL].
type TTLArgs interface {
	IdempotencyTTL() time.Duration
}

// KeySource says where the middleware found a job's idempotency key.
type KeySource string

const (
	// KeySourceArgs: the job args implement [KeyArgs].
	KeySourceArgs KeySource = "args"
	// KeySourceFunc: [Config.KeyFunc] returned a key.
	KeySourceFunc KeySource = "key_func"
	// KeySourceJobID: no key was found and the job id was used. It dedupes redeliveries of
	// the same job (a crash before River recorded completion, the stuck-job rescuer running
	// it again), not two jobs enqueued for the same effect. Logged once per kind at warn
	// and counted in [Stats.JobIDKeys]. A job id is unique only within one River job
	// table while its sequence runs on: clients of different River schemas sharing one
	// pgidem table, or a job table recreated within the TTL, reuse ids, and a new job
	// would replay an old one's record. Give them different namespaces ([Config.KeyFunc])
	// or pgidem schemas.
	KeySourceJobID KeySource = "job_id"
)

// Action is what the middleware did with one execution of a job.
type Action string

const (
	// ActionExecuted: the worker ran under a fresh (or taken-over) reservation and
	// succeeded; the record is completed and the job completes. This includes a worker
	// whose [RecordOutput] could not be stored in the record ([Outcome.OutputNotStored])
	// and one whose record could not be completed at all ([Outcome.RecordNotCompleted]):
	// its effect ran, so the job completes rather than retrying or being cancelled.
	ActionExecuted Action = "executed"
	// ActionReplayed: the key's effect had already completed; the worker did not run and
	// the job completes (its recorded output is the original run's, see [RecordOutput];
	// none when it could not be stored, [Outcome.OutputNotStored]).
	ActionReplayed Action = "replayed"
	// ActionSnoozed: another execution holds the key (in progress, lease alive); the job
	// was answered with river.JobSnooze, which does not use an attempt.
	ActionSnoozed Action = "snoozed"
	// ActionReleased: the worker returned an error or panicked; the reservation was
	// released and the error returned unchanged (a panic continues, for River to recover).
	// River's retry runs the worker again, unless the error is the worker's own
	// river.JobSnooze (River runs the job later) or river.JobCancel (River stops). An
	// error that matches [pgidem.ErrPermanent] only through a failure a nested pgidem call
	// replayed is such an error: it carries no [pgidem.Permanent] error, so nothing was
	// stored. (When the lease was lost meanwhile, only a panic or the worker's own
	// river.JobSnooze or river.JobCancel comes here, with nothing left to release: the
	// record is the new holder's. Any other worker error is then [ActionError].)
	ActionReleased Action = "released"
	// ActionCancelled: the effect failed permanently (the worker returned a
	// [pgidem.Permanent] error, now or on an earlier job with the key, possibly wrapped in
	// its own river.JobCancel); the failure was stored and the job cancelled with
	// river.JobCancel so River does not retry it. When the store kept failing, the job is
	// cancelled all the same but the failure is not stored ([Outcome.RecordNotCompleted]):
	// a later job with the key takes the record over once its lease ends and runs the
	// worker again.
	ActionCancelled Action = "cancelled"
	// ActionError: the middleware could not decide (invalid key, undecodable args, store
	// unreachable), or the write after the worker found the record taken over: the worker
	// succeeded, failed permanently, or returned an error (other than its own
	// river.JobSnooze or river.JobCancel, which pass through unchanged as [ActionReleased]),
	// and its outcome was not stored: the record is the new holder's. The error, matching
	// [pgidem.ErrLeaseLost] in that case (and wrapping the worker's), was returned to River,
	// which retries the job and replays or waits for the new holder's outcome.
	ActionError Action = "error"
	// ActionSkipped: the kind is excluded ([Config.ExcludeKinds], [SweepKind]); the
	// worker ran without a reservation.
	ActionSkipped Action = "skipped"
)

// Outcome describes one execution of a job through the middleware, for a [Hook].
type Outcome struct {
	// Job is the job row as River handed it to the middleware. Do not modify it.
	Job *rivertype.JobRow
	// Namespace and Key are the record's; empty when the key could not be determined.
	Namespace, Key string
	// KeySource says where Key came from.
	KeySource KeySource
	// Action is what happened.
	Action Action
	// Waited is true when the execution waited for another holder ([pgidem.InFlightWait]).
	Waited bool
	// TookOver is true when the execution took over a reservation whose holder stopped
	// renewing its lease (a crashed worker): the effect may have run twice.
	TookOver bool
	// Attempts is the record's attempt count (see [pgidem.Result.Attempts]).
	Attempts int
	// FailedOpen is true when the worker ran without a reservation: the store was
	// unreachable and the coordinator fails open ([pgidem.Config.FailOpen]). No record
	// exists; Action is [ActionExecuted] (the worker succeeded), [ActionReleased] (it
	// failed) or [ActionCancelled] (it failed with a [pgidem.Permanent] error) as for a
	// reserved run, but nothing was completed, released or stored: a later job with the
	// key runs the worker again.
	FailedOpen bool
	// Output is the JSON output the effect recorded with [RecordOutput] (the original run's
	// on a replay), nil when none. With OutputNotStored it is this run's output, which the
	// record lacks; nil on a replay of such a record.
	Output json.RawMessage
	// OutputNotStored is true when the effect succeeded but the output it recorded with
	// [RecordOutput] could not be stored in the pgidem record (pgidem's
	// [pgidem.ErrResultNotStorable]: a string with a NUL character, or too large). The
	// record is completed without it, so the effect is not repeated, and the job completes
	// ([ActionExecuted]); replays of the key complete without output ([ActionReplayed]).
	OutputNotStored bool
	// RecordNotCompleted is true when the worker finished but pgidem could not complete
	// its record because the store kept failing through pgidem's finishing retries
	// ([pgidem.ErrStoreUnavailable]). A worker that succeeded completes its job all the
	// same ([ActionExecuted], logged at error): its effect ran, and a retry of the job
	// would take the reservation over once its lease ends and run the effect again. A
	// worker that failed permanently has its job cancelled ([ActionCancelled]) without the
	// failure stored. The record stays in progress
	// until then; another job with the key that comes later takes it over
	// ([Outcome.TookOver]) and runs the effect again. (A lease lost to a takeover is
	// different: the job fails with [pgidem.ErrLeaseLost], and its retry replays or waits
	// for the new holder's outcome.)
	RecordNotCompleted bool
	// Snooze is the delay given to river.JobSnooze for [ActionSnoozed].
	Snooze time.Duration
	// Err is the error returned to River, nil on success. For a panic (which continues to
	// River) it is an error describing the panic.
	Err error
}

// Hook receives an [Outcome] for every job execution the middleware handles, for metrics
// and tracing. OnOutcome is called synchronously on the job's goroutine, from many
// goroutines at once: it must be fast and safe for concurrent use. A panic in OnOutcome
// is recovered and logged at error ([Config.Logger]); the job's outcome stands.
type Hook interface {
	OnOutcome(ctx context.Context, outcome *Outcome)
}

// HookFunc adapts a function to [Hook].
type HookFunc func(ctx context.Context, outcome *Outcome)

// OnOutcome calls f(ctx, outcome).
func (f HookFunc) OnOutcome(ctx context.Context, outcome *Outcome) { f(ctx, outcome) }

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
	// lease — the stuck-job rescuer re-running a slow job, or two jobs for one effect:
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

	// SnoozeMax is the longest snooze delay: a job snoozed behind a live holder comes back
	// at least this often to replay the holder's outcome once it completed (a live holder
	// renews its lease, so its remaining lease says nothing about when it will finish).
	// Default [SnoozeMaxDefault] (5 s), or SnoozeMin when that is longer; set, it must not
	// be below SnoozeMin.
	SnoozeMax time.Duration

	// SQLTimeout bounds the reservation step of each execution: the middleware's
	// statements before the worker runs (reserving the key, reading a completed record for
	// a replay, taking over an expired lease) and, under [pgidem.InFlightWait], the wait as
	// well — that step gets SQLTimeout + WaitTimeout. River runs worker middleware before
	// it applies JobTimeout, so without it the middleware's context has no deadline.
	//
	// It never bounds the worker: the timer stops as soon as the worker starts, and the
	// worker's context is then cancelled only by the job's own context (JobTimeout, client
	// shutdown) or with cause [pgidem.ErrLeaseLost] when renewals stall until a tenth of a
	// lease before it ends, or a renewal finds the record taken over (the cause alone does
	// not prove a takeover) — for as long as the worker runs. Nor does it bound the finishing
	// write, which the coordinator bounds with [pgidem.Config.FinishTimeout].
	//
	// A reservation step that runs out of time fails the job (River retries it) with an
	// error that names Config.SQLTimeout and matches context.DeadlineExceeded; the worker
	// does not run and no reservation is left behind. For that, a reserving write already
	// sent when the time runs out is not abandoned: pgidem waits for its outcome, at most
	// [pgidem.Config.FinishTimeout] (and releases what it reserved). With a store that
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

	// Hook receives an [Outcome] for every execution. Default: none.
	Hook Hook
}

// Stats are cumulative counts of the middleware's outcomes since it was created.
type Stats struct {
	// Executed, Replayed, Snoozed, Released, Cancelled, Errors and Skipped count
	// executions by [Action].
	Executed, Replayed, Snoozed, Released, Cancelled, Errors, Skipped int64
	// Waited counts executions that waited for another holder.
	Waited int64
	// JobIDKeys counts executions keyed by the job id ([KeySourceJobID]).
	JobIDKeys int64
	// FailedOpen counts executions whose worker ran without a reservation because the
	// store was unreachable and the coordinator fails open ([Outcome.FailedOpen]).
	FailedOpen int64
	// RecordNotCompleted counts executions whose record the store failed to complete
	// ([Outcome.RecordNotCompleted]): a worker that succeeded (these count in Executed
	// too) or one whose Permanent failure could not be stored (these count in Cancelled).
	RecordNotCompleted int64
}

// Middleware is a River worker middleware ([rivertype.WorkerMiddleware]) that runs each job
// under a pgidem reservation, so a job's effect happens once however often River delivers
// it. Create it with [NewMiddleware] and register the pointer in river.Config.Middleware
// (every worker) or return it from a worker's Middleware method (that worker only).
// Register it once per job; registering it in both places (or two Middleware values) is
// safe: the outer registration decides (reserves the key, or skips an excluded kind), an
// execution it already handles passes straight through the inner one to the worker, and
// only the outer registration reports an [Outcome] and counts in [Stats]. River runs a
// worker's own middleware outside the client's, so with two Middleware values the
// worker's decides.
//
// Per execution, in order:
//  1. Key: the args' [KeyArgs] key (decoded from the job's encoded args), else
//     [Config.KeyFunc], else the job id ([KeySourceJobID]). Namespace: [NamespaceArgs],
//     else the canonical kind of the registered args type (the job kind when the type is
//     not registered).
//  2. Reserve the key ([pgidem.DoResult]) within [Config.SQLTimeout], with
//     [pgidem.DoOpts.ReserveFirst]: most jobs name a new key, so the reserving insert is
//     the first statement (it returns a completed record itself when there is one).
//  3. Completed before: return nil without running the worker (replay).
//     In progress elsewhere: snooze or wait ([Config.InFlight]).
//     Otherwise: run the worker (doInner) while a heartbeat renews the lease for as long
//     as it runs — also past JobTimeout and for jobs without a timeout — so the rescuer's
//     duplicate finds it in progress rather than taking over.
//  4. Worker returns nil: the record completes (when it cannot, the job completes all the
//     same: [Outcome.RecordNotCompleted]). Worker returns an error: the record is
//     released and the error returned unchanged (snooze and cancel errors included), so
//     River retries; when the release finds the record taken over, the error is wrapped
//     in one matching [pgidem.ErrLeaseLost] ([ActionError]), and when pgidem cancelled the
//     worker because its renewals failed (the record not taken over) in one that says so,
//     except the worker's own river.JobSnooze or river.JobCancel, which pass through
//     unchanged. A
//     [pgidem.Permanent] error is stored and the job cancelled. Renewals that stall until a
//     tenth of a lease before it ends, or a renewal that finds the record taken over,
//     cancel the worker's context with cause [pgidem.ErrLeaseLost], however long the
//     worker has run (the cause alone does not prove a takeover).
//
// It is safe for concurrent use and may serve several clients.
type Middleware struct {
	river.MiddlewareDefaults

	coord   *pgidem.Coordinator
	config  Config
	exclude map[string]bool

	mu    sync.RWMutex
	kinds map[string]*kindInfo // registered args types by kind (and kind alias)

	fallbackLogged sync.Map // kind -> struct{}: job-id fallback already logged
	counts         struct {
		executed, replayed, snoozed, released, cancelled, errors, skipped, waited, jobIDKeys, failedOpen, recordNotCompleted atomic.Int64
	}
}

var _ rivertype.WorkerMiddleware = (*Middleware)(nil)

// kindInfo is what registration learned about a job kind's args type.
type kindInfo struct {
	args   river.JobArgs // zero value, for InsertOpts in CheckTTL
	kind   string        // the canonical kind, args.Kind(): the default namespace
	typ    reflect.Type  // the args type T (decoded into a new *T)
	keyed  bool          // T or *T implements KeyArgs
	ttl    time.Duration // from TTLArgs, 0 when none
	source string        // the Go type name, for messages
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
	return &Middleware{coord: coord, config: cfg, exclude: exclude, kinds: map[string]*kindInfo{}}, nil
}

// Config returns a copy of the middleware's configuration with defaults filled in.
func (m *Middleware) Config() Config {
	cfg := m.config
	cfg.ExcludeKinds = append([]string(nil), cfg.ExcludeKinds...)
	return cfg
}

// Stats returns the middleware's cumulative counts. Safe for concurrent use.
func (m *Middleware) Stats() Stats {
	c := &m.counts
	return Stats{
		Executed: c.executed.Load(), Replayed: c.replayed.Load(), Snoozed: c.snoozed.Load(),
		Released: c.released.Load(), Cancelled: c.cancelled.Load(), Errors: c.errors.Load(),
		Skipped: c.skipped.Load(), Waited: c.waited.Load(), JobIDKeys: c.jobIDKeys.Load(),
		FailedOpen:         c.failedOpen.Load(),
		RecordNotCompleted: c.recordNotCompleted.Load(),
	}
}

// AddWorker registers worker on workers like river.AddWorker (and panics in the same
// cases), and registers its args type with m ([Middleware.Register]) so that m can find
// the [KeyArgs] key of its jobs and check its TTL.
func AddWorker[T river.JobArgs](workers *river.Workers, m *Middleware, worker river.Worker[T]) {
	river.AddWorker(workers, worker)
	var zero T
	m.Register(zero)
}

// Register tells m the args types of workers registered with River directly, by example
// values (the zero value is fine): m then decodes jobs of their kinds (and kind aliases)
// to find the [KeyArgs] key and includes them in [Middleware.CheckTTL]. Jobs of a kind
// alias take the canonical kind as their default namespace ([NamespaceArgs]) and are
// excluded when the canonical kind is in [Config.ExcludeKinds]. Registering a kind again
// replaces the earlier type. A [TTLArgs] TTL the coordinator refuses (below
// [pgidem.Config.MinTTL], or not longer than its lease) is logged at error: every job of
// the kind would fail with [pgidem.ErrInvalidTTL] before its worker runs. So is a kind
// longer than [pgidem.Config.MaxNamespaceBytes] that would be its jobs' namespace (keyed
// args without [NamespaceArgs]; args without a key and no [Config.KeyFunc]): the jobs would
// fail with [pgidem.ErrInvalidKey]. Call it before
// the client starts; safe for concurrent use. It panics on a nil args value, as
// river.AddWorker does on a nil worker.
func (m *Middleware) Register(args ...river.JobArgs) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, a := range args {
		if a == nil {
			panic("pgidemriver: Register: nil job args")
		}
		typ := reflect.TypeOf(a)
		info := &kindInfo{args: a, kind: a.Kind(), typ: typ, source: typ.String()}
		_, info.keyed = implementation[KeyArgs](a)
		if t, ok := implementation[TTLArgs](a); ok {
			info.ttl = max(t.IdempotencyTTL(), 0)
			if cc := m.coord.Config(); info.ttl > 0 && (info.ttl < cc.MinTTL || info.ttl <= cc.Lease) {
				m.config.Logger.Error("pgidemriver: IdempotencyTTL is refused by the coordinator; every job of the kind will fail before its worker runs",
					slog.String("job_kind", info.kind), slog.Duration("ttl", info.ttl),
					slog.Duration("min_ttl", cc.MinTTL), slog.Duration("lease", cc.Lease))
			}
		}
		// The kind is the namespace unless keyed args name one (NamespaceArgs is consulted
		// only with KeyArgs), or, for args without a key method, Config.KeyFunc may.
		_, named := implementation[NamespaceArgs](a)
		kindIsNamespace := (info.keyed && !named) || (!info.keyed && m.config.KeyFunc == nil)
		if kindIsNamespace && !m.exclude[info.kind] {
			if limit := m.coord.Config().MaxNamespaceBytes; len(info.kind) > limit {
				m.config.Logger.Error("pgidemriver: job kind is longer than a pgidem namespace may be; every job of the kind will fail before its worker runs "+
					"(implement KeyArgs and NamespaceArgs, set Config.KeyFunc, or exclude the kind)",
					slog.String("job_kind", info.kind), slog.Int("kind_bytes", len(info.kind)), slog.Int("max_namespace_bytes", limit))
			}
		}
		kinds := []string{a.Kind()}
		if aliased, ok := a.(river.JobArgsWithKindAliases); ok { // by value, as River's AddWorker
			kinds = append(kinds, aliased.KindAliases()...)
		}
		for kind, old := range m.kinds { // the earlier type's aliases go with it
			if old.kind == info.kind {
				delete(m.kinds, kind)
			}
		}
		for _, kind := range kinds {
			m.kinds[kind] = info
		}
	}
}

// implementation returns args as an I, one of this package's interfaces (KeyArgs,
// TTLArgs): the value itself or, for methods with pointer receivers, a pointer to a copy of
// it (the middleware decodes args into a pointer, so both kinds of receiver work).
func implementation[I any](args river.JobArgs) (I, bool) {
	if v, ok := args.(I); ok {
		return v, true
	}
	ptr := reflect.New(reflect.TypeOf(args))
	ptr.Elem().Set(reflect.ValueOf(args))
	v, ok := ptr.Interface().(I)
	return v, ok
}

func (m *Middleware) kind(kind string) *kindInfo {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.kinds[kind]
}

// Work implements [rivertype.WorkerMiddleware]; River calls it for every execution of a job.
// See [Middleware] for what it does. The error it returns is the worker's, unchanged, when
// the worker ran and failed (wrapped in one matching [pgidem.ErrLeaseLost] when the record
// was then found taken over, or in one saying pgidem cancelled the worker when its lease
// renewals failed, except its own river.JobSnooze or river.JobCancel);
// river.JobSnooze when another execution holds the key; a
// river.JobCancel wrapping a stored permanent failure; otherwise an error prefixed
// "pgidemriver: " wrapping pgidem's ([pgidem.ErrInvalidKey], [pgidem.ErrStoreUnavailable],
// [pgidem.ErrLeaseLost], a context error — context.DeadlineExceeded when the reservation
// step exceeded [Config.SQLTimeout]).
//
// Cancelling ctx (River's job context) before the worker runs returns a context error and
// leaves no reservation; while the worker runs it cancels the worker's context.
//
// When ctx shows that an outer pgidemriver Work already handles job (holds its
// reservation, or skipped its excluded kind) — the middleware is registered twice,
// globally and on the worker — Work calls doInner(ctx) directly and reports nothing: the
// outer Work reports the outcome. Safe for concurrent use.
func (m *Middleware) Work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error) error {
	if id, ok := ctx.Value(handledJobKey{}).(int64); ok && id == job.ID {
		return doInner(ctx)
	}
	out := &Outcome{Job: job}
	defer func() {
		// A panic (River recovers it around the middleware chain) still gets its outcome:
		// released when the worker panicked (pgidem released the reservation), an error
		// when the key could not be found.
		if p := recover(); p != nil {
			if out.Action != ActionReleased {
				out.Action = ActionError
			}
			out.Err = fmt.Errorf("pgidemriver: job %d (%s) panicked: %v", job.ID, job.Kind, p)
			m.report(ctx, out)
			panic(p)
		}
	}()
	out.Err = m.work(ctx, job, doInner, out)
	m.report(ctx, out)
	return out.Err
}

// report counts out in Stats and hands it to the Hook. A panic in the Hook is logged and
// goes no further: a metrics bug must neither count the execution twice (Work's recover
// would take it for the job's panic) nor make River retry a job whose effect is recorded.
func (m *Middleware) report(ctx context.Context, out *Outcome) {
	m.record(out)
	if m.config.Hook == nil {
		return
	}
	defer func() {
		if p := recover(); p != nil {
			m.config.Logger.ErrorContext(ctx, "pgidemriver: Hook.OnOutcome panicked; the job's outcome stands",
				slog.Int64("job_id", out.Job.ID), slog.String("job_kind", out.Job.Kind), slog.String("action", string(out.Action)),
				slog.Any("panic", p), slog.String("stack", string(debug.Stack())))
		}
	}()
	m.config.Hook.OnOutcome(ctx, out)
}

func (m *Middleware) record(out *Outcome) {
	c := &m.counts
	switch out.Action {
	case ActionExecuted:
		c.executed.Add(1)
	case ActionReplayed:
		c.replayed.Add(1)
	case ActionSnoozed:
		c.snoozed.Add(1)
	case ActionReleased:
		c.released.Add(1)
	case ActionCancelled:
		c.cancelled.Add(1)
	case ActionSkipped:
		c.skipped.Add(1)
	default:
		c.errors.Add(1)
	}
	if out.Waited {
		c.waited.Add(1)
	}
	if out.KeySource == KeySourceJobID {
		c.jobIDKeys.Add(1)
	}
	if out.FailedOpen {
		c.failedOpen.Add(1)
	}
	if out.RecordNotCompleted {
		c.recordNotCompleted.Add(1)
	}
}

// effectRecord is the JSON stored as the record's result: which job performed the effect
// and what it recorded as output.
type effectRecord struct {
	JobID   int64           `json:"job_id"`
	Attempt int             `json:"attempt"`
	Output  json.RawMessage `json:"output,omitempty"`
}

// handledJobKey marks a context whose worker an outer pgidemriver Work handles (runs under
// its reservation, or skipped as excluded); the value is the job id (int64).
type handledJobKey struct{}

// errReserveTimeout is the cause with which the reservation step is cancelled when it
// exceeds its budget (Config.SQLTimeout, plus WaitTimeout under Wait).
var errReserveTimeout = errors.New("pgidemriver: reservation step timed out")

// invalid returns a configuration error matching pgidem.ErrInvalidArgument.
func invalid(format string, args ...any) error {
	return fmt.Errorf("pgidemriver: %s: %w", fmt.Sprintf(format, args...), pgidem.ErrInvalidArgument)
}

func (m *Middleware) work(ctx context.Context, job *rivertype.JobRow, doInner func(context.Context) error, out *Outcome) error {
	info := m.kind(job.Kind)
	if m.exclude[job.Kind] || (info != nil && m.exclude[info.kind]) {
		out.Action = ActionSkipped
		return doInner(context.WithValue(ctx, handledJobKey{}, job.ID))
	}
	ttl, err := m.resolve(ctx, job, info, out)
	if err != nil {
		out.Action = ActionError
		return err
	}

	// The reservation (and, under Wait, the wait) is bounded; the worker is not. pgidem
	// derives fn's context from the one given to DoResult, so that context must not carry
	// a deadline: the budget is a timer that cancels it, stopped as soon as the worker
	// starts. From then on fn's context is cancelled only by the job's context or by
	// pgidem with cause ErrLeaseLost.
	budget := m.config.SQLTimeout
	if m.config.InFlight == pgidem.InFlightWait {
		// Saturating: a huge WaitTimeout ("as long as it takes") must not wrap negative,
		// which would fire the timer at once and never start a worker.
		budget = saturatingSum(budget, m.config.WaitTimeout)
	}
	reserveCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	timer := time.AfterFunc(budget, func() { cancel(errReserveTimeout) })
	defer timer.Stop()

	ran, succeeded := false, false // the worker started; it returned nil
	opts := &pgidem.DoOpts{InFlight: m.config.InFlight, WaitTimeout: m.config.WaitTimeout, ReserveFirst: true}
	var workerErr error // the worker's own error, as it returned it
	stalled := false    // pgidem cancelled the worker: its lease renewals failed
	res, err := pgidem.DoResult(reserveCtx, m.coord, out.Namespace, out.Key, ttl, opts,
		func(fnCtx context.Context) (effectRecord, error) {
			if !timer.Stop() {
				// The budget ran out as the reservation was granted: do not start the
				// worker on a cancelled context; pgidem releases the reservation.
				return effectRecord{}, errReserveTimeout
			}
			ran = true
			out.Action = ActionReleased // what a panicking worker comes to; replaced below otherwise
			slot := &outputSlot{}
			workCtx := context.WithValue(fnCtx, outputSlotKey{}, slot)
			workCtx = context.WithValue(workCtx, handledJobKey{}, job.ID)
			if err := doInner(workCtx); err != nil {
				workerErr = err
				stalled = ctx.Err() == nil && errors.Is(context.Cause(fnCtx), pgidem.ErrLeaseLost)
				return effectRecord{}, err
			}
			succeeded = true
			return effectRecord{JobID: job.ID, Attempt: job.Attempt, Output: slot.get()}, nil
		})
	out.Waited, out.TookOver, out.Attempts, out.FailedOpen = res.Waited, res.TookOver, res.Attempts, res.FailedOpen

	var (
		inProgress *pgidem.InProgressError
		snoozeErr  *river.JobSnoozeError
		cancelErr  *river.JobCancelError
		stored     *pgidem.StoredFailureError
	)
	// pgidem's verdict that a permanent failure was not stored is the top-level error; one
	// the worker returned itself (from a call of its own) says nothing about this record.
	notStored, _ := err.(*pgidem.FailureNotStoredError)
	if own, ok := workerErr.(*pgidem.FailureNotStoredError); ok && own == notStored {
		notStored = nil
	}
	failureLeaseLost := notStored != nil && res.LeaseLost // pgidem's verdict on its own write
	// A failure is permanent by pgidem's rule: the worker's error carries a
	// [pgidem.PermanentError] (and pgidem stored it), or the record replayed a stored
	// failure. A worker error that merely matches ErrPermanent through a nested call's
	// replayed *StoredFailureError released the record like any other error, so River
	// retries the job.
	permanent := errors.As(workerErr, new(*pgidem.PermanentError)) || (!ran && errors.Is(err, pgidem.ErrPermanent))
	switch {
	case err == nil && res.Replayed:
		out.Action = ActionReplayed
		out.Output = res.Value.Output
		if len(out.Output) > 0 {
			// The replayed job carries the original run's output, as if it had run.
			if err := river.RecordOutput(ctx, out.Output); err != nil {
				m.config.Logger.WarnContext(ctx, "pgidemriver: could not record replayed output",
					slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind), slog.String("error", err.Error()))
			}
		}
		return nil
	case err == nil:
		out.Action = ActionExecuted
		out.Output = res.Value.Output
		return nil
	case succeeded && errors.Is(err, pgidem.ErrResultNotStorable) && !errors.Is(err, pgidem.ErrLeaseLost):
		// The worker succeeded and its effect ran; only its recorded output could not be
		// stored. pgidem completed the record without it (the effect is not repeated), and
		// River already holds the output in the job's metadata, so the job completes.
		out.Action = ActionExecuted
		out.OutputNotStored = true
		out.Output = res.Value.Output
		m.config.Logger.WarnContext(ctx, "pgidemriver: job output not storable in the idempotency record; "+
			"the job completes and replays of its key carry no output",
			slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind),
			slog.String("namespace", out.Namespace), slog.String("key", out.Key), slog.String("error", err.Error()))
		return nil
	case !ran && errors.As(err, &stored) && stored.NotStorable:
		// An earlier execution ran the effect and only its output was lost: a replay.
		out.Action = ActionReplayed
		out.OutputNotStored = true
		return nil
	case ran && (errors.As(err, &snoozeErr) || errors.As(err, &cancelErr)):
		switch {
		case failureLeaseLost:
			out.Action = ActionError // nothing stored: the record is another holder's
		case permanent:
			out.Action = ActionCancelled // river.JobCancel(pgidem.Permanent(e)): stored as failed
			out.RecordNotCompleted = notStored != nil
		default:
			out.Action = ActionReleased
		}
		return err // River's own control errors pass through unchanged
	case permanent && !failureLeaseLost:
		// Stored (or replayed), or the store failed to store it: the worker's verdict
		// stands either way, so River does not retry this job.
		out.Action = ActionCancelled
		out.RecordNotCompleted = notStored != nil
		if !ran {
			// Say in River's errors column that this job only replayed the failure.
			err = fmt.Errorf("pgidemriver: job %d (%s): replayed the failure an earlier execution stored for %s/%s: %w",
				job.ID, job.Kind, out.Namespace, out.Key, err)
		}
		return river.JobCancel(err)
	case succeeded && !errors.Is(err, pgidem.ErrLeaseLost):
		// The worker succeeded and its effect ran, but the store kept failing, so its
		// record could not be completed. A retry of this job would find the reservation in
		// progress until its lease ends, then take it over and run the effect again, so
		// the job completes. pgidem logged the store error.
		out.Action = ActionExecuted
		out.RecordNotCompleted = true
		out.Output = res.Value.Output
		m.config.Logger.ErrorContext(ctx, "pgidemriver: job succeeded but its idempotency record could not be completed; "+
			"the job completes, and a later job with the key takes the record over when its lease ends",
			slog.Int64("job_id", job.ID), slog.String("job_kind", job.Kind),
			slog.String("namespace", out.Namespace), slog.String("key", out.Key), slog.String("error", err.Error()))
		return nil
	case succeeded || failureLeaseLost:
		// The lease was lost while the worker ran (pgidem's answer: the worker succeeded
		// or failed permanently, and its outcome could not be written): nothing was
		// completed (the record is another holder's now), and River's retry replays or
		// waits for that holder's outcome. The error makes the anomaly visible on the job.
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): %w", job.ID, job.Kind, err)
	case ran && res.LeaseLost:
		// The worker failed (most likely with its context's error, which pgidem cancelled
		// as the lease ran out) and pgidem then found the record taken over: say so, or
		// River's errors column would show a bare "context canceled" for what may be an
		// effect run twice. Nothing was released: the record is the new holder's.
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): the worker stopped after its reservation's lease was lost (%w); it returned: %w",
			job.ID, job.Kind, pgidem.ErrLeaseLost, err)
	case ran && stalled:
		// pgidem cancelled the worker because its lease could not be renewed in time (a
		// slow or unreachable store, a starved pool), and then released the record, which
		// nobody had taken over: say so, or River's errors column would show a bare
		// "context canceled". Not a lost lease (it matches nothing of pgidem's).
		out.Action = ActionReleased
		return fmt.Errorf("pgidemriver: job %d (%s): pgidem cancelled the worker because its lease could not be renewed in time; the record was released, and River retries the job; the worker returned: %w",
			job.ID, job.Kind, err)
	case ran:
		out.Action = ActionReleased
		return err // the worker's error, unchanged
	case errors.As(err, &inProgress):
		out.Action = ActionSnoozed
		out.Snooze = min(max(inProgress.RetryAfter, m.config.SnoozeMin), m.config.SnoozeMax)
		return river.JobSnooze(out.Snooze)
	case ctx.Err() == nil && context.Cause(reserveCtx) == errReserveTimeout:
		out.Action = ActionError
		limit := fmt.Sprintf("Config.SQLTimeout %s", m.config.SQLTimeout)
		if m.config.InFlight == pgidem.InFlightWait {
			limit += fmt.Sprintf(" + Config.WaitTimeout %s", m.config.WaitTimeout)
		}
		return fmt.Errorf("pgidemriver: job %d (%s): reservation exceeded %s: %w", job.ID, job.Kind, limit, context.DeadlineExceeded)
	default:
		out.Action = ActionError
		return fmt.Errorf("pgidemriver: job %d (%s): %w", job.ID, job.Kind, err)
	}
}

// resolve fills out's namespace, key and key source and returns the record TTL.
func (m *Middleware) resolve(ctx context.Context, job *rivertype.JobRow, info *kindInfo, out *Outcome) (time.Duration, error) {
	// The default namespace is the canonical kind, so jobs inserted under a kind alias
	// share their effect keys with jobs of the current kind name.
	kind := job.Kind
	if info != nil {
		kind = info.kind
	}
	ttl := m.config.TTL
	if info != nil && info.ttl > 0 {
		ttl = info.ttl
	}
	if info != nil && info.keyed {
		ptr := reflect.New(info.typ)
		if err := json.Unmarshal(job.EncodedArgs, ptr.Interface()); err != nil {
			return 0, fmt.Errorf("pgidemriver: job %d (%s): decode args as %s to find the idempotency key: %w", job.ID, job.Kind, info.source, err)
		}
		var args any = ptr.Interface()
		if _, ok := args.(KeyArgs); !ok {
			args = ptr.Elem().Interface()
		}
		out.KeySource = KeySourceArgs
		out.Key = args.(KeyArgs).IdempotencyKey()
		out.Namespace = kind
		if ns, ok := args.(NamespaceArgs); ok {
			out.Namespace = cmp.Or(ns.IdempotencyNamespace(), kind)
		}
		return ttl, nil
	}
	if m.config.KeyFunc != nil {
		if ns, key, ok := m.config.KeyFunc(job); ok {
			out.KeySource, out.Namespace, out.Key = KeySourceFunc, cmp.Or(ns, kind), key
			return ttl, nil
		}
	}
	out.KeySource, out.Namespace, out.Key = KeySourceJobID, kind, JobIDKeyPrefix+strconv.FormatInt(job.ID, 10)
	if _, logged := m.fallbackLogged.LoadOrStore(job.Kind, struct{}{}); !logged {
		reason := "its args type is not registered (pgidemriver.AddWorker or Middleware.Register)"
		if info != nil {
			reason = "its args type " + info.source + " does not implement pgidemriver.KeyArgs"
		}
		m.config.Logger.WarnContext(ctx, "pgidemriver: no idempotency key for job kind, using the job id: "+
			"this dedupes redeliveries of one job, not two jobs for the same effect",
			slog.String("job_kind", job.Kind), slog.String("reason", reason))
	}
	return ttl, nil
}

type outputSlotKey struct{}

// outputSlot carries the output a worker records with RecordOutput up to the middleware.
type outputSlot struct {
	mu     sync.Mutex
	output json.RawMessage
}

func (s *outputSlot) set(b []byte) {
	s.mu.Lock()
	s.output = b
	s.mu.Unlock()
}

func (s *outputSlot) get() json.RawMessage {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.output
}

// RecordOutput records output as the job's output, like river.RecordOutput (it calls it),
// and also stores it in the job's pgidem record, so that a replayed job — the same job
// redelivered, or another job with the same key — records the same output without running.
// Use it for the effect's receipt (a message id, a charge id). output must be
// JSON-encodable; only the last call per execution counts. It must be called from within a
// worker's Work; outside the middleware it behaves exactly like river.RecordOutput. It
// returns an error (prefixed "pgidemriver: RecordOutput: ") when output cannot be encoded
// or River rejects it (outside a worker, or above River's size limit).
//
// Output that JSON can encode but the pgidem record cannot store — a string with a NUL
// character, or more than [pgidem.Config.MaxValueBytes] of JSON
// ([pgidem.ErrResultNotStorable]) — is not an error here: the effect has already run, so
// the middleware completes the record without the output (the effect is never repeated
// for its key), completes the job (River keeps the output it recorded in the job's
// metadata), logs a warning and reports [Outcome.OutputNotStored]. Later replays of the
// key complete without output. River's metadata is jsonb too, so it cannot hold a NUL
// character either: keep receipts to valid UTF-8 without NUL. A string with invalid
// UTF-8 is recorded by both as encoding/json writes it, with U+FFFD in place of each
// invalid byte, and replays that way.
func RecordOutput(ctx context.Context, output any) error {
	b, err := json.Marshal(output)
	if err != nil {
		return fmt.Errorf("pgidemriver: RecordOutput: %w", err)
	}
	if err := river.RecordOutput(ctx, json.RawMessage(b)); err != nil {
		return fmt.Errorf("pgidemriver: RecordOutput: %w", err)
	}
	if slot, ok := ctx.Value(outputSlotKey{}).(*outputSlot); ok {
		slot.set(b)
	}
	return nil
}
