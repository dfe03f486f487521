package pgidemwatermill

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/pgidem"
)

// storedMessage is a message the handler produced, as its record stores it.
type storedMessage struct {
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata,omitempty"`
	Payload  []byte            `json:"payload"`
}

// Handler wraps h so that it runs at most once per message key within [Config.TTL]; its
// signature is Watermill's HandlerMiddleware, so pass it to the router's AddMiddleware or
// a handler's. For each message it derives the key ([Config.Key]) and runs h under it
// through [pgidem.DoResult], with the message's context replaced, while h runs, by one
// that carries the key ([pgidem.KeyFromContext]) and is cancelled when the lease is lost.
// The message is answered by outcome:
//   - new key (or one taken over from a holder that died): h runs. Success stores the
//     messages h produced and returns them (the router publishes them and acks). An
//     error releases the key and is returned unchanged: the router nacks, and the
//     redelivery runs h again. A [pgidem.Permanent] error is stored and answered as
//     [Config.StoredFailure] says. A panic releases the key and continues.
//   - completed key: h does not run; the stored messages are returned again (same UUIDs,
//     metadata and payloads), so a publish that failed after the first run is retried.
//   - key in progress in another handler: waits for its outcome ([Config.InFlight]), or
//     returns an error matching [pgidem.ErrInProgress]: the router nacks and the broker
//     redelivers the message later.
//   - stored permanent failure: acked, or an error matching [pgidem.ErrPermanent]
//     ([Config.StoredFailure]).
//   - invalid key or namespace, a key function's error, a fingerprint mismatch, an
//     unreachable store: an error; h does not run, never unprotected.
//   - the write after h found the key taken over ([pgidem.ErrLeaseLost]): an error; the
//     redelivery replays or waits for the new holder's outcome.
//
// When h succeeded but its messages could not be stored (too large, or the store failed
// after the effect), they are returned and the message is acked, since a redelivery would
// repeat the effect; this is logged. Safe for concurrent use.
func (m *Middleware) Handler(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		namespace, key, err := m.identify(msg)
		if err != nil {
			return nil, err
		}
		f := facts{namespace: namespace, key: key}
		parent := msg.Context()
		res, err := pgidem.DoResult(parent, m.coord, namespace, key, m.config.TTL, m.doOpts(msg),
			func(ctx context.Context) ([]storedMessage, error) {
				f.ran = true
				msg.SetContext(ctx)
				defer msg.SetContext(parent)
				produced, herr := h(msg)
				f.produced, f.handlerErr = produced, herr
				if herr != nil {
					return nil, herr
				}
				return store(produced), nil
			})
		f.outcome, f.err, f.replayed = res.Outcome, err, res.Value
		return m.answer(parent, msg, f)
	}
}

// doOpts returns the per-call options for msg.
func (m *Middleware) doOpts(msg *message.Message) *pgidem.DoOpts {
	opts := &pgidem.DoOpts{InFlight: m.config.InFlight, WaitTimeout: m.config.WaitTimeout}
	if m.config.Fingerprint != nil {
		opts.Fingerprint = m.config.Fingerprint(msg)
	}
	return opts
}

// store returns the stored form of produced.
func store(produced []*message.Message) []storedMessage {
	if produced == nil {
		return nil
	}
	out := make([]storedMessage, 0, len(produced))
	for _, p := range produced {
		if p == nil {
			continue
		}
		out = append(out, storedMessage{UUID: p.UUID, Metadata: p.Metadata, Payload: p.Payload})
	}
	return out
}

// restore returns the messages a record stored.
func restore(stored []storedMessage) []*message.Message {
	if stored == nil {
		return nil
	}
	out := make([]*message.Message, 0, len(stored))
	for _, s := range stored {
		p := message.NewMessage(s.UUID, s.Payload)
		for k, v := range s.Metadata {
			p.Metadata.Set(k, v)
		}
		out = append(out, p)
	}
	return out
}

// TxHandlerFunc handles a message in tx, the transaction that records it in pgidem's inbox.
// It must not commit or roll back tx. The messages it returns are published by the router
// as a HandlerFunc's are.
type TxHandlerFunc func(ctx context.Context, tx pgx.Tx, msg *message.Message) ([]*message.Message, error)

// InboxHandler returns a Watermill handler that handles each message at most once through
// pgidem's inbox ([pgidem.Coordinator.InboxHandle]): in one transaction it records the
// message under consumer [Config.Namespace] and id [Config.Key], and runs fn when the
// message is new, then commits. fn's writes through tx and the inbox row commit together,
// so database effects are exactly-once; an effect outside the database (a mail) needs
// [pgidem.Do] inside fn, keyed by the effect.
//
// A message already recorded is acked without running fn, and produces no messages (the
// inbox stores no result: use [Middleware.Handler] when produced messages must be
// published again). fn's error, or a failed commit, rolls back both and is returned: the
// router nacks, and the redelivery runs fn again. A concurrent duplicate waits for the
// first transaction, then is skipped (or runs, after a rollback). An invalid key or
// namespace, a key function's error or an unreachable store returns an error and runs
// nothing. InFlight, WaitTimeout, Fingerprint and StoredFailure do not apply (a
// [pgidem.Permanent] error rolls back like any other). The inbox row's retention is
// [Config.TTL]. Safe for concurrent use.
func (m *Middleware) InboxHandler(fn TxHandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if fn == nil {
			return nil, fmt.Errorf("pgidemwatermill: message %s: InboxHandler: fn is nil: %w", msg.UUID, pgidem.ErrInvalidArgument)
		}
		consumer, id, err := m.identify(msg)
		if err != nil {
			return nil, err
		}
		var produced []*message.Message
		handled, err := m.coord.InboxHandle(msg.Context(), consumer, id, &pgidem.InboxOpts{Retention: m.config.TTL},
			func(ctx context.Context, tx pgx.Tx) error {
				var err error
				produced, err = fn(ctx, tx, msg)
				return err
			})
		if err != nil || !handled {
			return nil, err
		}
		return produced, nil
	}
}
