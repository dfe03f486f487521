package protocol

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/pgidem/pgidem/internal/store"
)

// ParkedError reports a record parked at the attempts cap: its holders kept dying until
// its attempts reached [Config.MaxAttempts] (or [DoOpts.MaxAttempts]), so it is not taken
// over and fn is not run again. Every call for the key returns it until an operator
// forgets the record ([Engine.Forget], `pgidem records forget`) or the record expires. It
// matches [ErrParked].
type ParkedError struct {
	// Namespace and Key identify the record.
	Namespace, Key string
	// Attempts is the record's attempt count: how many holders started the effect. It
	// may have run that many times, or never finished at all.
	Attempts int
}

// Error returns the message, prefixed "pgidem: ".
func (e *ParkedError) Error() string {
	return fmt.Sprintf("pgidem: idempotency key parked: %s/%s was started %d times by holders that died; "+
		"it is not run again until the record is forgotten", e.Namespace, e.Key, e.Attempts)
}

// Is reports whether target is [ErrParked].
func (e *ParkedError) Is(target error) bool { return target == ErrParked }

// ErrParked means the key's record is parked: holders that died took it over until its
// attempts reached the cap ([Config.MaxAttempts]), so fn is not run again. See
// [*ParkedError].
var ErrParked = errors.New("pgidem: idempotency key parked")

// Parked returns the error a parked record r of (namespace, key) replays as.
func Parked(namespace, key string, r *store.Row) error {
	return &ParkedError{Namespace: namespace, Key: key, Attempts: r.Attempts}
}

// parkRecord parks r (its holder died at cl's attempts cap, [store.Row.AtCap]) in a
// statement of its own, bounded like the probe. parked is false when the record changed
// since r was read (the caller reads it again); when true, r is the parked row.
func (c *Engine) parkRecord(ctx context.Context, cl *Call, r *store.Row) (parked bool, err error) {
	pctx, cancel := context.WithTimeout(ctx, c.config.FinishTimeout)
	defer cancel()
	conn, err := c.poolConn(pctx)
	if err == nil {
		defer conn.Release()
		parked, err = c.park(pctx, conn, cl, r)
	}
	switch {
	case store.IsSerializationFailure(err): // a stricter default isolation: read it again
		return false, nil
	case err != nil:
		return false, c.logStoreError(ctx, cl, store.Wrap("park", err))
	}
	return parked, nil
}

// park runs the park statement for r on db: owner-conditional on r's dead holder, so it
// matches nothing when another caller took the record over (or parked it) first. It
// returns the driver's error.
func (c *Engine) park(ctx context.Context, db store.RowQuerier, cl *Call, r *store.Row) (bool, error) {
	var p store.Row
	err := db.QueryRow(ctx, c.sql.Park, cl.namespace, cl.key, r.Owner, cl.maxAttempts).Scan(p.ScanTargets(false)...)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	*r = p
	c.config.Logger.WarnContext(ctx, "pgidem: record parked at the attempts cap; its effect is not run again until it is forgotten",
		slog.String("namespace", cl.namespace), slog.String("key", cl.key), slog.Int("attempts", p.Attempts),
		slog.Int("max_attempts", cl.maxAttempts))
	c.emit(ctx, EventParked, cl.namespace, 1)
	return true, nil
}

// parkTx parks r in tx (DoTx): the park commits with tx. done is true when DoTx returns:
// with err, or with the parked record reported in res (OutcomeParked). false means the
// record changed since it was read: read it again.
func (c *Engine) parkTx(ctx context.Context, tx Tx, cl *Call, r *store.Row, res *Report) (done bool, err error) {
	parked, err := c.park(ctx, tx, cl, r)
	if err != nil {
		return true, c.logStoreError(ctx, cl, store.Wrap("park", err))
	}
	if parked {
		res.Row, res.Attempts, res.Outcome = *r, r.Attempts, OutcomeParked
	}
	return parked, nil
}
