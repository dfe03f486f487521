package pgidem_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
)

// Tests of DESIGN.md rules that the code honoured but that no test would have caught if
// broken: each one fails when its rule is broken in the code.

// xminXmax returns "xmin/xmax" of the row of table (pgidem_record or pgidem_inbox) whose
// key is (k1, k2): any write to the row, or a row lock on it, changes it.
func (b *testBundle) xminXmax(t *testing.T, table, k1, k2 string) string {
	t.Helper()
	cols := map[string][2]string{"pgidem_record": {"namespace", "key"}, "pgidem_inbox": {"consumer", "message_id"}}[table]
	var v string
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, fmt.Sprintf(`SELECT xmin::text || '/' || xmax::text FROM %s WHERE %s = $1 AND %s = $2`,
		table, cols[0], cols[1]), k1, k2).Scan(&v))
	return v
}

// DESIGN "Reserve": the replay path must stay a pure read, and replays and in-progress
// checks never write — also on the ReserveFirst path (the reserving INSERT … ON CONFLICT
// DO NOTHING meets the existing row), with batching on and off, for DoInTx and for an
// inbox duplicate. A row lock (ON CONFLICT DO UPDATE … WHERE false) would set xmax.
// TestReadPathsNeverWrite covers Do's plain-read path.
func TestReadPathsNeverWriteOnEveryEntry(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 64} {
		for _, reserveFirst := range []bool{true, false} {
			t.Run(fmt.Sprintf("MaxBatch%d/ReserveFirst%t", maxBatch, reserveFirst), func(t *testing.T) {
				t.Parallel()
				b := setup(t, &pgidem.Config{MaxBatch: maxBatch})
				opts := func(o pgidem.DoOpts) *pgidem.DoOpts { o.ReserveFirst = reserveFirst; return &o }
				fail := func(context.Context) (int, error) { return 0, errors.New("fn must not run") }
				failTx := func(context.Context, pgx.Tx) (int, error) { return 0, errors.New("fn must not run") }

				// A live holder (a fake one: no heartbeat writes the row during the test).
				reviewInsert(t, b, "live", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", []byte{1})
				before := b.xminXmax(t, "pgidem_record", "mail", "live")
				_, err := pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{InFlight: pgidem.InFlightRaise}), fail)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				_, err = pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{WaitTimeout: 50 * time.Millisecond}), fail)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				_, err = pgidem.Do(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{Fingerprint: []byte{2}}), fail)
				require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
				_, err = pgidem.DoInTx(b.ctx, b.coord, "mail", "live", testTTL, opts(pgidem.DoOpts{InFlight: pgidem.InFlightRaise}), failTx)
				require.ErrorIs(t, err, pgidem.ErrInProgress)
				require.Equal(t, before, b.xminXmax(t, "pgidem_record", "mail", "live"), "in-progress checks never write")

				// A completed record and a stored failure.
				reviewInsert(t, b, "done", "completed", "NULL", "now() + interval '1 hour'", nil)
				_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, error, expires_at, completed_at)
					VALUES ('mail', 'failed', 'failed', gen_random_uuid(), '{"message": "declined"}', now() + interval '1 hour', now())`)
				require.NoError(t, err)
				beforeDone := b.xminXmax(t, "pgidem_record", "mail", "done")
				beforeFailed := b.xminXmax(t, "pgidem_record", "mail", "failed")
				for range 3 {
					res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "done", testTTL, opts(pgidem.DoOpts{}),
						func(context.Context) (string, error) { return "", errors.New("fn must not run") })
					require.NoError(t, err)
					require.True(t, res.Replayed)
					require.Equal(t, "old", res.Value)
					_, err = pgidem.Do(b.ctx, b.coord, "mail", "failed", testTTL, opts(pgidem.DoOpts{}), fail)
					require.ErrorIs(t, err, pgidem.ErrPermanent)

					txRes, err := pgidem.DoInTxResult(b.ctx, b.coord, "mail", "done", testTTL, opts(pgidem.DoOpts{}),
						func(context.Context, pgx.Tx) (string, error) { return "", errors.New("fn must not run") })
					require.NoError(t, err)
					require.True(t, txRes.Replayed)
					require.Equal(t, "old", txRes.Value)
					_, err = pgidem.DoInTx(b.ctx, b.coord, "mail", "failed", testTTL, opts(pgidem.DoOpts{}), failTx)
					require.ErrorIs(t, err, pgidem.ErrPermanent)
				}
				require.Equal(t, beforeDone, b.xminXmax(t, "pgidem_record", "mail", "done"), "replays never write")
				require.Equal(t, beforeFailed, b.xminXmax(t, "pgidem_record", "mail", "failed"), "replays of a stored failure never write")

				// An inbox duplicate, through InboxHandle and InboxRecordTx (committed).
				handled, err := b.coord.InboxHandle(b.ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { return nil })
				require.NoError(t, err)
				require.True(t, handled)
				beforeInbox := b.xminXmax(t, "pgidem_inbox", "billing", "m1")
				for range 3 {
					handled, err = b.coord.InboxHandle(b.ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error {
						return errors.New("handler must not run")
					})
					require.NoError(t, err)
					require.False(t, handled)
					tx := b.begin(t)
					isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m1", nil)
					require.NoError(t, err)
					require.False(t, isNew)
					require.NoError(t, tx.Commit(b.ctx))
				}
				require.Equal(t, beforeInbox, b.xminXmax(t, "pgidem_inbox", "billing", "m1"), "inbox duplicates never write")
			})
		}
	}
}

// DESIGN "Reserve" / STYLE 13: expiry is judged by the database clock at the statement, not
// at the transaction's start. A transaction opened before a record and an inbox row
// expired (so now() in it predates their expiry) still sees them as expired: LookupTx
// says so, DoTx runs fn instead of replaying, and InboxRecordTx records the message anew.
func TestExpiryJudgedByStatementClock(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx := b.begin(t)
	var txStart time.Time
	require.NoError(t, tx.QueryRow(b.ctx, `SELECT now()`).Scan(&txStart))

	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
		VALUES ('ledger', 'k', 'completed', gen_random_uuid(), '"old"', now() + interval '300 milliseconds', now())`)
	require.NoError(t, err)
	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ('billing', 'm1', now(), now() + interval '300 milliseconds')`)
	require.NoError(t, err)
	time.Sleep(600 * time.Millisecond)

	rec, err := b.coord.LookupTx(b.ctx, tx, "ledger", "k")
	require.NoError(t, err)
	require.True(t, rec.Expired, "the record expired after the transaction started")
	require.True(t, rec.ExpiresAt.After(txStart), "precondition: expiry after the transaction's now()")

	var runs atomic.Int32
	res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		runs.Add(1)
		return "new", nil
	})
	require.NoError(t, err)
	require.False(t, res.Replayed, "an expired record replayed")
	require.Equal(t, "new", res.Value)
	require.EqualValues(t, 1, runs.Load())

	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m1", nil)
	require.NoError(t, err)
	require.True(t, isNew, "an inbox row past its retention counted as a duplicate")
	require.NoError(t, tx.Commit(b.ctx))
	require.JSONEq(t, `"new"`, string(b.lookup(t, "ledger", "k").Result))
}

// DESIGN "Schema": identifiers are always quoted with pgx.Identifier. In a schema whose name
// needs quoting (a space, capitals), migrated by the migrations package, every statement
// family works: Do, DoInTx, DoTx's replay, the inbox (new and duplicate) and Sweep.
func TestQuotedSchemaIdentifiers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	const schema = "Idem Store"
	sqlDB, err := migrations.OpenDB(db.URL, schema)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sqlDB.Close() })
	_, err = migrations.Up(ctx, sqlDB, &migrations.Opts{Schema: schema})
	require.NoError(t, err)
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Schema: schema})
	require.NoError(t, err)

	v, err := pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	require.Equal(t, 1, v)

	var runs atomic.Int32
	v, err = pgidem.DoInTx(ctx, coord, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		runs.Add(1)
		return 2, nil
	})
	require.NoError(t, err)
	require.Equal(t, 2, v)
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	res, err := pgidem.DoTxResult(ctx, coord, tx, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) {
		runs.Add(1)
		return 3, nil
	})
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, 2, res.Value)
	require.NoError(t, tx.Commit(ctx))
	require.EqualValues(t, 1, runs.Load())

	for i, want := range []bool{true, false} {
		handled, err := coord.InboxHandle(ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { return nil })
		require.NoError(t, err)
		require.Equal(t, want, handled, "call %d", i)
	}

	_, err = db.Pool.Exec(ctx, `
		INSERT INTO "Idem Store".pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
			VALUES ('mail', 'old', 'completed', gen_random_uuid(), '1', now() - interval '1 second', now() - interval '1 hour');
		INSERT INTO "Idem Store".pgidem_inbox (consumer, message_id, received_at, expires_at)
			VALUES ('billing', 'old', now() - interval '8 days', now() - interval '1 day')`)
	require.NoError(t, err)
	sw, err := coord.Sweep(ctx, nil)
	require.NoError(t, err)
	require.Equal(t, pgidem.SweepResult{Records: 1, Inbox: 1}, pgidem.SweepResult{Records: sw.Records, Inbox: sw.Inbox})
	require.Positive(t, sw.RowsPerSecond)

	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM "Idem Store".pgidem_record) + (SELECT count(*) FROM "Idem Store".pgidem_inbox)`).Scan(&n))
	require.Equal(t, 3, n, "Do's and DoInTx's records and the inbox row live in the schema")
}

