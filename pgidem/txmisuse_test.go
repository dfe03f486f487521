package pgidem_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// eventLog collects the kinds of the events a coordinator's hook receives.
type eventLog struct {
	mu    sync.Mutex
	kinds []pgidem.EventKind
}

func (l *eventLog) hook() pgidem.Hook {
	return pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.kinds = append(l.kinds, e.Kind)
	})
}

func (l *eventLog) has(kind pgidem.EventKind) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range l.kinds {
		if k == kind {
			return true
		}
	}
	return false
}

// A commit of InboxHandle's or DoInTx's transaction that fails by fn's doing is fn's error,
// not the store's: a deferred constraint fn's writes broke (refused again on every
// delivery, so a consumer retrying store errors would loop on the message), or fn ending
// the transaction itself. Neither is a *StoreError, logged or counted as one.
func TestCommitRefusedByFnIsNotAStoreError(t *testing.T) {
	t.Parallel()
	var events eventLog
	b := setup(t, &pgidem.Config{Hook: events.hook()})
	_, err := b.db.Pool.Exec(b.ctx, `CREATE TABLE parent (id int PRIMARY KEY);
		CREATE TABLE ledger (id int PRIMARY KEY, parent int REFERENCES parent DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	orphan := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES (1, 42)`) // no parent 42: refused at commit
		return err
	}

	t.Run("InboxDeferredConstraint", func(t *testing.T) {
		handled, err := b.coord.InboxHandle(b.ctx, "billing", "m-1", nil, orphan)
		require.False(t, handled)
		requireRefusedByConstraint(t, err)
		require.Zero(t, countRows(t, b, `SELECT count(*) FROM pgidem_inbox`), "nothing was committed")
	})
	t.Run("DoInTxDeferredConstraint", func(t *testing.T) {
		_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k-1", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 1, orphan(ctx, tx)
		})
		requireRefusedByConstraint(t, err)
		require.Zero(t, countRows(t, b, `SELECT count(*) FROM pgidem_record`), "nothing was committed")
	})
	t.Run("InboxFnCommits", func(t *testing.T) {
		handled, err := b.coord.InboxHandle(b.ctx, "billing", "m-2", nil, func(ctx context.Context, tx pgx.Tx) error {
			return tx.Commit(ctx)
		})
		require.False(t, handled)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.Contains(t, err.Error(), "fn ended the transaction")
		require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM pgidem_inbox WHERE message_id = 'm-2'`),
			"fn's commit committed the inbox row: a redelivery is skipped")
	})
	t.Run("DoInTxFnRollsBack", func(t *testing.T) {
		_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k-2", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 1, tx.Rollback(ctx)
		})
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	})
	require.False(t, events.has(pgidem.EventStoreError), "fn's doing is not counted as a store error")
}

func requireRefusedByConstraint(t *testing.T, err error) {
	t.Helper()
	require.Error(t, err)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23503", pgErr.Code)
	require.Contains(t, err.Error(), "deferred constraint")
}

func countRows(t *testing.T, b *testBundle, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, sql).Scan(&n))
	return n
}

// A caller's transaction that cannot take the inbox row or DoTx's lock — already ended,
// aborted by an earlier failed statement, or read-only — is the caller's mistake, reported
// as ErrInvalidArgument with what is wrong, not as an unreachable store.
func TestUnusableTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, state := range []string{"Committed", "Aborted", "ReadOnly"} {
		t.Run(state, func(t *testing.T) {
			for _, call := range []string{"InboxRecordTx", "DoTx"} {
				opts := pgx.TxOptions{}
				if state == "ReadOnly" {
					opts.AccessMode = pgx.ReadOnly
				}
				tx, err := b.db.Pool.BeginTx(b.ctx, opts)
				require.NoError(t, err)
				switch state {
				case "Committed":
					require.NoError(t, tx.Commit(b.ctx))
				case "Aborted":
					_, err := tx.Exec(b.ctx, `SELECT 1/0`)
					require.Error(t, err)
				}
				if call == "InboxRecordTx" {
					_, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-"+state, nil)
				} else {
					_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k-"+state, testTTL, nil,
						func(context.Context, pgx.Tx) (int, error) { return 0, errors.New("fn must not run") })
				}
				require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "%s: %v", call, err)
				require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, call)
				_ = tx.Rollback(b.ctx)
			}
		})
	}
}
