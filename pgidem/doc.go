// Package pgidem makes side effects happen once in systems that deliver work at least once,
// by reserving an idempotency key in Postgres — the same database as the application's rows
// and its job queue.
//
// Queues and brokers redeliver by design: a worker dies after sending the invoice and
// before acking, River's stuck-job rescuer re-runs a job a slow worker is still running, a
// Kafka rebalance replays an uncommitted batch, a producer enqueues the same request
// twice. Each redelivery repeats the effect unless a key dedupes it.
//
// # Quick start
//
// Run the migrations (package migrations), then create one [Coordinator] per pool and run
// each effect under a key that names the effect:
//
//	coord, err := pgidem.NewCoordinator(pool, nil)
//	if err != nil { ... }
//	receipt, err := pgidem.Do(ctx, coord, "mail", "order-9.invoice", 24*time.Hour, nil,
//		func(ctx context.Context) (string, error) {
//			_, key, _ := pgidem.KeyFromContext(ctx) // pass downstream as the provider's own key
//			return mailer.Send(ctx, invoice, key)
//		})
//
// The first call runs fn and stores its value; every later call within the TTL replays the
// value without running fn. Use [DoResult] to learn whether the value was replayed and how
// many attempts the record has seen.
//
// # Keys
//
// The key names the effect ("order-9.invoice"), not the delivery. A job or message id as
// key only dedupes redeliveries of that one job; two jobs enqueued for the same order would
// both run. Namespace and key are separate columns and no character is reserved, but an
// empty key, invalid UTF-8, control characters (NUL included) or an over-long key are
// rejected with [ErrInvalidKey] — and fn is not run: an unstorable key never means an
// unprotected effect.
//
// # Concurrency: in progress, lease, heartbeat, takeover
//
// While fn runs, its record is in progress under a lease ([Config.Lease], 30 s by
// default) that a heartbeat renews every lease/3, so a slow but live holder is never taken
// over. Another caller for the same key waits ([InFlightWait], the default) until the
// record completes and then replays it, or gets [ErrInProgress] at once ([InFlightRaise])
// with a retry-after hint. A holder that dies stops renewing; after at most one lease the
// next caller takes over and the record's attempts count rises to 2 — the sign that the
// effect may have run twice. Every write of a holder is conditional on its random owner
// token, so a holder that was taken over cannot overwrite its successor; it learns of the
// loss through the returned error or, when fn returned an error of its own (returned
// unchanged), through [Result.LeaseLost] ([DoResult]). fn's context is cancelled with cause
// [ErrLeaseLost] when renewals stall or find the record taken over; the cause alone does
// not prove a takeover. A holder that
// cannot renew (cut off from the store) has fn's context cancelled with that cause a tenth
// of a lease before its lease can end, so before anyone can take over; a lease granted by
// a statement that waited (behind another transaction's lock) is renewed before fn starts.
//
// An effect that kills its process every time (out of memory, a crash in a library) would
// be taken over for ever; [Config.MaxAttempts] caps that: a dead holder's record at the
// cap is parked instead ([StatusParked]), and calls get a [*ParkedError] until an
// operator forgets it. Off by default.
//
// All time arithmetic for leases and TTLs uses the database clock (now()), never the
// client's; the holder only measures durations on its own clock, from the moment it sent
// the statement that granted or renewed the lease.
//
// # Failures
//
// An error from fn releases the record so the next delivery runs fn again; wrap it with
// [Permanent] to store it and replay it instead. A panic releases and re-panics. When the
// store is unreachable before fn, the call returns [ErrStoreUnavailable] and fn does not run
// (opt into [Config.FailOpen] to run it unprotected). Replays return what fn returned as
// it comes back through JSON (encoding/json into T): zero values, nil pointers, empty
// slices and null are results, but unexported fields and anything json ignores are not
// kept, numbers in an any come back as float64, and -0 comes back as 0. A stored failure
// replays as a [*StoredFailureError] carrying its message only, not fn's error value:
// match it with [ErrPermanent], not with errors.As on your own error type.
//
// # Database effects: DoTx and the inbox
//
// When the effect is rows in the same database, commit the record with them and the effect
// becomes exactly-once. [DoTx] runs fn in the caller's transaction, serialised per key by
// a transaction-scoped advisory lock, and writes the completed record in that transaction:
// the caller's commit makes effect and record visible together, a rollback leaves neither.
// [DoInTx] begins and commits the transaction for you. For consumers that dedupe by
// message id, [Coordinator.InboxHandle] and [Coordinator.InboxRecordTx] record the message
// in pgidem_inbox in the handler's transaction (INSERT … ON CONFLICT DO NOTHING, never a
// caught unique violation). A handler that writes rows and also sends mail uses both: the
// inbox (or DoTx) for the rows, [Do] for the mail, keyed by the effect.
//
// Rows written through database/sql (sqlc, bun, GORM, ent, lib/pq) use the *sql.Tx forms,
// [DoSQLTx], [DoSQLTxResult], [Coordinator.InboxRecordSQLTx] and [Coordinator.LookupSQLTx]:
// the same protocol and records as the pgx.Tx forms, on pgx's stdlib driver or lib/pq.
//
// # Shared statements (batching)
//
// A [Coordinator] is safe for concurrent use and holds no connection between statements.
// Concurrent calls that reach the reserving insert or the completing update while the
// coordinator already has one in flight share the next statement — one round trip and
// one commit for up to [Config.MaxBatch] keys — and a call that finds none in flight runs
// at once, alone; the protocol is the same either way. Under load from many goroutines
// (a River queue, an HTTP server) this multiplies throughput; docs/performance.md has the
// figures.
//
// # Observability
//
// [Config.Logger] (a *slog.Logger, quiet by default) records every unusual transition;
// [Config.Hook] receives an [Event] for every outcome, for metrics. A Hook that also
// implements [CallHook] sees each call start and end (with its outcome, the time before
// it and fn's duration), to trace it; one that implements [RoundHook] sees each shared
// round. Package pgidemotel implements all three.
//
// # Housekeeping
//
// Expired records behave as absent whether or not they were deleted. [Coordinator.Sweep]
// deletes them in batches; run it from cron, the pgidem CLI or the River periodic job in
// package pgidemriver.
package pgidem
