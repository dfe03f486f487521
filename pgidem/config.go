package pgidem

import (
	"cmp"
	"context"
	"log/slog"
	"strings"
	"time"

	"github.com/pgidem/pgidem/internal/protocol"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Defaults and limits for [Config]. A zero Config field takes the Default.
const (
	// LeaseDefault is the default [Config.Lease].
	LeaseDefault = 30 * time.Second
	// LeaseMin is the shortest lease accepted.
	LeaseMin = protocol.LeaseMin

	// MinTTLDefault is the default [Config.MinTTL].
	MinTTLDefault = time.Minute

	// WaitTimeoutDefault is the default [Config.WaitTimeout].
	WaitTimeoutDefault = time.Minute

	// FinishTimeoutDefault is the default [Config.FinishTimeout].
	FinishTimeoutDefault = 10 * time.Second
	// FinishTimeoutMin is the shortest [Config.FinishTimeout] accepted.
	FinishTimeoutMin = 100 * time.Millisecond

	// MaxBatchDefault is the default [Config.MaxBatch].
	MaxBatchDefault = 64

	// MaxKeyBytesDefault is the default [Config.MaxKeyBytes].
	MaxKeyBytesDefault = 255
	// MaxNamespaceBytesDefault is the default [Config.MaxNamespaceBytes].
	MaxNamespaceBytesDefault = 64
	// MaxKeyBytesMax bounds [Config.MaxKeyBytes] + [Config.MaxNamespaceBytes] so a primary
	// key entry always fits in a Postgres btree page (about 2700 bytes).
	MaxKeyBytesMax = 2048

	// MaxValueBytesDefault is the default [Config.MaxValueBytes]: 16 MiB.
	MaxValueBytesDefault = 16 << 20
	// MaxValueBytesMax bounds [Config.MaxValueBytes]: 256 MiB, about jsonb's own limit on
	// a document's size. That limit applies to jsonb's binary form, which can be larger
	// than the JSON text this bounds, so near it Postgres may still refuse a value: that is
	// [ErrResultNotStorable], never a store error.
	MaxValueBytesMax = 256 << 20

	// SchemaMaxBytes is the longest [Config.Schema], in bytes: Postgres's identifier limit
	// (it truncates longer names).
	SchemaMaxBytes = 63

	// PollIntervalMinDefault and PollIntervalMaxDefault bound the backoff between reads
	// while waiting for an in-progress record ([InFlightWait]).
	PollIntervalMinDefault = 10 * time.Millisecond
	PollIntervalMaxDefault = time.Second
	// PollIntervalMaxMax bounds [Config.PollIntervalMax]: a waiter should notice a
	// completed record within a minute.
	PollIntervalMaxMax = time.Minute
)

// InFlightPolicy says what a call does when the key's record is in progress under another
// holder with a live lease. Its String method returns "wait", "raise" or "default".
type InFlightPolicy = protocol.InFlightPolicy

const (
	// InFlightDefault (the zero value) means: use the coordinator's policy
	// ([Config.InFlight]), which itself defaults to [InFlightWait].
	InFlightDefault = protocol.InFlightDefault
	// InFlightWait polls the record (backoff with jitter) until it completes (replay), is
	// released (reserve again) or its lease expires (takeover), bounded by the context and
	// the wait timeout, after which the call returns an [*InProgressError].
	InFlightWait = protocol.InFlightWait
	// InFlightRaise returns an [*InProgressError] at once, with a retry-after hint taken
	// from the holder's lease.
	InFlightRaise = protocol.InFlightRaise
)

// CallOrder chooses the statement a [Do] call starts with: the indexed read of its key,
// or the reserving INSERT … ON CONFLICT DO NOTHING, which returns an existing record in
// the same round trip. Either way the protocol and its guarantees are the same; only the
// cost differs. Its String method returns "adaptive", "read-first" or "reserve-first".
type CallOrder = protocol.Order

const (
	// OrderAdaptive (the zero value, the default) starts a call with the reserving insert
	// unless most recent calls of its namespace (about 70 % of the last 32 or so) found a
	// record. A fresh key then costs the insert and the completing update (no read). A
	// namespace of mostly replays costs one plain indexed read per replay. The estimate is
	// the coordinator's own, per namespace (namespaces may share one by hash).
	OrderAdaptive = protocol.OrderAdaptive
	// OrderReadFirst starts every call with the indexed read: a replay is one plain read,
	// a fresh key pays that read before the insert.
	OrderReadFirst = protocol.OrderReadFirst
	// OrderReserveFirst starts every call with the reserving insert, as
	// [DoOpts.ReserveFirst] does for one call: no read before a fresh key's insert, and a
	// replay reads the record within that statement (at about 1.7× a plain read).
	OrderReserveFirst = protocol.OrderReserveFirst
)

// Config configures a [Coordinator]. The zero value is valid: every zero field takes its
// documented default. NewCoordinator copies it; changing it afterwards has no effect.
type Config struct {
	// Schema is the schema holding pgidem's tables. Default "": unqualified names resolved
	// through the connection's search_path. Quoted with pgx.Identifier, never spliced, so
	// any name works. It must be valid UTF-8 without NUL or other control characters, not
	// only white space, and at most [SchemaMaxBytes] bytes. Otherwise NewCoordinator
	// returns an error matching [ErrInvalidArgument]. These are the rules of
	// migrations.CheckSchemaName, which also refuses "$user".
	Schema string

	// Lease is how long a reservation stays owned without a heartbeat. The holder renews it
	// every Lease/3 while fn runs, so a slow but live holder is never taken over; a holder
	// that dies blocks other callers for at most one Lease. A holder whose renewals do not
	// get through has fn's context cancelled ([ErrLeaseLost]) a tenth of a Lease before its
	// lease can end. So keep the Lease well above the store's worst round trip and the
	// pool's worst wait for a connection. (A reserving write blocked behind an open DoTx
	// holds one for up to FinishTimeout.) Default [LeaseDefault] (30 s), minimum
	// [LeaseMin]. Must be shorter than every call's TTL.
	Lease time.Duration

	// MinTTL is the shortest record TTL a call may ask for; shorter TTLs return
	// [ErrInvalidTTL] (never a silent clamp). Default [MinTTLDefault] (1 minute); it must
	// be longer than Lease, or NewCoordinator returns an error.
	MinTTL time.Duration

	// InFlight is the policy for an in-progress key. Default [InFlightWait].
	InFlight InFlightPolicy

	// WaitTimeout bounds how long [InFlightWait] waits before returning [ErrInProgress];
	// the caller's context bounds it too. Default [WaitTimeoutDefault] (1 minute); a
	// negative value makes NewCoordinator return an error.
	WaitTimeout time.Duration

	// PollIntervalMin is the first pause of the exponential backoff between reads while
	// waiting ([InFlightWait]); the pause doubles after each read. Each pause is jittered
	// to between half and one and a half times the backoff (so waiters do not poll in
	// lockstep), and never exceeds PollIntervalMax, the holder's remaining lease or the
	// time left to wait. Default [PollIntervalMinDefault] (10 ms); not negative.
	PollIntervalMin time.Duration
	// PollIntervalMax is the longest pause of that backoff, and the shortest slice of
	// [DoTx]'s wait for a key's lock (see DoTx, Protocol). Default
	// [PollIntervalMaxDefault] (1 s); at least PollIntervalMin, at most
	// [PollIntervalMaxMax].
	PollIntervalMax time.Duration

	// FinishTimeout bounds the writes that run on a context detached from the caller's:
	//   - the reserving insert and the takeover, so their outcome is always known. A caller
	//     cancelled while one is blocked returns when it ends, and a reservation made for
	//     it is released at once.
	//   - the finishing write (complete, store failure, release) with its retries, so a
	//     cancelled caller never leaves the record stuck in progress.
	//   - each indexed read Do makes of a key, with its wait for a pool connection. A pool
	//     with no connection to spare then fails a call with a [*StoreError] saying so,
	//     instead of blocking it for as long as a context without deadline allows. Lookup,
	//     LookupTx and Forget run on the caller's context alone.
	//
	// A finishing write that fails because the server is unavailable (restarting, failing
	// over, unreachable) is the exception. After those retries it keeps retrying, a second
	// apart, each attempt bounded by FinishTimeout. It stops a tenth of a Lease before the
	// lease ends as the holder counts it, and after at most one Lease in all. The holder
	// counts from the send time of the statement that granted or last renewed the lease;
	// the server's count starts after. None of these is sent once another caller could
	// take the key over, so a restart shorter than the lease runs no effect twice.
	//
	// A call that shares a round ([Config.MaxBatch]) first waits for the rounds queued
	// ahead of it: one, unless more calls or result bytes are queued than one takes. One
	// whose round failed then runs alone; each is bounded by FinishTimeout. So a cancelled
	// writer can wait two to three times FinishTimeout, or more behind a long queue, when
	// the store is stuck (its heartbeat renews the lease); a queued reader leaves at once.
	//
	// Keep it well above the store's round trip and lock waits: a finishing write cut
	// short leaves the record in progress until its lease ends, and the effect then runs
	// again. Default [FinishTimeoutDefault] (10 s), minimum [FinishTimeoutMin] (100 ms).
	FinishTimeout time.Duration

	// MaxBatch is the most calls one reserving insert, one completing write, or one read
	// that starts calls carries. Concurrent calls may reach any of them while the
	// coordinator already has one in flight (two, for the read). They queue and share the
	// next statement: one round trip for many keys and, for a write, one commit. A shared
	// write runs in a transaction of its own with a 50 ms lock_timeout: one that waits
	// longer on one key, or that the server refuses, rolls back and its calls run one by
	// one; a shared read that fails also leaves its calls to read one by one. A call that
	// finds fewer in flight runs alone at once (a write still under that lock_timeout), so
	// batching adds no latency without concurrency. A completing write also stops taking
	// calls once their results add up to MaxValueBytes (the first always goes), so large
	// results do not pile up in one statement. The protocol and its guarantees are the
	// same either way. Default [MaxBatchDefault] (64); 1 turns batching off: every call
	// sends its own statements, without the lock_timeout.
	MaxBatch int

	// Order chooses the statement a [Do] call starts with (DoTx and DoInTx read under an
	// advisory lock whatever it says). Default [OrderAdaptive]; a value that is not one of
	// the orders makes NewCoordinator return an error.
	Order CallOrder

	// MaxKeyBytes limits the idempotency key's length in bytes; longer keys return
	// [ErrInvalidKey]. Default [MaxKeyBytesDefault] (255). With MaxNamespaceBytes at most
	// [MaxKeyBytesMax], so a primary-key entry fits a btree page.
	MaxKeyBytes int
	// MaxNamespaceBytes limits the namespace's length in bytes; longer namespaces return
	// [ErrInvalidKey]. Default [MaxNamespaceBytesDefault] (64).
	MaxNamespaceBytes int

	// MaxValueBytes limits, in bytes of encoded JSON, what pgidem stores in a jsonb
	// column: fn's result (Do, DoTx) and an inbox payload ([InboxOpts.Payload]). A larger
	// result is not storable ([ErrResultNotStorable]: the record completes without it, so
	// the effect is not repeated) and a larger payload is refused ([ErrInvalidPayload])
	// before anything is written. Without a bound, Postgres can refuse a large document
	// with an internal error that looks like an outage, and the effect would run again.
	// Default [MaxValueBytesDefault] (16 MiB); at most [MaxValueBytesMax].
	MaxValueBytes int

	// FailOpen, when true, runs fn unprotected when the store's server cannot be reached
	// before fn would run (connection refused, timed out, network down), instead of
	// returning [ErrStoreUnavailable]. It never applies once the store answered: a record
	// was read, or a statement was sent and may have reserved the key. Nor does it apply
	// when the server answered with an error (authentication failed, a missing database or
	// table, a wrong [Config.Schema]: those are returned), or to an invalid key. Each
	// unprotected run is logged at warn and reported as [EventFailOpen]. Default false: never run unprotected.
	FailOpen bool

	// MaxAttempts caps takeovers: a record whose holder's lease ran out (it died, without
	// releasing the key) when its attempts had already reached MaxAttempts is parked
	// instead of taken over, and fn does not run again. Calls for the key then get a
	// [*ParkedError] (matching [ErrParked]; [OutcomeParked]) until an operator forgets the
	// record ([Coordinator.Forget], `pgidem records forget`) or it expires; `pgidem
	// records list --status parked` lists them. A holder that returned an error released
	// the key: that is a retry, never parked. Set it where callers have no retry cap of
	// their own, so an effect that kills its process (out of memory, a crash) is not
	// restarted for ever: HTTP handlers, message consumers. River jobs have River's own
	// max attempts, which still applies. [DoOpts.MaxAttempts] overrides it per call.
	// Default 0: no cap, a dead holder's record is always taken over. Not negative.
	MaxAttempts int

	// PollOnly, when true, makes callers waiting for a record in progress only poll it
	// (every [Config.PollIntervalMin] growing to [Config.PollIntervalMax]). Default false:
	// while any caller of the coordinator waits, one connection of its own (opened with the
	// pool's settings, outside the pool) LISTENs on channel "pgidem" (or
	// "pgidem.<Schema>") and holds a shared advisory lock per key waited for (two-int
	// form, on hashtext of namespace and key). The statement that finishes a record
	// notifies its key only while such a lock is held, so records nobody waits for cost
	// nothing. Waiters so return within milliseconds of the outcome; polling stays the
	// fallback. Set it behind a transaction-pooling PgBouncer, where LISTEN cannot work,
	// or where a connection outside the pool is not allowed. A PollOnly coordinator still
	// wakes other coordinators' waiters.
	PollOnly bool

	// Logger receives a record of every unusual transition (takeover, lease lost,
	// fail-open, store error, fingerprint mismatch). Default: discard.
	Logger *slog.Logger

	// Hook receives an [Event] for every outcome, for metrics. Default: none.
	Hook Hook
}

// withDefaults returns a copy of c with zero fields set to their defaults.
func (c *Config) withDefaults() Config {
	var cfg Config
	if c != nil {
		cfg = *c
	}
	cfg.Lease = cmp.Or(cfg.Lease, LeaseDefault)
	cfg.MinTTL = cmp.Or(cfg.MinTTL, MinTTLDefault)
	cfg.InFlight = cmp.Or(cfg.InFlight, InFlightWait)
	cfg.WaitTimeout = cmp.Or(cfg.WaitTimeout, WaitTimeoutDefault)
	cfg.PollIntervalMin = cmp.Or(cfg.PollIntervalMin, PollIntervalMinDefault)
	cfg.PollIntervalMax = cmp.Or(cfg.PollIntervalMax, PollIntervalMaxDefault)
	cfg.FinishTimeout = cmp.Or(cfg.FinishTimeout, FinishTimeoutDefault)
	cfg.MaxBatch = cmp.Or(cfg.MaxBatch, MaxBatchDefault)
	cfg.MaxKeyBytes = cmp.Or(cfg.MaxKeyBytes, MaxKeyBytesDefault)
	cfg.MaxNamespaceBytes = cmp.Or(cfg.MaxNamespaceBytes, MaxNamespaceBytesDefault)
	cfg.MaxValueBytes = cmp.Or(cfg.MaxValueBytes, MaxValueBytesDefault)
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return cfg
}

func (c *Config) validate() error {
	switch {
	case c.Lease < LeaseMin:
		return invalidArgument("Config.Lease %s is below the minimum %s", c.Lease, LeaseMin)
	case c.Lease >= c.MinTTL:
		return invalidArgument("Config.Lease %s must be shorter than Config.MinTTL %s", c.Lease, c.MinTTL)
	case c.InFlight != InFlightWait && c.InFlight != InFlightRaise:
		return invalidArgument("Config.InFlight %d is not a known policy", c.InFlight)
	case c.WaitTimeout < 0:
		return invalidArgument("Config.WaitTimeout %s must not be negative", c.WaitTimeout)
	case c.PollIntervalMin < 0 || c.PollIntervalMax < c.PollIntervalMin || c.PollIntervalMax > PollIntervalMaxMax:
		return invalidArgument("Config.PollIntervalMin %s and Config.PollIntervalMax %s must satisfy 0 <= min <= max <= %s", c.PollIntervalMin, c.PollIntervalMax, PollIntervalMaxMax)
	case c.FinishTimeout < FinishTimeoutMin:
		return invalidArgument("Config.FinishTimeout %s is below the minimum %s", c.FinishTimeout, FinishTimeoutMin)
	case c.Order < OrderAdaptive || c.Order > OrderReserveFirst:
		return invalidArgument("Config.Order %d is not a known order", c.Order)
	case c.MaxBatch < 1:
		return invalidArgument("Config.MaxBatch %d must be positive", c.MaxBatch)
	case c.MaxKeyBytes < 1 || c.MaxNamespaceBytes < 1 || c.MaxKeyBytes > MaxKeyBytesMax-c.MaxNamespaceBytes:
		return invalidArgument("Config.MaxKeyBytes %d and Config.MaxNamespaceBytes %d must be positive with a sum of at most %d", c.MaxKeyBytes, c.MaxNamespaceBytes, MaxKeyBytesMax)
	case c.MaxAttempts < 0:
		return invalidArgument("Config.MaxAttempts %d must not be negative", c.MaxAttempts)
	case c.MaxValueBytes < 1 || c.MaxValueBytes > MaxValueBytesMax:
		return invalidArgument("Config.MaxValueBytes %d must be positive and at most %d", c.MaxValueBytes, MaxValueBytesMax)
	}
	if c.Schema != "" {
		if err := protocol.ValidatePart("schema", c.Schema, SchemaMaxBytes); err != nil {
			return invalidArgument("Config.Schema %q is not a usable schema name: %s", c.Schema, err.(*InvalidKeyError).Reason)
		}
		if strings.TrimSpace(c.Schema) == "" {
			return invalidArgument("Config.Schema %q is not a usable schema name: it is only white space", c.Schema)
		}
	}
	return nil
}

// Coordinator reserves idempotency keys in Postgres and runs effects under them. Create it
// with [NewCoordinator]. It holds no connection of its own between calls and is safe for
// concurrent use by any number of goroutines.
type Coordinator struct {
	engine *protocol.Engine
	config Config
	calls  CallHook // Config.Hook, when it observes calls
}

// NewCoordinator returns a coordinator that stores records through pool, which must reach a
// database where pgidem's migrations have run (package migrations). config may be nil for
// all defaults; it is copied. It returns an error naming the Config field, matching
// [ErrInvalidArgument], when a setting is invalid (or pool is nil). It does not touch the
// database.
//
// The pool may use any of pgx's query modes (ConnConfig.DefaultQueryExecMode), including
// QueryExecModeExec and the simple protocol, which pools behind a transaction-pooling
// proxy such as PgBouncer often use; the mode is read once, here. pgidem's own statements
// are written for READ COMMITTED, Postgres's default isolation. On a pool whose sessions
// default to REPEATABLE READ or SERIALIZABLE, contention on a key makes the server refuse
// some of them with serialization failures. pgidem answers those by reading the key again
// (slower, still correct).
func NewCoordinator(pool *pgxpool.Pool, config *Config) (*Coordinator, error) {
	if pool == nil {
		return nil, invalidArgument("NewCoordinator: pool is nil")
	}
	cfg := config.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	hook, logger := cfg.Hook, cfg.Logger
	calls, _ := hook.(CallHook)
	rounds, _ := hook.(RoundHook)
	var emit func(context.Context, protocol.EventKind, string, int64)
	if hook != nil {
		emit = func(ctx context.Context, kind protocol.EventKind, namespace string, count int64) {
			hook.OnEvent(ctx, Event{Kind: kind, Namespace: namespace, Count: count})
		}
	}
	c := &Coordinator{config: cfg, engine: protocol.New(pool, protocol.Settings{
		Schema: cfg.Schema, Lease: cfg.Lease, MinTTL: cfg.MinTTL, WaitTimeout: cfg.WaitTimeout,
		InFlight: cfg.InFlight, PollIntervalMin: cfg.PollIntervalMin, PollIntervalMax: cfg.PollIntervalMax,
		FinishTimeout: cfg.FinishTimeout, MaxBatch: cfg.MaxBatch, Order: cfg.Order, MaxKeyBytes: cfg.MaxKeyBytes,
		MaxNamespaceBytes: cfg.MaxNamespaceBytes, MaxValueBytes: cfg.MaxValueBytes, FailOpen: cfg.FailOpen, PollOnly: cfg.PollOnly,
		MaxAttempts: cfg.MaxAttempts, Logger: logger, Emit: emit, Round: roundFunc(rounds),
	}), calls: calls}
	return c, nil
}

// Config returns a copy of the coordinator's configuration with defaults filled in.
func (c *Coordinator) Config() Config { return c.config }

// Pool returns the pool the coordinator stores records through.
func (c *Coordinator) Pool() *pgxpool.Pool { return c.engine.Pool() }
