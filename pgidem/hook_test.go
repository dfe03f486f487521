package pgidem_test

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
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

// Every unusual transition is logged and counted. A takeover of a dead holder, by Do or
// DoTx, emits EventTakenOver and logs at warn; a fingerprint mismatch, by Do or DoTx, emits
// EventFingerprintMismatch and logs at warn; a lease lost by the time the result is stored
// emits EventLeaseLost and logs at error.
func TestUnusualTransitionsObserved(t *testing.T) {
	t.Parallel()

	t.Run("TakeoverDo", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var o transitionObserver
		coord := b.newCoord(t, o.config(pgidem.Config{}))
		b.insertDeadHolder(t, "do", "k", nil)
		res, err := pgidem.DoResult(b.ctx, coord, "do", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.True(t, res.TookOver)
		require.Contains(t, o.kinds("do"), pgidem.EventTakenOver)
		o.requireLogged(t, slog.LevelWarn, "do", "k", "took over")
	})

	t.Run("TakeoverDoTx", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var o transitionObserver
		coord := b.newCoord(t, o.config(pgidem.Config{}))
		b.insertDeadHolder(t, "dotx", "k", nil)
		res, err := pgidem.DoInTxResult(b.ctx, coord, "dotx", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.True(t, res.TookOver)
		require.Contains(t, o.kinds("dotx"), pgidem.EventTakenOver)
		o.requireLogged(t, slog.LevelWarn, "dotx", "k", "took over")
	})

	t.Run("FingerprintMismatch", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var o transitionObserver
		coord := b.newCoord(t, o.config(pgidem.Config{}))
		_, err := pgidem.Do(b.ctx, coord, "fp", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("A")},
			func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)

		_, err = pgidem.Do(b.ctx, coord, "fp", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("B")},
			func(context.Context) (int, error) { return 2, nil })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		require.Equal(t, 1, o.count("fp", pgidem.EventFingerprintMismatch))
		require.Len(t, o.loggedContaining(t, slog.LevelWarn, "fp", "k", "fingerprint mismatch"), 1)

		_, err = pgidem.DoInTx(b.ctx, coord, "fp", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte("B")},
			func(context.Context, pgx.Tx) (int, error) { return 2, nil })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		require.Equal(t, 2, o.count("fp", pgidem.EventFingerprintMismatch), "DoTx's mismatch is counted too")
		require.Len(t, o.loggedContaining(t, slog.LevelWarn, "fp", "k", "fingerprint mismatch"), 2, "DoTx's mismatch is logged too")
	})

	for _, maxBatch := range []int{1, 64} {
		t.Run(fmt.Sprint("LeaseLostOnCompletion/MaxBatch", maxBatch), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			var o transitionObserver
			coord := b.newCoord(t, o.config(pgidem.Config{MaxBatch: maxBatch}))
			res, err := pgidem.DoResult(b.ctx, coord, "lost", "k", testTTL, nil, func(ctx context.Context) (string, error) {
				// Another holder took the reservation over while this one was stalled.
				_, err := b.db.Pool.Exec(ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = attempts + 1`)
				return "sent", err
			})
			require.ErrorIs(t, err, pgidem.ErrLeaseLost)
			require.Equal(t, "sent", res.Value)
			require.True(t, res.LeaseLost)
			require.Contains(t, o.kinds("lost"), pgidem.EventLeaseLost)
			o.requireLogged(t, slog.LevelError, "lost", "k", "lease lost")
		})
	}
}

func TestInvalidNamespaceIsNotAnEventAttribute(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var namespaces []string
	var mu sync.Mutex
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		require.Equal(t, pgidem.EventInvalidKey, e.Kind)
		mu.Lock()
		defer mu.Unlock()
		namespaces = append(namespaces, e.Namespace)
	})})
	fn := func(context.Context) (int, error) { return 1, nil }
	txFn := func(context.Context, pgx.Tx) (int, error) { return 1, nil }
	long := strings.Repeat("n", 1<<16)
	for _, ns := range []string{"bad\x00ns", "\xff\xfe", long} {
		_, err := pgidem.Do(b.ctx, coord, ns, "k", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
		_, err = pgidem.DoInTx(b.ctx, coord, ns, "k", testTTL, nil, txFn)
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
		_, err = coord.InboxHandle(b.ctx, ns, "m", nil, func(context.Context, pgx.Tx) error { return nil })
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
	}
	// A valid namespace with an invalid key keeps its namespace.
	_, err := pgidem.Do(b.ctx, coord, "mail", "", testTTL, nil, fn)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, append(slices.Repeat([]string{""}, 9), "mail"), namespaces)
}

// A call reports exactly one outcome event (Executed, Replayed, InProgress, InvalidKey,
// StoreError, FingerprintMismatch); a fingerprint mismatch reports its own.
func TestHookOneOutcome(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var mu sync.Mutex
	var events []pgidem.EventKind
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		mu.Lock()
		events = append(events, e.Kind)
		mu.Unlock()
	})})
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{1}}, returnOne)
	require.NoError(t, err)
	mu.Lock()
	events = nil
	mu.Unlock()
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{2}}, returnOne)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	outcomes := map[pgidem.EventKind]bool{pgidem.EventExecuted: true, pgidem.EventReplayed: true,
		pgidem.EventInProgress: true, pgidem.EventInvalidKey: true, pgidem.EventStoreError: true,
		pgidem.EventFingerprintMismatch: true}
	n := 0
	mu.Lock()
	defer mu.Unlock()
	for _, e := range events {
		if outcomes[e] {
			n++
		}
	}
	require.Equal(t, 1, n, "events: %v", events)
}
