// Package pgidemriver runs River jobs' effects once, with pgidem records kept in the same
// Postgres database as River's queue.
//
// River delivers every job at least once. A worker that dies after sending the invoice and
// before River's batched completer recorded the job as completed gets the job again. The
// stuck-job rescuer re-runs a job still running after RescueStuckJobsAfter without stopping
// the first run, so a slow job runs twice in parallel. A producer that retries enqueues two
// jobs for one order. [Middleware] makes each of those replay the first run's outcome
// instead of repeating the effect.
//
// One River behaviour no middleware changes: on a job's last attempt the rescuer does not
// re-run a job still running after RescueStuckJobsAfter, it discards it. The first run
// goes on, and its effect may complete (the record says so), while River shows the job
// discarded with the rescuer's error. Keep RescueStuckJobsAfter above the longest run a
// job can take, above all for jobs with few attempts.
//
// # Middleware
//
// Name the effect in the job args, register the worker through [AddWorker] (so the
// middleware knows the args type), and install the middleware.
//
//	// The args name the effect.
//	type InvoiceArgs struct{ OrderID int64 `json:"order_id"` }
//
//	func (InvoiceArgs) Kind() string { return "mail.invoice" }
//	func (a InvoiceArgs) IdempotencyKey() string { return fmt.Sprintf("order-%d.invoice", a.OrderID) }
//
//	// One coordinator and one middleware per client.
//	coord, _ := pgidem.NewCoordinator(pool, nil)
//	mw, _ := pgidemriver.NewMiddleware(coord, nil)
//	workers := river.NewWorkers()
//	pgidemriver.AddWorker(workers, mw, &InvoiceWorker{})
//	// Install the middleware globally.
//	config := &river.Config{
//		Middleware: []rivertype.Middleware{mw},
//		Queues:     map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: 10}},
//		Workers:    workers,
//	}
//	// Returns (and logs, through Config.Logger or the coordinator's, which are quiet by
//	// default) the kinds whose TTL is shorter than River's horizon.
//	warnings := mw.CheckTTL(ctx, config)
//	client, _ := river.NewClient(riverpgxv5.New(pool), config)
//
// Register the middleware once, globally as above or on a worker (its Middleware method).
// Registered in both places it still works — the inner registration sees the outer one's
// reservation for the job and passes straight through — but only the outer one reports.
//
// Inside the worker, [pgidem.KeyFromContext] returns the key: pass it to the mail or
// payment provider as its own idempotency key. Record the receipt with [RecordOutput] so
// replayed jobs carry the same output.
//
// The key names the effect ("order-9.invoice"), not the delivery. Its namespace defaults to
// the canonical kind of the registered args type, so jobs inserted under a kind alias
// before a rename share keys with jobs inserted after it. Jobs whose args name no effect
// fall back to the job id ([KeySourceJobID]): that dedupes redeliveries of one job but not
// two jobs for the same order, so the fallback is logged once per kind and counted.
//
// # Middleware: per execution
//
// For each execution of a job, in order, the [Middleware]:
//  1. Finds the key: the args' [KeyArgs] key (decoded from the job's encoded args), else
//     [Config.KeyFunc], else the job id ([KeySourceJobID]). The namespace is
//     [NamespaceArgs], else the canonical kind of the registered args type (the job kind
//     when the type is not registered).
//  2. Reserves the key ([pgidem.DoResult]) within [Config.SQLTimeout], with
//     [pgidem.DoOpts.ReserveFirst]. Most jobs name a new key, so the reserving insert is
//     the first statement; it returns a completed record itself when there is one.
//  3. Completed before: returns nil without running the worker (replay). In progress
//     elsewhere: snoozes or waits ([Config.InFlight]). Otherwise it runs the worker
//     (doInner) while a heartbeat renews the lease for as long as it runs. That holds past
//     JobTimeout and for jobs without a timeout, so the rescuer's duplicate finds it in
//     progress rather than taking over.
//  4. Worker returns nil: the record completes. When it cannot, the job completes all the
//     same ([Outcome.RecordNotCompleted]). Worker returns an error: the record is released
//     and the error returned as "Errors" below says, so River retries. A
//     [pgidem.Permanent] error is stored and the job cancelled.
//
// # Redeliveries, in flight
//
// River runs worker middleware before it decodes args and before it applies JobTimeout.
// So the middleware decodes what it needs from the job's encoded args, and bounds its own
// SQL before the worker starts ([Config.SQLTimeout]; never the worker). While the worker
// runs, pgidem's heartbeat renews the lease — also past JobTimeout, for a worker that
// ignores cancellation — so the rescuer's parallel duplicate finds the key in progress.
//
// Renewals may stall until a tenth of a lease before it ends, or a renewal may find the
// record taken over. The worker's context is then cancelled with cause
// [pgidem.ErrLeaseLost], however long the worker has been running. The cause alone does
// not prove a takeover.
//
// A duplicate that finds the key in progress is, by default, snoozed (river.JobSnooze,
// which uses no attempt). The snooze is the holder's remaining lease clamped to
// [Config.SnoozeMin] and [Config.SnoozeMax] (5 s), and the job replays once the holder
// completed. With [pgidem.InFlightWait] it waits, bounded, and replays.
//
// # Errors
//
// A worker error releases the reservation and reaches River unchanged, so River's retry
// runs the worker again; snooze and cancel errors pass through as they are. Two cases wrap
// it. When the record was found taken over meanwhile, the error is wrapped in one matching
// [pgidem.ErrLeaseLost]. When pgidem cancelled the worker because its lease could not be
// renewed in time, the error is wrapped in one that says so.
//
// A [pgidem.Permanent] error is stored, and this and later jobs with the key are
// cancelled. What counts is a Permanent error in the worker's error chain, pgidem's own
// rule. An error matching [pgidem.ErrPermanent] only through a failure a nested pgidem
// call replayed is an ordinary worker error.
//
// An invalid key fails the job loudly without running the worker: an unstorable key never
// means an unprotected effect. A worker that succeeded completes its job even when the
// store then fails to complete its record (logged at error, [Outcome.RecordNotCompleted]).
// The effect ran, and retrying the job would run it again once the lease ends.
//
// # Outcomes
//
// Each execution ends in pgidem's outcome of the job's call ([pgidem.Result.Outcome]), and
// one table maps it, with what the worker returned, to River's answer and the
// middleware's [Action]:
//
//   - executed, taken_over, fail_open: the worker ran. nil when it succeeded
//     ([ActionExecuted], also when the record could not be completed); its error
//     otherwise ([ActionReleased]), or river.JobCancel for a [pgidem.Permanent] one
//     ([ActionCancelled]).
//   - replayed, waited_replayed: nil, with the first run's output ([ActionReplayed]).
//   - stored_failure: river.JobCancel ([ActionCancelled]); nil for an effect whose output
//     alone could not be stored.
//   - in_progress: river.JobSnooze ([ActionSnoozed]).
//   - not_stored: nil when only the output could not be stored; river.JobCancel for a
//     permanent failure that could not be ([Outcome.RecordNotCompleted]).
//   - lease_lost: an error matching [pgidem.ErrLeaseLost] ([ActionError]); River's retry
//     replays or waits for the new holder's outcome.
//   - invalid_key, fingerprint_mismatch, store_error, or none: an error ([ActionError]).
//
// [Outcome.Outcome] and [Stats.Outcomes] carry pgidem's outcome as it is, so the River
// adapter's metrics and pgidem's events read the same. [Config.Hook] receives each
// Outcome. A [StartHook] also sees each execution start, and the context it returns is
// the execution's: package pgidemotel's hook opens a span per job with it.
//
// # Database effects: WorkTx
//
// When the effect is rows in the same database, [WorkTx] writes the rows, the pgidem
// record and River's job completion (river.JobCompleteTx) in the caller's transaction.
// They commit together or not at all. The worker commits when [ShouldCommit] says so and
// rolls back otherwise. [WorkInTx] begins and commits the transaction itself
// (pgidem.DoTx and pgidem.DoInTx divide the same way).
//
//	func (w *ShipWorker) Work(ctx context.Context, job *river.Job[ShipArgs]) error {
//		// A *pgxpool.Pool; in tests, rivertest's transaction.
//		tx, err := w.db.Begin(ctx)
//		if err != nil {
//			return err
//		}
//		defer tx.Rollback(ctx)
//		// The effect, its record and the job's completion, all in tx.
//		_, err = pgidemriver.WorkTx(ctx, w.coord, tx, job, "shipments", job.Args.OrderRef(), 7*24*time.Hour, nil,
//			func(ctx context.Context, tx pgx.Tx) (int64, error) { return insertShipment(ctx, tx, job.Args) })
//		if !pgidemriver.ShouldCommit(err) {
//			return err
//		}
//		// Keep the completion, or the stored failure with River's cancel.
//		if cerr := tx.Commit(ctx); cerr != nil {
//			return cerr
//		}
//		return err
//	}
//
// River completes jobs asynchronously in batches after Work returns, and a process that
// dies in between gets the job again. Here the completion commits with the effect, so that
// redelivery cannot happen. A crash anywhere before the commit leaves none of the three,
// and the retry runs fn again. A redelivery that does reach a committed key (the rescuer's
// duplicate, a second job for the same effect) replays the stored value without running
// fn, and completes its own job in the same way.
//
// After an error fn's writes are always undone. So a commit after a cancel keeps the
// stored failure, when there is one, and the caller's own writes before WorkTx.
//
// The key must differ from the one the [Middleware] reserved for the same job, since
// DoTx would find that reservation in progress. Exclude the kind from the middleware
// ([Config.ExcludeKinds]) or use another namespace. The same key returns an error
// matching [pgidem.ErrInvalidArgument] at once, and River retries the job.
//
// # WorkTx and a job no longer running
//
// River's rescuer may make a job retryable or discard it while it runs, or a parallel
// execution may snooze it. river.JobCompleteTx then changes nothing, and WorkTx returns an
// error matching [ErrJobNotRunning]. Roll back, or the effect commits without the
// completion; wherever River runs the job next, the effect runs there. A discarded job (the
// rescuer, on its last attempt) is not run again, and River drops this error: WorkTx logs
// it at error on the coordinator's logger. A job cancelled with River's JobCancel while it
// runs has its context cancelled instead, and WorkTx returns the context's error.
//
// # TTL horizon
//
// A record's TTL must outlive every delivery of its job, or a late delivery runs the
// effect again. [Middleware.CheckTTL] compares each kind's TTL with that horizon. It must
// be called by hand or through [NewClient]. River v0.51 has no hook that runs when a client
// starts and lists its registered workers: the Workers bundle is opaque, and
// HookPeriodicJobsStart runs only on the leader.
//
// The horizon is deliberately conservative: it assumes the effect completed in the first
// attempt, River lost that completion, and every later attempt failed. With River's
// defaults (1 h to rescue, 25 attempts over about 3 weeks, 7 days of discarded retention)
// it is about a month, longer than [TTLDefault]. Give effect jobs fewer attempts, a longer
// TTL ([TTLArgs], [Config.TTL]), or shorter retention periods. With fewer attempts keep
// RescueStuckJobsAfter above their longest run: on the last attempt River's rescuer
// discards a job still running. Even one attempt, with River's default retention of
// discarded jobs (7 days, during which one can be retried by hand), needs a TTL above 169 h
// (1 h to rescue plus 7 days).
//
// # Testing workers
//
// River's rivertest.Worker runs a config's worker middleware, so a worker can be tested
// with the middleware. Register the args type ([Middleware.Register]) since rivertest
// takes the worker alone, and pass the middleware in the config. The middleware's records
// are written on the coordinator's pool, outside the test's transaction, so use keys
// unique to the test. A worker using [WorkTx] can take its transaction from the test's
// (pgx's Tx.Begin makes a savepoint): the rows, the record and the job then all roll back
// with it. [WorkInTx] cannot run there: its own transaction does not see the job the test
// inserted, so River's JobCompleteTx panics (rivertest reports a PanicError). A permanent
// failure of fn, which never reaches the completion, is committed on the pool there and
// outlives the test's rollback. To assert what a job left behind, the
// pgidemtest package reads the key's record (pgidemtest.RequireCompleted with an
// Attempts of 1: the effect ran once).
//
// # Cost
//
// A job with a fresh key adds two committed statements to River's own: the reserving
// insert before the worker runs and the completing update after it. Each is shared with
// the other jobs reaching it at the same moment: one round trip and one commit for up to
// [pgidem.Config.MaxBatch] of them. A redelivered or duplicate job adds one statement that
// commits nothing: the same reserving insert, which finds the record and writes nothing
// (ON CONFLICT DO NOTHING), so it replays.
//
// With River's default fetch settings a queue of no-op jobs runs as fast with the
// middleware as without it. A queue tuned to fetch every 10 ms loses 0–54 % of its no-op
// jobs per second, depending on the disk's flush latency. It loses 12–64 % once Postgres's
// CPU is the limit, because the middleware's row writes are then as much work as River's.
// A job that spends 50 ms in another service loses 1–13 % (20 % on a disk that slowed
// during the run).
//
// Size the pool for the workers: with pgxpool's default (max(4, CPUs) connections) they
// queue for connections; the measurements gave 50 to 200 workers a pool of 20. The
// figures, and how to rerun them, are in docs/performance.md of the repository.
//
// # Housekeeping
//
// [NewSweepPeriodicJob] and [SweepWorker] delete expired records every five minutes. The
// leader inserts the sweep job, and any client working its queue may run it (two at once
// split the rows). [MigrateRiver] runs River's migrations under an advisory lock so that deploys
// starting at once do not collide.
package pgidemriver
