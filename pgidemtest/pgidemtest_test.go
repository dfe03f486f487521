package pgidemtest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
	"github.com/pgidem/pgidem/pgidemtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// recorder is a pgidemtest.TestingT that keeps what the helpers report instead of failing
// the test running them.
type recorder struct {
	errors []string
	failed bool
}

func (r *recorder) Errorf(format string, args ...any) {
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
func (r *recorder) FailNow() { r.failed = true }
func (r *recorder) Helper()  {}

// requirePasses runs check against a fresh recorder and fails t if it reported anything.
func requirePasses(t *testing.T, check func(tb pgidemtest.TestingT)) {
	t.Helper()
	r := &recorder{}
	check(r)
	require.False(t, r.failed, "the helper failed: %v", r.errors)
	require.Empty(t, r.errors)
}

// requireFails runs check against a fresh recorder and fails t unless it failed with one
// message containing each of wants.
func requireFails(t *testing.T, check func(tb pgidemtest.TestingT), wants ...string) {
	t.Helper()
	r := &recorder{}
	check(r)
	require.True(t, r.failed, "the helper passed")
	require.Len(t, r.errors, 1)
	for _, want := range wants {
		require.Contains(t, r.errors[0], want)
	}
}

type testBundle struct {
	ctx   context.Context
	db    *testdb.DB
	coord *pgidem.Coordinator
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	db := testdb.New(t)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	require.NoError(t, err)
	return &testBundle{ctx: context.Background(), db: db, coord: coord}
}

type receipt struct {
	ID    string `json:"id"`
	Lines []int  `json:"lines"`
}

func TestRequireCompleted(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "order-9.invoice", time.Hour, nil, func(context.Context) (receipt, error) {
		return receipt{ID: "em_1", Lines: []int{1, 2}}, nil
	})
	require.NoError(t, err)

	t.Run("Passes", func(t *testing.T) {
		t.Parallel()
		var rec *pgidem.Record
		requirePasses(t, func(tb pgidemtest.TestingT) {
			rec = pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice", nil)
		})
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		require.Equal(t, "order-9.invoice", rec.Key)
	})
	t.Run("ResultAsJSONValue", func(t *testing.T) {
		t.Parallel()
		for _, want := range []any{
			receipt{ID: "em_1", Lines: []int{1, 2}},
			map[string]any{"lines": []float64{1.0, 2.0}, "id": "em_1"},
			json.RawMessage(`{ "lines": [1e0, 2.00], "id": "em_1" }`),
		} {
			requirePasses(t, func(tb pgidemtest.TestingT) {
				pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice",
					&pgidemtest.RequireOpts{Attempts: 1, Result: want})
			})
		}
	})
	t.Run("WrongResult", func(t *testing.T) {
		t.Parallel()
		requireFails(t, func(tb pgidemtest.TestingT) {
			pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice",
				&pgidemtest.RequireOpts{Result: receipt{ID: "em_2", Lines: []int{1, 2}}})
		}, `mail/order-9.invoice: want the result {"id":"em_2","lines":[1,2]}`, `result {"id":"em_1","lines":[1,2]}`)
	})
	t.Run("WrongAttempts", func(t *testing.T) {
		t.Parallel()
		requireFails(t, func(tb pgidemtest.TestingT) {
			pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice", &pgidemtest.RequireOpts{Attempts: 2})
		}, "want attempts 2", "status completed, attempts 1")
	})
	t.Run("NoRecord", func(t *testing.T) {
		t.Parallel()
		var rec *pgidem.Record
		requireFails(t, func(tb pgidemtest.TestingT) {
			rec = pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-10.invoice", nil)
		}, "mail/order-10.invoice: want a completed record, found none")
		require.Nil(t, rec)
	})
	t.Run("Failed", func(t *testing.T) {
		t.Parallel()
		requireFails(t, func(tb pgidemtest.TestingT) {
			pgidemtest.RequireFailed(b.ctx, tb, b.coord, "mail", "order-9.invoice", nil)
		}, "want a failed record, found status completed")
	})
	t.Run("InvalidKey", func(t *testing.T) {
		t.Parallel()
		requireFails(t, func(tb pgidemtest.TestingT) {
			pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "", nil)
		}, "reading the record", "invalid")
	})
}

// Large integers and nil results are compared exactly, not through float64 or as absent.
func TestRequireCompletedExactValues(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := pgidem.Do(b.ctx, b.coord, "ids", "big", time.Hour, nil, func(context.Context) (int64, error) {
		return 9007199254740993, nil // 2^53 + 1: float64 rounds it to 2^53
	})
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "ids", "nil", time.Hour, nil, func(context.Context) (*receipt, error) {
		return nil, nil
	})
	require.NoError(t, err)

	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "big", &pgidemtest.RequireOpts{Result: int64(9007199254740993)})
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "big", &pgidemtest.RequireOpts{Result: int64(9007199254740992)})
	}, "want the result 9007199254740992")
	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "nil", &pgidemtest.RequireOpts{Result: json.RawMessage("null")})
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "nil", &pgidemtest.RequireOpts{Result: receipt{}})
	}, `want the result {"id":"","lines":null}`, "result null")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "nil", &pgidemtest.RequireOpts{Result: json.RawMessage("{")})
	}, "RequireOpts.Result is not valid JSON")
}