// DESIGN "Keys, namespaces, TTL, fingerprints": the fingerprint is compared on every path,
// in progress and takeover included, also by DoTx: meeting a live Do holder or a dead
// one's expired lease with another fingerprint returns ErrFingerprintMismatch, without
// running fn (or waiting) and without touching the row.
func TestDoTxChecksFingerprintInProgressAndTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fpA, fpB := []byte("payload-A"), []byte("payload-B")
	var runs atomic.Int32
	fn := func(context.Context, pgx.Tx) (int, error) { runs.Add(1); return 1, nil }

	live := b.hold(b.coord, "ns", "live", &pgidem.DoOpts{Fingerprint: fpA}, "holder")
	_, err := pgidem.DoInTx(b.ctx, b.coord, "ns", "live", testTTL, &pgidem.DoOpts{Fingerprint: fpB, InFlight: pgidem.InFlightRaise}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "in progress, Raise")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "live", testTTL, &pgidem.DoOpts{Fingerprint: fpB, WaitTimeout: 200 * time.Millisecond}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "in progress, Wait")
	live.unblock()
	require.NoError(t, <-live.done)

	b.insertDeadHolder(t, "ns", "dead", fpA)
	before := b.readRaw(t, "ns", "dead")
	_, err = pgidem.DoInTx(b.ctx, b.coord, "ns", "dead", testTTL, &pgidem.DoOpts{Fingerprint: fpB}, fn)
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, "takeover of a dead holder")
	require.Equal(t, before, b.readRaw(t, "ns", "dead"), "the dead holder's row was changed")

	require.Zero(t, runs.Load(), "fn ran despite a fingerprint mismatch")
}

