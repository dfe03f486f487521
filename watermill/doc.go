// Package pgidemwatermill makes Watermill handlers' effects happen once per message, with
// pgidem's records in Postgres.
//
// Brokers deliver at least once: RabbitMQ requeues a message whose consumer died before
// the ack, a Kafka consumer group replays the uncommitted batch after a rebalance, a
// publisher that missed the broker's confirmation sends the message again. [Middleware]
// turns each of those into a replay of the first run's outcome.
//
// It is a module of its own (github.com/pgidem/pgidem/watermill), so Watermill and its
// dependencies stay out of programs that use pgidem without it.
//
// # Beyond Watermill's Deduplicator
//
// Watermill's middleware.Deduplicator keeps message hashes in an in-process map for a
// minute and marks a message before its handler runs. This package differs in these ways:
//   - Durable and shared: the record is a row in Postgres, so every process of the
//     consumer, and the process after a restart or a deploy, sees it.
//   - Marked after success: a handler that fails releases the key, so the redelivery runs
//     it again (the Deduplicator drops that redelivery: the effect never happens).
//   - The result is stored: the messages the handler produced are replayed to a
//     redelivery and published again, so a publish that failed after the handler ran is
//     retried; a permanent failure ([pgidem.Permanent]) is stored and replayed too.
//   - In-flight duplicates wait: a copy that arrives while the first is being handled
//     waits for its outcome, or is nacked and redelivered later ([Config.InFlight]); it
//     never runs beside it. A handler that dies is taken over once its lease ends.
//   - The TTL is kept by Postgres ([Config.TTL], 7 days by default) and expired rows are
//     swept ([pgidem.Coordinator.Sweep]).
//   - The key names the effect ([Config.Key], [Config.KeyMetadata]), not a hash of the
//     payload, and an invalid key nacks the message: the handler never runs unprotected.
//
// # Handler
//
// Install [Middleware.Handler] on the router (or one handler):
//
//	coord, _ := pgidem.NewCoordinator(pool, nil)
//	mw, _ := pgidemwatermill.NewMiddleware(coord, nil)
//	router.AddMiddleware(mw.Handler)
//
// Publishers name the effect in the message's metadata:
//
//	msg.Metadata.Set(pgidemwatermill.KeyMetadataDefault, "order-9.invoice")
//
// Messages without the field are keyed by their UUID, which dedupes redeliveries of the
// message and a publisher's retries of it. The namespace defaults to the router handler's
// name. Inside the handler, [pgidem.KeyFromContext](msg.Context()) returns the key: pass it
// to the mail or payment provider as its own idempotency key.
//
// # Inbox
//
// For effects that are rows in the same database, [Middleware.InboxHandler] records the
// message in pgidem's inbox and runs the handler in that transaction, so the rows and the
// record commit together. A handler that also sends mail calls [pgidem.Do] for it, keyed
// by the effect ("order-9.invoice"):
//
//	router.AddConsumerHandler("billing", "orders", sub, func(msg *message.Message) error {
//		_, err := handle(msg)
//		return err
//	})
//
// where handle is mw.InboxHandler(func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error) { … }).
//
// # Answers
//
// Each message's answer follows pgidem's outcome ([pgidem.Result.Outcome]) through one
// table: the handler's messages (ack), the replayed messages (ack), an error (nack, the
// broker redelivers), or for a stored permanent failure an ack or an error for a poison
// queue ([Config.StoredFailure]). [Middleware.Handler] lists the cases.
//
// Place the middleware inside Watermill's Retry middleware if you use it, so each retry
// is a new call: a released key runs again, an in-progress one waits or is nacked.
package pgidemwatermill
