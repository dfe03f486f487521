package pgidem_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// A commit of InboxHandle's or DoInTx's transaction that fails by fn's doing is fn's error,
// not the store's: a deferred constraint fn's writes broke (refused again on every
// delivery, so a consumer retrying store errors would loop on the message), or fn ending
// the transaction itself. Neither is a *StoreError, logged or counted as one.
func TestCommitRefusedByFnIsNotAStoreError(t *testing.T) {
	t.Parallel()
	var o transitionObserver
	b := setup(t, o.config(pgidem.Config{}))
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
	// fn commits and then fails: its error alone would read as "rolled back, run again",
	// while the commit kept the inbox row and the redelivery is skipped.
	t.Run("InboxFnCommitsThenFails", func(t *testing.T) {
		fnErr := errors.New("mail step failed after commit")
		handled, err := b.coord.InboxHandle(b.ctx, "billing", "m-3", nil, func(ctx context.Context, tx pgx.Tx) error {
			if err := tx.Commit(ctx); err != nil {
				return err
			}
			return fnErr
		})
		require.False(t, handled)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.ErrorIs(t, err, fnErr, "fn's own error is kept")
		require.Contains(t, err.Error(), "fn ended the transaction")
		require.Equal(t, 1, countRows(t, b, `SELECT count(*) FROM pgidem_inbox WHERE message_id = 'm-3'`))
	})
	t.Run("DoInTxFnRollsBack", func(t *testing.T) {
		_, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "k-2", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
			return 1, tx.Rollback(ctx)
		})
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	})
	for _, namespace := range []string{"billing", "ledger"} {
		require.Zero(t, o.count(namespace, pgidem.EventStoreError), "fn's doing is not counted as a store error")
	}
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

// A caller's transaction that cannot take the inbox row or DoTx's lock — already ended or
// aborted by an earlier failed statement — is the caller's mistake, reported as
// ErrInvalidArgument with what is wrong, not as an unreachable store. A read-only one is
// refused by the server as a store error from InboxRecordTx (a server that refuses writes
// says the same), and as ErrInvalidArgument from DoTx, which checks before it writes.
func TestUnusableTransaction(t *testing.T) {
	t.Parallel()
	var o transitionObserver
	b := setup(t, o.config(pgidem.Config{}))
	for _, state := range []string{"Committed", "Aborted", "ReadOnly"} {
		for _, call := range []string{"InboxRecordTx", "DoTx"} {
			t.Run(state+"/"+call, func(t *testing.T) { // one after another: each counts the store errors it caused
				storeErrors := func() int {
					return o.count("billing", pgidem.EventStoreError) + o.count("ledger", pgidem.EventStoreError)
				}
				before := storeErrors()
				opts := pgx.TxOptions{}
				if state == "ReadOnly" {
					opts.AccessMode = pgx.ReadOnly
				}
				tx, err := b.db.Pool.BeginTx(b.ctx, opts)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(b.ctx) }()
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
				if state == "ReadOnly" && call == "InboxRecordTx" {
					require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
					return
				}
				require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "%v", err)
				require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
				require.Equal(t, before, storeErrors(), "the caller's mistake is not counted as a store error")
			})
		}
	}
}

// InboxHandle, DoInTx and Sweep begin their transactions READ WRITE: on a pool whose
// sessions default to read-only transactions they still record, instead of reporting a
// read-only transaction or a store error.
func TestOwnTransactionsAreReadWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	})
	coord := b.newCoordOn(t, pool, nil)
	handled, err := coord.InboxHandle(b.ctx, "billing", "m-1", nil, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.True(t, handled)
	v, err := pgidem.DoInTx(b.ctx, coord, "ledger", "k-1", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 7, nil })
	require.NoError(t, err)
	require.Equal(t, 7, v)
	_, err = coord.Sweep(b.ctx, nil)
	require.NoError(t, err, "the sweep's batches are READ WRITE too")
}

// A DoTx fn that ends the transaction it was given is refused whatever it returns: a
// Permanent error is not reported as a store failure, an ordinary one does not claim fn's
// writes were undone (a release merged them into tx), and nothing is recorded.
func TestDoTxFnEndingItsTxIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	declined := errors.New("declined")
	for _, end := range []string{"Commit", "Rollback"} {
		for _, returned := range []error{nil, declined, pgidem.Permanent(declined)} {
			t.Run(fmt.Sprintf("%s/%v", end, returned), func(t *testing.T) {
				key := fmt.Sprintf("%s-%v", end, returned)
				tx := b.begin(t)
				_, err := pgidem.DoTx(b.ctx, b.coord, tx, "ledger", key, testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
					if end == "Commit" {
						return 0, errors.Join(tx.Commit(ctx), returned)
					}
					return 0, errors.Join(tx.Rollback(ctx), returned)
				})
				require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "%v", err)
				require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
				require.Contains(t, err.Error(), "roll tx back")
				if returned != nil {
					require.ErrorIs(t, err, declined, "fn's own error is kept")
				}
				require.NoError(t, tx.Rollback(b.ctx))
				_, err = b.coord.Lookup(b.ctx, "ledger", key)
				require.ErrorIs(t, err, pgidem.ErrNotFound, "nothing was recorded")
			})
		}
	}
}
