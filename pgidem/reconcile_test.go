package pgidem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// A holder process runs the effect (a payment at a provider that can be asked by
// idempotency key) and is SIGKILLed before it completes the record. The next call asks
// the provider through DoOpts.Reconcile, finds the payment, and completes the record with
// it: the payment was made once and fn never ran again.
func TestReconcileAfterCrash(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Lease: crashLease})
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE payment (idempotency_key text PRIMARY KEY, payment_id text NOT NULL)`)
	require.NoError(t, err)
	killCrashChild(t, startCrashChild(t, b.db.URL, 0, crashEnvEffect+"=1"))

	var asked []pgidem.Takeover
	opts := &pgidem.DoOpts{Reconcile: func(ctx context.Context, tk pgidem.Takeover) (any, bool, error) {
		asked = append(asked, tk)
		var id string
		err := b.db.Pool.QueryRow(ctx, `SELECT payment_id FROM payment WHERE idempotency_key = $1`, tk.Key).Scan(&id)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, false, nil
		}
		return id, err == nil, err
	}}
	runs := 0
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, opts, func(context.Context) (string, error) {
		runs++
		return "pay_2", nil
	})
	require.NoError(t, err)
	require.Zero(t, runs, "fn ran although the provider had the payment")
	require.Equal(t, "pay_1", res.Value)
	require.Equal(t, pgidem.OutcomeReconciled, res.Outcome)
	require.Equal(t, 2, res.Attempts)
	require.Len(t, asked, 1)
	require.Equal(t, pgidem.Takeover{Namespace: "mail", Key: "order-9.invoice", Attempt: 2, LeaseExpiredAt: asked[0].LeaseExpiredAt}, asked[0])
	require.False(t, asked[0].LeaseExpiredAt.IsZero())

	var payments int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM payment`).Scan(&payments))
	require.Equal(t, 1, payments)
	rec := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"pay_1"`, string(rec.Result))

	// Later calls replay the reconciled value without asking again.
	got, err := pgidem.Do(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, opts, func(context.Context) (string, error) { return "pay_3", nil })
	require.NoError(t, err)
	require.Equal(t, "pay_1", got)
	require.Len(t, asked, 1)
}

// Reconcile is asked only when the record shows an earlier attempt. Not found: fn runs.
// An error: the record is released, the error returned, and the next call asks again.
func TestReconcileNotFoundAndError(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	asked := 0
	answer := func(context.Context, pgidem.Takeover) (any, bool, error) { asked++; return nil, false, nil }
	opts := &pgidem.DoOpts{Reconcile: func(ctx context.Context, tk pgidem.Takeover) (any, bool, error) { return answer(ctx, tk) }}
	got, err := pgidem.Do(b.ctx, b.coord, "mail", "fresh", testTTL, opts, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, 1, got)
	require.Zero(t, asked, "a first reservation has nothing to reconcile")

	// An in-progress record whose holder's lease ran out, as a dead holder leaves it.
	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at)
		VALUES ('mail', 'dead', 'in_progress', gen_random_uuid(), 1, now() - interval '1 second', now() + interval '1 hour')`)
	require.NoError(t, err)
	answer = func(context.Context, pgidem.Takeover) (any, bool, error) {
		asked++
		return nil, false, errors.New("provider down")
	}
	runs := 0
	fn := func(context.Context) (int, error) { runs++; return 7, nil }
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "dead", testTTL, opts, fn)
	require.ErrorContains(t, err, "provider down")
	require.Equal(t, 1, asked)
	require.Zero(t, runs)

	answer = func(context.Context, pgidem.Takeover) (any, bool, error) { asked++; return nil, false, nil }
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "dead", testTTL, opts, fn)
	require.NoError(t, err)
	require.Equal(t, 2, asked, "the released record is reconciled again")
	require.Equal(t, 1, runs)
	require.Equal(t, 7, res.Value)
	require.Equal(t, 2, res.Attempts)
}