func TestRequireFailed(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := pgidem.Do(b.ctx, b.coord, "charge", "order-9", time.Hour, nil, func(context.Context) (string, error) {
		return "", pgidem.Permanent(errors.New("card declined"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)

	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireFailed(b.ctx, tb, b.coord, "charge", "order-9", &pgidemtest.RequireOpts{Attempts: 1, Message: "card declined"})
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireFailed(b.ctx, tb, b.coord, "charge", "order-9", &pgidemtest.RequireOpts{Message: "card expired"})
	}, `want the stored error "card expired"`, `error {"message":"card declined"}`)
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "charge", "order-9", nil)
	}, "want a completed record, found status failed")
}

// A key in progress, then one past its TTL: the first is a record, the second counts as
// none.
func TestRequireNoRecord(t *testing.T) {
	t.Parallel()
	b := setup(t)

	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "mail", "order-9.invoice")
	})

	started, finish := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "order-9.invoice", time.Hour, nil, func(context.Context) (string, error) {
			close(started)
			<-finish
			return "em_1", nil
		})
		done <- err
	}()
	<-started
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "mail", "order-9.invoice")
	}, "want no record, found status in_progress, attempts 1, lease expires")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice", nil)
	}, "want a completed record, found status in_progress")
	close(finish)
	require.NoError(t, <-done)

	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "mail", "order-9.invoice")
	}, `want no record, found status completed, attempts 1, result "em_1"`)

	// Past its TTL (moved back by hand, as time would): no record, swept or not.
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "mail", "order-9.invoice")
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "mail", "order-9.invoice", nil)
	}, "found one past its TTL (counts as none): status completed")
}

// The Tx forms see what the transaction wrote before it commits; the pool forms do not.
func TestTxForms(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()

	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "order-9.credit", time.Hour, nil, func(context.Context, pgx.Tx) (int, error) {
		return 42, nil
	})
	require.NoError(t, err)
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "order-9.refund", time.Hour, nil, func(context.Context, pgx.Tx) (int, error) {
		return 0, pgidem.Permanent(errors.New("nothing to refund"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)

	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompletedTx(b.ctx, tb, b.coord, tx, "ledger", "order-9.credit", &pgidemtest.RequireOpts{Result: 42})
		pgidemtest.RequireFailedTx(b.ctx, tb, b.coord, tx, "ledger", "order-9.refund", &pgidemtest.RequireOpts{Message: "nothing to refund"})
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "ledger", "order-9.credit")
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecordTx(b.ctx, tb, b.coord, tx, "ledger", "order-9.credit")
	}, "want no record, found status completed, attempts 1, result 42")

	require.NoError(t, tx.Rollback(b.ctx))
	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "ledger", "order-9.credit")
		pgidemtest.RequireNoRecord(b.ctx, tb, b.coord, "ledger", "order-9.refund")
	})
}

// A store that cannot answer fails the test, it does not pass an assertion of absence.
func TestStoreErrorFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx, cancel := context.WithCancel(b.ctx)
	cancel()
	r := &recorder{}
	pgidemtest.RequireNoRecord(ctx, r, b.coord, "mail", "order-9.invoice")
	require.True(t, r.failed)
	require.Len(t, r.errors, 1)
	require.True(t, strings.Contains(r.errors[0], "reading the record"), r.errors[0])
}

// A JSON string is not the number it spells, and a []byte is compared as pgidem stores it
// (base64), not taken as JSON.
func TestRequireCompletedTypes(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, err := pgidem.Do(b.ctx, b.coord, "ids", "str", time.Hour, nil, func(context.Context) (string, error) { return "42", nil })
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "ids", "bytes", time.Hour, nil, func(context.Context) ([]byte, error) { return []byte("em_1"), nil })
	require.NoError(t, err)

	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "str", &pgidemtest.RequireOpts{Result: 42})
	}, "want the result 42", `result "42"`)
	requirePasses(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "str", &pgidemtest.RequireOpts{Result: "42"})
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "bytes", &pgidemtest.RequireOpts{Result: []byte("em_1")})
	})
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompleted(b.ctx, tb, b.coord, "ids", "bytes", &pgidemtest.RequireOpts{Result: []byte(`"em_1"`)})
	}, "want the result")
}

// A nil coordinator or transaction, and an option the helper cannot check, fail the test
// instead of passing it: a nil tx read through the pool would miss the test's uncommitted
// record.
func TestRequireMisuseFails(t *testing.T) {
	t.Parallel()
	b := setup(t)
	tx, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "ledger", "k", time.Hour, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)

	var forgot pgx.Tx // the test meant tx
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecordTx(b.ctx, tb, b.coord, forgot, "ledger", "k")
	}, "the transaction is nil")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompletedTx(b.ctx, tb, b.coord, forgot, "ledger", "k", nil)
	}, "the transaction is nil")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireNoRecord(b.ctx, tb, nil, "ledger", "k")
	}, "the coordinator is nil")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireCompletedTx(b.ctx, tb, b.coord, tx, "ledger", "k", &pgidemtest.RequireOpts{Message: "card declined"})
	}, "RequireOpts.Message applies to a failed record (RequireFailed) only")
	requireFails(t, func(tb pgidemtest.TestingT) {
		pgidemtest.RequireFailedTx(b.ctx, tb, b.coord, tx, "ledger", "k", &pgidemtest.RequireOpts{Result: 1})
	}, "RequireOpts.Result applies to a completed record (RequireCompleted) only")
}
