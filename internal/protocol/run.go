package protocol

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/pgidem/pgidem/internal/store"
)

// run executes fn under the held reservation with a heartbeat, then finishes the record.
// encode is called after fn succeeded to produce the JSON result.
//
// The finishing write is always attempted, even when the heartbeat gave up on the lease: a
// failed renewal only means the lease may be lost, and only an owner-conditional write that
// matches no row proves it. Completing a record that nobody took over is what keeps the
// effect from running again.
func (c *Engine) run(ctx context.Context, cl *Call, owner pgtype.UUID, leaseFrom time.Time, fn func(context.Context) error, encode func() ([]byte, error)) error {
	fnCtx := withFence(withKey(ctx, c.config.Schema, cl.namespace, cl.key, false), Fence{Attempt: cl.attempt, Owner: owner.String()})
	fnCtx, cancel := context.WithCancelCause(fnCtx)
	defer cancel(nil)
	hb := c.startHeartbeat(ctx, cl, owner, leaseFrom, cancel)
	defer hb.stop()

	finished := false
	defer func() {
		if !finished { // fn panicked (or called runtime.Goexit): release, let the panic continue
			hb.stop()
			if c.finish(ctx, cl, owner, "release", c.sql.Release) == errFinishNoRow {
				c.leaseLost(ctx, cl) // a store error is logged by finish
			}
		}
	}()
	fnErr := fn(fnCtx)
	finished = true
	// The heartbeat keeps renewing the lease until the finishing write is done: that write
	// may queue behind other calls' rounds, and the lease must not run out meanwhile.
	hb.finishing()

	if fnErr != nil {
		return c.finishFailed(ctx, cl, owner, hb, fnErr)
	}

	result, panicked, encErr := encodeResult(encode)
	var finishErr error
	if encErr == nil {
		finishErr = c.complete(ctx, cl, owner, store.StatusCompleted, result, nil)
		var pgErr *pgconn.PgError
		if errors.As(finishErr, &pgErr) && store.IsValueRefused(finishErr) {
			// jsonb refused the value (an unpaired surrogate in a json.RawMessage, a number
			// out of numeric's range, nesting deeper than it parses): as unstorable as a NUL.
			encErr = fmt.Errorf("the database rejected it: %s", pgErr.Message)
		}
	}
	if encErr != nil {
		// The effect happened; never release (that would run it again). Store the failure.
		c.config.Logger.ErrorContext(ctx, "pgidem: result not storable; record completed without it",
			slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.String("error", encErr.Error()))
		failure, _ := json.Marshal(store.StoredFailure{Message: storableMessage("pgidem: result not storable: " + encErr.Error()), NotStorable: true})
		finishErr = c.complete(ctx, cl, owner, store.StatusFailed, nil, failure)
	}
	if panicked != nil {
		if finishErr == errFinishNoRow {
			c.leaseLost(ctx, cl)
		}
		panic(panicked) // a MarshalJSON panic is a bug in the caller's type; the record is stored
	}
	switch {
	case finishErr == errFinishNoRow:
		c.leaseLost(ctx, cl)
		return fmt.Errorf("%w: %s/%s was taken over before the result was stored; the effect may have run more than once", ErrLeaseLost, cl.namespace, cl.key)
	case finishErr != nil:
		return finishErr
	case encErr != nil:
		cl.notStored = true
		return fmt.Errorf("%w: %v", ErrResultNotStorable, encErr)
	}
	return nil
}

// finishFailed finishes cl's reservation after fn returned fnErr: a [Permanent] failure is
// stored for replay; any other error releases the key so a later delivery runs fn again.
// It returns fnErr, or a [*FailureNotStoredError] when a permanent failure could not be
// stored.
func (c *Engine) finishFailed(ctx context.Context, cl *Call, owner pgtype.UUID, hb *heartbeat, fnErr error) error {
	var permanent *PermanentError
	var err error
	isPermanent := errors.As(fnErr, &permanent) // permanent may be a typed nil
	if isPermanent {
		failure, _ := json.Marshal(store.StoredFailure{Message: storableMessage(permanent.Error())})
		err = c.complete(ctx, cl, owner, store.StatusFailed, nil, failure)
	} else {
		// A release is never queued, so it needs no heartbeat cover; a renewal after it
		// would revive the lease of a kept (taken-over) row.
		hb.stop()
		err = c.finish(ctx, cl, owner, "release", c.sql.Release)
	}
	if err == errFinishNoRow {
		c.leaseLost(ctx, cl)
		err = fmt.Errorf("%w: %s/%s was taken over", ErrLeaseLost, cl.namespace, cl.key)
	}
	if err != nil && isPermanent {
		// The caller must not believe the failure will be replayed: a later call takes
		// the key over once the lease ends and runs fn again.
		cl.notStored = true
		return &FailureNotStoredError{Err: fnErr, Cause: err}
	}
	return fnErr // a release that failed leaves the lease to end: fn runs again then
}

// maxStoredMessageBytes caps the message of a stored failure: a record holds the failure
// to replay it, not a log; jsonb refuses strings over 256 MiB outright.
const maxStoredMessageBytes = 64 << 10

// storableMessage makes an error message storable in jsonb: NUL characters (which jsonb
// refuses) are written as the two characters \0, and a message over
// maxStoredMessageBytes is cut at a character boundary and marked. Invalid UTF-8 becomes
// U+FFFD through encoding/json, which jsonb accepts.
func storableMessage(msg string) string {
	msg = strings.ReplaceAll(msg, "\x00", `\0`)
	if len(msg) <= maxStoredMessageBytes {
		return msg
	}
	const mark = " … (truncated)"
	cut := maxStoredMessageBytes - len(mark)
	for cut > 0 && !utf8.RuneStart(msg[cut]) {
		cut--
	}
	return msg[:cut] + mark
}

// encodeResult runs encode, turning a panic into an error (and returning the panic value so
// the caller can re-raise it once the record is safe).
func encodeResult(encode func() ([]byte, error)) (result []byte, panicked any, err error) {
	defer func() {
		if p := recover(); p != nil {
			result, panicked, err = nil, p, fmt.Errorf("encoding the result panicked: %v", p)
		}
	}()
	result, err = encode()
	return result, nil, err
}
