// Package pgidem makes side effects happen once in systems that deliver work at least once,
// by reserving an idempotency key in Postgres — the same database as the application's rows
// and its job queue.
//
// Queues and brokers redeliver by design. A worker dies after sending the invoice and
// before acking; River's stuck-job rescuer re-runs a job a slow worker is still running; a
// Kafka rebalance replays an uncommitted batch; a producer enqueues the same request
// twice. Each redelivery repeats the effect unless a key dedupes it.
//
// # Quick start
//
// Run the migrations (package migrations). Then create one [Coordinator] per pool and run
// each effect under a key that names the effect.
//
//	coord, err := pgidem.NewCoordinator(pool, nil)
//	if err != nil { ... }
//	receipt, err := pgidem.Do(ctx, coord, "mail", "order-9.invoice", 24*time.Hour, nil,
//		func(ctx context.Context) (string, error) {
//			// Pass the key downstream as the provider's own key.
//			_, key, _ := pgidem.KeyFromContext(ctx)
//			return mailer.Send(ctx, invoice, key)
//		})
//
// The first call runs fn and stores its value; every later call within the TTL replays the
// value without running fn. Use [DoResult] to learn whether the value was replayed and how
// many attempts the record has seen.
//
// # Keys and TTL
//
// The key names the effect ("order-9.invoice"), not the delivery. A job or message id as
// key only dedupes redeliveries of that one job; two jobs enqueued for the same order would
// both run. Namespace and key are separate columns and no character is reserved. An
// empty key, invalid UTF-8, control characters (NUL included) or an over-long key are
// rejected with [ErrInvalidKey], and fn is not run: an unstorable key never means an
// unprotected effect.
//
// The ttl is how long the record counts, measured from completion. While the record is in
// progress it counts from the holder's last heartbeat: the record expires a ttl after its
// lease, so a dead holder is always taken over first. Make the ttl outlive the queue's
// retry and retention horizon. An expired record behaves exactly like no record.
//
// # Concurrency: in progress, lease, heartbeat, takeover
//
// While fn runs, its record is in progress under a lease ([Config.Lease], 30 s by
// default) that a heartbeat renews every lease/3, so a slow but live holder is never taken
// over. No connection is held while fn runs. Another caller for the same key waits
// ([InFlightWait], the default) until the record completes and then replays it, or gets
// [ErrInProgress] at once ([InFlightRaise]) with a retry-after hint. A waiter gives up
// with an [*InProgressError] after the wait timeout, or with ctx's error, and never writes.
//
// A holder that dies stops renewing. After at most one lease the next caller takes over,
// runs fn again, and the record's attempts count rises to 2 — the sign that the effect may
// have run twice. Every write of a holder is conditional on its random owner token, so a
// holder that was taken over cannot overwrite its successor. It learns of the loss through
// the returned error ([ErrLeaseLost]). When fn returned an error of its own (returned
// unchanged), [Result.LeaseLost] is the only sign.
//
// fn's context is cancelled with cause [ErrLeaseLost] when renewals stall or find the
// record taken over; the cause alone does not prove a takeover. A holder that cannot renew
// (cut off from the store) has fn's context cancelled a tenth of a lease before its lease
// can end, so before anyone can take over. A lease granted by a statement that waited
// (behind another transaction's lock) is renewed before fn starts.
//
// An effect that kills its process every time (out of memory, a crash in a library) would
// be taken over for ever; [Config.MaxAttempts] caps that: a dead holder's record at the
// cap is parked instead ([StatusParked]), and calls get a [*ParkedError] until an
// operator forgets it. Off by default.
//
// All time arithmetic for leases and TTLs uses the database clock (now()), never the
// client's. The holder only measures durations on its own clock, from the moment it sent
// the statement that granted or renewed the lease.
//
// # Outcomes of fn
//
// After fn returns, [Do] finishes the record. Wrap an error with [Permanent] to store it
// and replay it instead of running fn again.
//   - fn succeeds: the value is stored as JSON (jsonb, encoding/json rules) and returned;
//     later calls replay it, decoded into T.
//   - fn returns an error: the record is released so the next delivery runs fn again, and
//     the error is returned unchanged.
//   - fn returns a [Permanent] error: it is stored and replayed as a
//     [*StoredFailureError].
//   - fn panics: the record is released and the panic continues.
//   - encoding fn's value panics (its MarshalJSON): the effect ran, so the record is
//     completed without the value, and the panic continues. Later calls replay an error
//     matching [ErrResultNotStorable].
//
// Releasing deletes a first reservation. One that took over a dead holder's is kept with
// its lease ended, so the next call takes it over at once. That takeover counts no attempt
// and reports none, since this holder did not die; the record's attempts still show that
// the effect may have run more than once.
//
// When storing a [Permanent] error fails, the error returned is a
// [*FailureNotStoredError]. It matches fn's error and also [ErrStoreUnavailable] or
// [ErrLeaseLost]. Nothing will be replayed: a later call takes the key over once the lease
// ends.
//
// The finishing write runs on a context detached from the caller's, bounded by
// [Config.FinishTimeout]. It is retried briefly, and while the lease lasts when the
// server is restarting or unreachable, so a cancelled caller does not leave the record
// stuck in progress. If it finds the reservation taken over, the value is returned with an
// error matching [ErrLeaseLost]: the effect may have run twice, and the record's attempts
// say so.
//
// # Replayed values
//
// Replays return what fn returned as it comes back through JSON (encoding/json into T).
// Zero values, nil pointers, empty slices and null are results. Unexported fields and
// anything json ignores are not kept. Three limits come from JSON and jsonb: a
// json.RawMessage replays as the same JSON value in jsonb's normal form, numbers inside an
// any decode as float64, and a negative zero replays as 0 (jsonb's numeric has no sign on
// zero).
//
// Some values cannot be stored exactly: a channel, NaN, a string with NUL or invalid
// UTF-8, more than [Config.MaxValueBytes] of JSON, or nesting deeper than 10000. Such a
// value is returned with an error matching [ErrResultNotStorable]; the record is completed
// without it, so the effect is not repeated. A stored value that no longer decodes into T
// (a result type changed between deploys, two call sites share a key with different types)
// replays as an error matching [ErrReplayNotDecodable], and fn does not run.
//
// A stored failure replays as a [*StoredFailureError] carrying its message only, not fn's
// error value. Match it with [ErrPermanent], not with errors.As on your own error type.
//
// # Store errors, cancellation and the pool
//
// When the store is unreachable before fn, the call returns a [*StoreError] matching
// [ErrStoreUnavailable] and fn does not run. Opt into [Config.FailOpen] to run it
// unprotected instead. Cancelling ctx before fn runs returns ctx's error and leaves no
// reservation behind. A reservation made while ctx ended is released at once; a reserving
// statement already sent finishes first, within [Config.FinishTimeout].
//
// A pool can be smaller than the calls holding a connection, such as handlers inside
// [Coordinator.InboxHandle] or [DoInTx] that call Do. With every connection in use, the
// statements before fn wait for a connection while ctx lasts. When ctx ends first they
// return its error with nothing sent, with or without [DoOpts.ReserveFirst]. That holds
// also while queued behind a concurrent call's shared read or reserving statement that
// waits for its connection. That statement itself waits at most [Config.FinishTimeout]
// and then returns a [*StoreError]. Size the pool for the calls in flight.
//
// # Database effects: DoTx and the inbox
//
// When the effect is rows in the same database, commit the record with them and the effect
// becomes exactly-once. [DoTx] runs fn in the caller's transaction, serialised per key by
// a transaction-scoped advisory lock, and writes the completed record in that transaction.
// The caller's commit makes effect and record visible together; a rollback leaves neither.
// [DoInTx] begins and commits the transaction for you. For consumers that dedupe by
// message id, [Coordinator.InboxHandle] and [Coordinator.InboxRecordTx] record the message
// in pgidem_inbox in the handler's transaction (INSERT … ON CONFLICT DO NOTHING, never a
// caught unique violation). A handler that writes rows and also sends mail uses both: the
// inbox (or DoTx) for the rows, [Do] for the mail, keyed by the effect.
//
// Rows written through database/sql (sqlc, bun, GORM, ent, lib/pq) use the *sql.Tx forms,
// [DoSQLTx], [DoSQLTxResult], [Coordinator.InboxRecordSQLTx] and [Coordinator.LookupSQLTx].
// They follow the same protocol and write the same records as the pgx.Tx forms, on pgx's
// stdlib driver or lib/pq.
//
// # Inbox
//
// The message id names the delivery (a Kafka event id, an SQS message id). The consumer
// scopes it, so two consumer groups handling one topic keep separate inboxes. Both follow
// the key rules ([ErrInvalidKey]).
//
// [Coordinator.InboxRecordTx] inserts with ON CONFLICT DO NOTHING, never a caught unique
// violation, so a duplicate leaves tx usable. Recording a duplicate is a pure read: no row
// lock, no transaction id. A concurrent transaction recording the same message blocks
// until the first one ends: after its commit the call returns false, after its rollback
// true. A row past its retention counts as absent and is reused (true), whether or not a
// concurrent [Coordinator.Sweep] deletes it meanwhile.
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate, or a concurrent Sweep
// deleting the expired row the call would reuse, may instead cause a serialization
// failure. It is returned as a [*StoreError] whose Err is the *pgconn.PgError with SQLSTATE
// 40001; retry the transaction. A read-only tx is refused by the server (a *StoreError, as
// from a server that refuses writes), which aborts it: roll it back.
//
// A call for the message from within the [Coordinator.InboxHandle] fn handling it is
// refused before tx is touched. On that fn's tx it would report a duplicate, and the caller
// would skip the handler's writes. On another it would wait for the handler's uncommitted
// row.
//
// In [Coordinator.InboxHandle], a commit can fail by fn's doing; the error then says so:
//   - fn returned nil after one of its statements failed. The server aborts the
//     transaction, so the commit rolls back.
//   - the server refused the commit for a deferred constraint fn's writes broke (SQLSTATE
//     class 23). Nothing is committed, and a redelivery would be refused the same way.
//   - fn committed or rolled back tx itself (matching [ErrInvalidArgument]). fn's writes
//     and the inbox row went with whichever fn called, so a redelivery is skipped or runs
//     fn again.
//
// A fn that calls [Do] takes a second connection from the pool while InboxHandle holds
// one. Size the pool above the number of concurrent handlers, twice that so that none
// waits. With no connection to spare the handlers wait on each other. A Do that gets no
// connection within [Config.FinishTimeout] then fails with an [ErrStoreUnavailable] error
// saying so, or ends with ctx if that comes first. Before the effect, nothing ran. After
// it, the record stays in progress until its lease ends, and the next delivery runs the
// effect again.
//
// # DoTx: lock and wait
//
// DoTx serialises transactions on the same key with a transaction-scoped advisory lock
// (pg_advisory_xact_lock) on a 64-bit hash of (namespace, key), held until tx ends. When
// the lock is free it is taken and the record read in one round trip. When another
// transaction holds it, the same round trip's read still counts. A completed record or a
// stored failure within its TTL is final, so it is replayed without the lock. A
// transaction that holds the lock only to replay, and stays open, does not hold up the
// key's replays.
//
// Otherwise the in-flight policy decides. [InFlightRaise] returns an [*InProgressError] at
// once. [InFlightWait] waits for the lock under SET LOCAL lock_timeout, inside a
// savepoint, in slices. Between slices it reads the record again, and a record that
// finished meanwhile replays at once. When the wait timeout passes it returns an
// [*InProgressError] with Waited set.
//
// A slice lasts [Config.PollIntervalMax] or twice the session's deadlock_timeout
// (Postgres's default 1 s), whichever is longer. Postgres checks a lock wait for a
// deadlock only once it has lasted deadlock_timeout. So when two transactions take two keys
// (or a key and a row) in opposite order, one of them is told of a deadlock and the other
// goes on. The error is a [*StoreError] for op "lock" that unwraps to a *pgconn.PgError
// with SQLSTATE 40P01: roll that transaction back and retry it.
//
// Either way tx stays usable: the savepoint is rolled back and lock_timeout is restored to
// the caller's value. The RetryAfter hint of a lock conflict is [Config.PollIntervalMax]
// (there is no lease to measure), and its Attempts and LeaseExpiresAt are zero.
//
// The wait timeout is [DoOpts.WaitTimeout], else [Config.WaitTimeout] (default one
// minute); it is unused under Raise. It is one budget for the whole call, counted from
// when DoTx starts, and ctx bounds it too. The wait for the advisory lock and any polling
// of a Do holder's row both draw on it. lock_timeout is set to what remains of it (or the
// slice, whichever is less), rounded up to whole milliseconds.
//
// Holding the lock, DoTx reads the record:
//   - completed (or a stored permanent failure) and not expired: the fingerprint is
//     checked ([ErrFingerprintMismatch]) and the stored value is replayed without running
//     fn; Result.Replayed is set.
//   - absent or expired: fn runs with tx's savepoint and a context carrying the key
//     ([KeyFromContext]). Then the completed record, with fn's value as JSON, is upserted
//     in tx.
//
// On success the savepoint is released; nothing is visible to others until the caller
// commits. A [Permanent] error from fn writes a failed record in tx instead. Once tx
// commits, later calls replay it as a [*StoredFailureError] matching [ErrPermanent]
// without running fn. Roll tx back instead and the next call runs fn again. The record's
// ttl counts from DoTx's upsert statement (the database's
// statement_timestamp()), not from the caller's commit. Time the transaction stays open
// afterwards is taken from the record's life, and a transaction held open longer than ttl
// commits a record that has already expired.
//
// # DoTx and Do on one key
//
// [Do] does not take the advisory lock; the record row is what the two share. Prefer one
// mode per key: DoTx for rows, Do for foreign effects.
//   - DoTx finds a record Do completed: it replays it (same JSON encoding, so use the same
//     T).
//   - DoTx finds Do's record in progress under a live lease: the in-flight policy applies.
//     Raise returns an [*InProgressError] with the lease's retry-after. Wait polls the
//     record (a fresh read per poll under READ COMMITTED), bounded by the wait timeout. It
//     stops when Do completes (replay), releases the record (fn runs) or its lease runs out.
//   - Do's holder died and its lease ran out: DoTx takes the record over, runs fn and writes
//     the completed record with attempts incremented (the foreign effect may have happened
//     too). Result.TookOver is set and the takeover is logged. The dead holder's owner
//     token no longer matches, so its late writes are refused ([ErrLeaseLost]).
//   - Do reserves the key while DoTx's fn runs: DoTx's upsert leaves Do's live row alone.
//     DoTx rolls back to its savepoint (fn's writes are undone) and decides again as above,
//     so the effect still happens once — Do's. The same holds when fn returned a
//     [Permanent] error: it is not recorded and not returned, and DoTx decides again.
//   - Do arrives after DoTx wrote the record but before the caller committed: Do's insert
//     waits for tx. If tx commits, Do replays DoTx's value; if it rolls back, Do runs. Do
//     holds a pool connection while it waits.
//
// That waiting statement runs detached from Do's context and is bounded by
// [Config.FinishTimeout] (default 10 s), not by Do's ctx. If tx stays open longer, Do
// returns a [*StoreError] for op "reserve" without running fn. That holds under
// [Config.FailOpen] too, since the store answered and the reservation may exist. Keep
// transactions that call DoTx short.
//
// In particular, never call Do on a key from the goroutine that holds DoTx's open
// transaction on that key (after DoTx, before the commit). Do waits for a commit that
// cannot come while the goroutine is blocked in Do: a deadlock across two connections that
// Postgres cannot detect. Do blocks for the full [Config.FinishTimeout] whatever its ctx,
// then fails as just described. Use DoTx again in tx instead: it replays.
//
// # DoTx and isolation
//
// Use READ COMMITTED, Postgres's default. Each of DoTx's statements then sees what
// committed before it, so a transaction that waited for the lock replays its predecessor.
//
// Under REPEATABLE READ or SERIALIZABLE the snapshot may predate the predecessor's commit.
// The upsert then fails with a serialization failure (SQLSTATE 40001, returned as a
// [*StoreError]) instead of a duplicate effect. The caller retries its transaction as
// usual, and the retry replays.
//
// Waiting for a Do holder does not work there: every poll reads the transaction's
// snapshot, which never shows Do finishing. So [InFlightWait] on a Do row in progress can
// only time out ([*InProgressError] with Waited set). If the lease in the snapshot runs out
// first, it takes over: fn runs, then the upsert fails with a serialization failure and
// fn's writes are undone. Use [InFlightRaise] and retry the transaction, or READ
// COMMITTED.
//
// # Shared statements (batching)
//
// A [Coordinator] is safe for concurrent use and holds no connection between statements.
// Concurrent calls may reach the read that starts a call, the reserving insert or the
// completing update while the coordinator already has one in flight. They then share the
// next statement: one round trip (and, for the writes, one commit) for up to
// [Config.MaxBatch] keys. A call that finds fewer in flight (one; two for the read) runs
// at once, alone; the protocol is the same either way. Under load from many goroutines (a
// River queue, an HTTP server) this multiplies throughput; docs/performance.md has the
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
