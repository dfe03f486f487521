package pgidem_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // registers the "pgx" database/sql driver
	_ "github.com/lib/pq"              // registers the "postgres" database/sql driver
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// sqlDrivers are the database/sql drivers the SQLTx forms are tested through.
var sqlDrivers = []string{"pgx", "postgres"}

// openSQL opens a database/sql handle on the bundle's database through driver, closed at
// cleanup.
func (b *testBundle) openSQL(t *testing.T, driver string) *sql.DB {
	t.Helper()
	url := b.db.URL
	if driver == "postgres" && !strings.Contains(url, "sslmode=") { // lib/pq defaults to TLS
		sep := "?"
		if strings.Contains(url, "?") {
			sep = "&"
		}
		url += sep + "sslmode=disable"
	}
	db, err := sql.Open(driver, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func beginSQL(t *testing.T, ctx context.Context, db *sql.DB) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// sqlLedgerInsert is a DoSQLTx fn that writes one ledger row and returns its id.
func sqlLedgerInsert(ref string, runs *atomic.Int32) func(ctx context.Context, tx *sql.Tx) (int64, error) {
	return func(ctx context.Context, tx *sql.Tx) (int64, error) {
		runs.Add(1)
		var id int64
		err := tx.QueryRowContext(ctx, `INSERT INTO ledger (ref) VALUES ($1) RETURNING id`, ref).Scan(&id)
		return id, err
	}
}

// forEachSQLDriver runs test once per database/sql driver, on a fresh database with the
// ledger table.
func forEachSQLDriver(t *testing.T, test func(t *testing.T, b *testBundle, db *sql.DB)) {
	for _, driver := range sqlDrivers {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.createLedger(t)
			test(t, b, b.openSQL(t, driver))
		})
	}
}

func TestDoSQLTxCommitThenReplay(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		var runs atomic.Int32
		fn := sqlLedgerInsert("order-9", &runs)

		tx := beginSQL(t, b.ctx, db)
		first, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx, "ledger", "order-9.entry", testTTL, nil,
			func(ctx context.Context, tx *sql.Tx) (int64, error) {
				ns, key, ok := pgidem.KeyFromContext(ctx)
				require.True(t, ok)
				require.Equal(t, "ledger/order-9.entry", ns+"/"+key)
				return fn(ctx, tx)
			})
		require.NoError(t, err)
		require.Equal(t, pgidem.OutcomeExecuted, first.Outcome)
		require.Equal(t, 1, first.Attempts)
		rec, err := b.coord.LookupSQLTx(b.ctx, tx, "ledger", "order-9.entry")
		require.NoError(t, err)
		require.Equal(t, pgidem.StatusCompleted, rec.Status, "the record is in the caller's transaction")
		require.Zero(t, b.count(t), "nothing is visible before the caller commits")
		require.Zero(t, b.ledgerRows(t, "order-9"))
		require.NoError(t, tx.Commit())
		require.Equal(t, 1, b.ledgerRows(t, "order-9"), "the commit makes the effect visible")
		require.Equal(t, 1, b.count(t), "and the record")

		tx2 := beginSQL(t, b.ctx, db)
		second, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx2, "ledger", "order-9.entry", testTTL, nil, fn)
		require.NoError(t, err)
		require.Equal(t, pgidem.OutcomeReplayed, second.Outcome)
		require.Equal(t, first.Value, second.Value)
		require.NoError(t, tx2.Commit())

		// The pgx forms share the record.
		value, err := pgidem.DoInTx(b.ctx, b.coord, "ledger", "order-9.entry", testTTL, nil,
			func(context.Context, pgx.Tx) (int64, error) { runs.Add(1); return 0, nil })
		require.NoError(t, err)
		require.Equal(t, first.Value, value)
		require.EqualValues(t, 1, runs.Load())
		require.Equal(t, 1, b.ledgerRows(t, "order-9"))
	})
}

