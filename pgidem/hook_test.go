package pgidem_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// A Hook that panics on every event does not cut the protocol short: each call below
// reaches the end it would reach without a Hook (fn run once, the record completed, the
// replay and the takeover as usual), and each panic is logged.
func TestHookPanicIsContained(t *testing.T) {
	t.Parallel()
	obs := &transitionObserver{}
	cfg := obs.config(pgidem.Config{})
	record := cfg.Hook
	cfg.Hook = pgidem.HookFunc(func(ctx context.Context, e pgidem.Event) {
		record.OnEvent(ctx, e)
		panic("metrics exporter bug")
	})
	b := setup(t, cfg)
	runs := 0
	fn := func(context.Context) (string, error) { runs++; return "sent", nil }
	for range 2 {
		var v string
		var err error
		require.NotPanics(t, func() { v, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, fn) })
		require.NoError(t, err)
		require.Equal(t, "sent", v)
	}
	require.Equal(t, 1, runs, "the second call replays")

	// A takeover reports TakenOver between reserving and running fn.
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
		VALUES ('mail', 'dead', 'in_progress', gen_random_uuid(), now() - interval '1 second', now() + interval '1 hour')`)
	require.NoError(t, err)
	var res pgidem.Result[string]
	require.NotPanics(t, func() { res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "dead", testTTL, nil, fn) })
	require.NoError(t, err)
	require.True(t, res.TookOver)
	rec, err := b.coord.Lookup(b.ctx, "mail", "dead")
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status)

	require.NotPanics(t, func() {
		_, err = pgidem.DoInTx(b.ctx, b.coord, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	})
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)

	events := append(obs.kinds("mail"), obs.kinds("ledger")...)
	require.Contains(t, events, pgidem.EventExecuted)
	require.Contains(t, events, pgidem.EventReplayed)
	require.Contains(t, events, pgidem.EventTakenOver)
	require.Contains(t, events, pgidem.EventInvalidKey)
	require.Contains(t, obs.logText(), "Hook.OnEvent panicked")
}
