package pgidemwatermill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgidem/pgidem/pgidem"
)

// facts is what the outcome table reads about one message's call.
type facts struct {
	namespace, key string
	outcome        pgidem.Outcome     // pgidem's outcome ([pgidem.Result.Outcome])
	err            error              // pgidem's error
	ran            bool               // the handler started
	handlerErr     error              // the handler's error
	produced       []*message.Message // what the handler returned
	replayed       []storedMessage    // the record's messages, on a replay
}

// reply answers one message: the messages the router publishes before it acks, or an
// error, on which the router nacks.
type reply func(m *Middleware, ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error)

// outcomeReplies maps the outcome of a message's call to its answer. An outcome not in it
// is answered as [pgidem.OutcomeNone] is.
var outcomeReplies = map[pgidem.Outcome]reply{
	// The handler ran: its messages, its error, or the stored failure's policy.
	pgidem.OutcomeExecuted:  afterHandler,
	pgidem.OutcomeTakenOver: afterHandler,
	pgidem.OutcomeFailOpen:  afterHandler,
	pgidem.OutcomeNotStored: afterHandler,
	pgidem.OutcomeLeaseLost: leaseLost,

	// The handler did not run: the record answers.
	pgidem.OutcomeReplayed:       replay,
	pgidem.OutcomeWaitedReplayed: replay,
	pgidem.OutcomeReconciled:     replay,
	pgidem.OutcomeStoredFailure:  storedFailure,
	pgidem.OutcomeParked:         storedFailure, // holders kept dying: like a permanent failure, until an operator forgets the record

	// The handler did not run, and nothing is known yet: nack, for a later redelivery.
	pgidem.OutcomeInProgress:          nack,
	pgidem.OutcomeFingerprintMismatch: nack,
	pgidem.OutcomeInvalid:             nack,
	pgidem.OutcomeStoreError:          nack,
	pgidem.OutcomeNone:                nack,
}

// answer answers msg by the outcome table.
func (m *Middleware) answer(ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	r, ok := outcomeReplies[f.outcome]
	if !ok {
		r = nack
	}
	return r(m, ctx, msg, f)
}

// afterHandler answers a call whose handler pgidem ran (or ran unprotected).
func afterHandler(m *Middleware, ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	var permanent *pgidem.PermanentError
	switch {
	case !f.ran:
		return nack(m, ctx, msg, f)
	case f.handlerErr == nil:
		if f.err != nil {
			// The effect ran; a redelivery would repeat it. Publish and ack.
			m.log(ctx, slog.LevelError, "pgidemwatermill: the handler succeeded but its messages were not stored; a redelivery will not publish them again", msg, f)
		}
		return f.produced, nil
	case errors.As(f.handlerErr, &permanent):
		if f.outcome == pgidem.OutcomeNotStored {
			m.log(ctx, slog.LevelError, "pgidemwatermill: the handler failed permanently and the failure was not stored; a redelivery may run it again", msg, f)
		}
		return m.failure(ctx, msg, f)
	}
	return nil, f.err // the handler's error, unchanged: the key is released
}

// leaseLost answers a call whose handler ran while another handler took its key over:
// this run's outcome was not stored. The error nacks; the redelivery replays or waits for
// the new holder's outcome.
func leaseLost(m *Middleware, ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	if f.ran {
		m.log(ctx, slog.LevelError, "pgidemwatermill: the handler's key was taken over while it ran; the effect may have run more than once", msg, f)
	}
	return nack(m, ctx, msg, f)
}

// replay answers with the messages the first run produced.
func replay(m *Middleware, ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	if f.err != nil { // the record does not decode: not a record of this middleware
		return nack(m, ctx, msg, f)
	}
	return restore(f.replayed), nil
}

// storedFailure answers a record that holds a failure instead of messages.
func storedFailure(m *Middleware, ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	if errors.Is(f.err, pgidem.ErrResultNotStorable) {
		// An earlier run succeeded; only its messages could not be stored.
		return nil, nil
	}
	return m.failure(ctx, msg, f)
}

// failure answers a permanent failure as [Config.StoredFailure] says.
func (m *Middleware) failure(ctx context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	if m.config.StoredFailure == StoredFailureError {
		return nil, wrap(msg, f.err)
	}
	m.log(ctx, slog.LevelWarn, "pgidemwatermill: the message's effect failed permanently; acked", msg, f)
	return nil, nil
}

// nack answers with pgidem's error: the handler did not run, or its outcome is not known.
func nack(_ *Middleware, _ context.Context, msg *message.Message, f facts) ([]*message.Message, error) {
	err := f.err
	if err == nil {
		err = fmt.Errorf("pgidem: no outcome (%s)", f.outcome)
	}
	return nil, wrap(msg, err)
}

// wrap prefixes err with the message's UUID.
func wrap(msg *message.Message, err error) error {
	return fmt.Errorf("pgidemwatermill: message %s: %w", msg.UUID, err)
}

// log logs one unusual answer.
func (m *Middleware) log(ctx context.Context, level slog.Level, text string, msg *message.Message, f facts) {
	m.config.Logger.Log(ctx, level, text, slog.String("namespace", f.namespace), slog.String("key", f.key),
		slog.String("message_uuid", msg.UUID), slog.String("outcome", fmt.Sprint(f.outcome)), slog.Any("error", f.err))
}