func TestDoSQLTxRollbackLeavesNothing(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		var runs atomic.Int32
		fn := sqlLedgerInsert("order-1", &runs)

		tx := beginSQL(t, b.ctx, db)
		_, err := pgidem.DoSQLTx(b.ctx, b.coord, tx, "ledger", "order-1.entry", testTTL, nil, fn)
		require.NoError(t, err)
		require.NoError(t, tx.Rollback())
		require.Zero(t, b.count(t), "a rollback leaves no record")
		require.Zero(t, b.ledgerRows(t, "order-1"), "and no effect")

		tx2 := beginSQL(t, b.ctx, db)
		res, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx2, "ledger", "order-1.entry", testTTL, nil, fn)
		require.NoError(t, err)
		require.Equal(t, pgidem.OutcomeExecuted, res.Outcome)
		require.NoError(t, tx2.Commit())
		require.EqualValues(t, 2, runs.Load(), "the next delivery runs fn again")
		require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	})
}

func TestDoSQLTxPermanentFailureStored(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		var runs atomic.Int32
		errDeclined := errors.New("card declined")
		fn := func(ctx context.Context, tx *sql.Tx) (int64, error) {
			if _, err := sqlLedgerInsert("order-3", &runs)(ctx, tx); err != nil {
				return 0, err
			}
			return 0, pgidem.Permanent(errDeclined)
		}

		tx := beginSQL(t, b.ctx, db)
		_, err := pgidem.DoSQLTx(b.ctx, b.coord, tx, "ledger", "order-3.entry", testTTL, nil, fn)
		require.ErrorIs(t, err, errDeclined)
		var one int
		require.NoError(t, tx.QueryRowContext(b.ctx, `SELECT 1`).Scan(&one), "tx stays usable")
		require.NoError(t, tx.Commit())
		require.Zero(t, b.ledgerRows(t, "order-3"), "fn's writes are undone")
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "ledger", "order-3.entry").Status)

		tx2 := beginSQL(t, b.ctx, db)
		res, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx2, "ledger", "order-3.entry", testTTL, nil, fn)
		var stored *pgidem.StoredFailureError
		require.ErrorAs(t, err, &stored)
		require.ErrorIs(t, err, pgidem.ErrPermanent)
		require.Equal(t, "card declined", stored.Message)
		require.Equal(t, pgidem.OutcomeStoredFailure, res.Outcome)
		require.EqualValues(t, 1, runs.Load(), "the stored failure replays without running fn")
	})
}

func TestDoSQLTxConcurrentRunsFnOnce(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		var runs atomic.Int32
		fn := sqlLedgerInsert("order-16", &runs)
		const n = 8
		results := make([]pgidem.Result[int64], n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				tx, err := db.BeginTx(b.ctx, nil)
				if err != nil {
					errs[i] = err
					return
				}
				defer tx.Rollback() //nolint:errcheck // after Commit it is a no-op
				results[i], errs[i] = pgidem.DoSQLTxResult(b.ctx, b.coord, tx, "ledger", "order-16.entry", testTTL, nil, fn)
				if errs[i] == nil {
					errs[i] = tx.Commit()
				}
			})
		}
		wg.Wait()

		replays := 0
		for i := range n {
			require.NoError(t, errs[i], "caller %d", i)
			require.Equal(t, results[0].Value, results[i].Value, "caller %d", i)
			if results[i].Replayed {
				replays++
			}
		}
		require.EqualValues(t, 1, runs.Load(), "fn runs exactly once")
		require.Equal(t, n-1, replays, "every other caller replays")
		require.Equal(t, 1, b.ledgerRows(t, "order-16"))
	})
}