// transitionObserver collects a coordinator's hook events and JSON log records.
type transitionObserver struct {
	mu     sync.Mutex
	events []pgidem.Event
	logs   bytes.Buffer
}

func (o *transitionObserver) config(cfg pgidem.Config) *pgidem.Config {
	cfg.Hook = pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.events = append(o.events, e)
	})
	cfg.Logger = slog.New(slog.NewJSONHandler(&syncWriter{w: &o.logs, mu: &o.mu}, nil))
	return &cfg
}

// kinds returns the kinds of the events reported for namespace.
func (o *transitionObserver) kinds(namespace string) []pgidem.EventKind {
	o.mu.Lock()
	defer o.mu.Unlock()
	var kinds []pgidem.EventKind
	for _, e := range o.events {
		if e.Namespace == namespace {
			kinds = append(kinds, e.Kind)
		}
	}
	return kinds
}

// count returns how many events of kind were reported for namespace.
func (o *transitionObserver) count(namespace string, kind pgidem.EventKind) int {
	n := 0
	for _, k := range o.kinds(namespace) {
		if k == kind {
			n++
		}
	}
	return n
}

// loggedContaining returns the messages logged at level about namespace/key that
// contain want.
func (o *transitionObserver) loggedContaining(t *testing.T, level slog.Level, namespace, key, want string) []string {
	t.Helper()
	o.mu.Lock()
	logs := slices.Clone(o.logs.Bytes())
	o.mu.Unlock()
	var msgs []string
	sc := bufio.NewScanner(bytes.NewReader(logs))
	for sc.Scan() {
		var rec struct {
			Level, Msg, Namespace, Key string
		}
		require.NoError(t, json.Unmarshal(sc.Bytes(), &rec))
		if rec.Level == level.String() && rec.Namespace == namespace && rec.Key == key && strings.Contains(rec.Msg, want) {
			msgs = append(msgs, rec.Msg)
		}
	}
	require.NoError(t, sc.Err())
	return msgs
}

// requireLogged asserts that a message containing want was logged at level about
// namespace/key.
func (o *transitionObserver) requireLogged(t *testing.T, level slog.Level, namespace, key, want string) {
	t.Helper()
	require.NotEmpty(t, o.loggedContaining(t, level, namespace, key, want),
		"no %s log containing %q about %s/%s; logs:\n%s", level, want, namespace, key, o.logText())
}

func (o *transitionObserver) logText() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.logs.String()
}

// DESIGN "Observability": every unusual transition is logged and counted. A takeover of a
// dead holder, by Do or DoTx, emits EventTakenOver and logs at warn; a fingerprint
// mismatch, by Do or DoTx, emits EventFingerprintMismatch and logs at warn; a lease lost
// by the time the result is stored emits EventLeaseLost and logs at error.
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