func TestDoSQLTxLockWait(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		var runs atomic.Int32
		fn := sqlLedgerInsert("order-5", &runs)
		holder := beginSQL(t, b.ctx, db)
		_, err := pgidem.DoSQLTx(b.ctx, b.coord, holder, "ledger", "order-5.entry", testTTL, nil, fn)
		require.NoError(t, err)

		// Raise refuses at once; Wait runs out its budget on the lock (the driver's lock
		// timeout error is read as such) and leaves tx usable.
		tx := beginSQL(t, b.ctx, db)
		res, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx, "ledger", "order-5.entry", testTTL,
			&pgidem.DoOpts{InFlight: pgidem.InFlightRaise}, fn)
		require.ErrorIs(t, err, pgidem.ErrInProgress)
		require.Equal(t, pgidem.OutcomeInProgress, res.Outcome)
		_, err = pgidem.DoSQLTx(b.ctx, b.coord, tx, "ledger", "order-5.entry", testTTL,
			&pgidem.DoOpts{WaitTimeout: 20 * time.Millisecond}, fn)
		var ip *pgidem.InProgressError
		require.ErrorAs(t, err, &ip)
		require.True(t, ip.Waited)
		var one int
		require.NoError(t, tx.QueryRowContext(b.ctx, `SELECT 1`).Scan(&one), "tx stays usable")

		// A waiter blocked on the lock replays once the holder commits.
		done := make(chan pgidem.Result[int64], 1)
		go func() {
			res, err := pgidem.DoSQLTxResult(b.ctx, b.coord, tx, "ledger", "order-5.entry", testTTL, nil, fn)
			if err != nil {
				res.Outcome = pgidem.Outcome(err.Error())
			}
			done <- res
		}()
		b.waitForBlocked(t, "advisory", 1)
		require.NoError(t, holder.Commit())
		res = <-done
		require.Equal(t, pgidem.OutcomeWaitedReplayed, res.Outcome)
		require.EqualValues(t, 1, runs.Load())
	})
}

func TestDoSQLTxUnusableTransaction(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		fn := func(context.Context, *sql.Tx) (int, error) { return 1, nil }

		aborted := beginSQL(t, b.ctx, db)
		_, err := aborted.ExecContext(b.ctx, `SELECT 1/0`)
		require.Error(t, err)
		res, err := pgidem.DoSQLTxResult(b.ctx, b.coord, aborted, "ns", "k", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "an aborted transaction is the caller's mistake: %v", err)
		require.Equal(t, pgidem.OutcomeInvalid, res.Outcome)

		done := beginSQL(t, b.ctx, db)
		require.NoError(t, done.Commit())
		_, err = pgidem.DoSQLTx(b.ctx, b.coord, done, "ns", "k", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		_, err = b.coord.InboxRecordSQLTx(b.ctx, done, "billing", "msg-1", nil)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

		readOnly, err := db.BeginTx(b.ctx, &sql.TxOptions{ReadOnly: true})
		require.NoError(t, err)
		defer readOnly.Rollback() //nolint:errcheck // test cleanup
		_, err = pgidem.DoSQLTx(b.ctx, b.coord, readOnly, "ns", "k", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)

		ended := beginSQL(t, b.ctx, db)
		_, err = pgidem.DoSQLTx(b.ctx, b.coord, ended, "ns", "k", testTTL, nil,
			func(_ context.Context, tx *sql.Tx) (int, error) { return 1, tx.Commit() })
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "fn must not end the transaction")
		require.Zero(t, b.count(t))

		_, err = pgidem.DoSQLTx(b.ctx, b.coord, nil, "ns", "k", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		_, err = b.coord.LookupSQLTx(b.ctx, nil, "ns", "k")
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	})
}

func TestInboxRecordSQLTx(t *testing.T) {
	t.Parallel()
	forEachSQLDriver(t, func(t *testing.T, b *testBundle, db *sql.DB) {
		tx := beginSQL(t, b.ctx, db)
		isNew, err := b.coord.InboxRecordSQLTx(b.ctx, tx, "billing", "msg-1", &pgidem.InboxOpts{Payload: []byte(`{"order":9}`)})
		require.NoError(t, err)
		require.True(t, isNew)
		require.NoError(t, tx.Rollback())

		tx = beginSQL(t, b.ctx, db)
		isNew, err = b.coord.InboxRecordSQLTx(b.ctx, tx, "billing", "msg-1", nil)
		require.NoError(t, err)
		require.True(t, isNew, "a rolled-back delivery is handled again")
		require.NoError(t, tx.Commit())

		tx = beginSQL(t, b.ctx, db)
		isNew, err = b.coord.InboxRecordSQLTx(b.ctx, tx, "billing", "msg-1", nil)
		require.NoError(t, err)
		require.False(t, isNew, "a committed message is a duplicate")
		_, err = b.coord.LookupSQLTx(b.ctx, tx, "billing", "msg-1")
		require.ErrorIs(t, err, pgidem.ErrNotFound, "inbox rows are not records")
	})
}
