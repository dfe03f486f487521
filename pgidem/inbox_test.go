package pgidem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

func (b *testBundle) inboxRows(t *testing.T) int {
	t.Helper()
	var n int
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pgidem_inbox`).Scan(&n))
	return n
}

// ledgerHandler is an inbox handler that writes one ledger row.
func ledgerHandler(ref string, runs *atomic.Int32) func(ctx context.Context, tx pgx.Tx) error {
	return func(ctx context.Context, tx pgx.Tx) error {
		runs.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ($1)`, ref)
		return err
	}
}

func TestInboxHandleOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32
	opts := &pgidem.InboxOpts{Payload: []byte(`{"order":"order-9"}`)}

	handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", opts, ledgerHandler("order-9", &runs))
	require.NoError(t, err)
	require.True(t, handled)
	handled, err = b.coord.InboxHandle(b.ctx, "billing", "evt-1", opts, ledgerHandler("order-9", &runs))
	require.NoError(t, err)
	require.False(t, handled, "a redelivery is skipped")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, b.ledgerRows(t, "order-9"))

	handled, err = b.coord.InboxHandle(b.ctx, "audit", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.True(t, handled, "another consumer has its own inbox")

	var payload string
	var retention time.Duration
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, `
SELECT payload::text, extract(epoch FROM expires_at - received_at)::bigint * 1000000000
FROM pgidem_inbox WHERE consumer = 'billing' AND message_id = 'evt-1'`).Scan(&payload, &retention))
	require.JSONEq(t, `{"order":"order-9"}`, payload)
	require.Equal(t, pgidem.InboxRetentionDefault, retention)
}

func TestInboxConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	var runs atomic.Int32

	const n = 16
	handled := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			handled[i], errs[i] = b.coord.InboxHandle(b.ctx, "billing", "evt-16", nil, ledgerHandler("order-16", &runs))
		})
	}
	wg.Wait()
	ran := 0
	for i := range n {
		require.NoError(t, errs[i], "delivery %d", i)
		if handled[i] {
			ran++
		}
	}
	require.Equal(t, 1, ran, "one delivery handled the message")
	require.EqualValues(t, 1, runs.Load(), "the handler ran once; the others skipped")
	require.Equal(t, 1, b.ledgerRows(t, "order-16"))
	require.Equal(t, 1, b.inboxRows(t))
}

func TestInboxRollbackThenDuplicateRuns(t *testing.T) {
	t.Parallel()

	t.Run("Sequential", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.createLedger(t)
		var runs atomic.Int32
		tx := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "evt-1", nil)
		require.NoError(t, err)
		require.True(t, isNew)
		require.NoError(t, ledgerHandler("order-1", &runs)(b.ctx, tx))
		require.NoError(t, tx.Rollback(b.ctx))
		require.Zero(t, b.inboxRows(t))

		handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
		require.NoError(t, err)
		require.True(t, handled)
		require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	})

	t.Run("Concurrent", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		b.createLedger(t)
		var runs atomic.Int32
		first := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, first, "billing", "evt-1", nil)
		require.NoError(t, err)
		require.True(t, isNew)

		type outcome struct {
			handled bool
			err     error
		}
		dup := make(chan outcome, 1)
		go func() {
			handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
			dup <- outcome{handled, err}
		}()
		b.waitForBlocked(t, "transactionid", 1) // the duplicate waits for the first delivery
		require.NoError(t, first.Rollback(b.ctx))
		out := <-dup
		require.NoError(t, out.err)
		require.True(t, out.handled, "the first delivery rolled back, so the duplicate runs")
		require.EqualValues(t, 1, runs.Load())
		require.Equal(t, 1, b.ledgerRows(t, "order-1"))
	})
}

func TestInboxHandlerErrorRecordsNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	errHandler := errors.New("downstream unavailable")
	handled, err := b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (ref) VALUES ('order-1')`)
		require.NoError(t, err)
		return errHandler
	})
	require.ErrorIs(t, err, errHandler)
	require.False(t, handled)
	require.Zero(t, b.inboxRows(t))
	require.Zero(t, b.ledgerRows(t, "order-1"))

	require.PanicsWithValue(t, "handler bug", func() {
		_, _ = b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, func(ctx context.Context, tx pgx.Tx) error {
			panic("handler bug")
		})
	})
	require.Zero(t, b.inboxRows(t))

	var runs atomic.Int32
	handled, err = b.coord.InboxHandle(b.ctx, "billing", "evt-1", nil, ledgerHandler("order-1", &runs))
	require.NoError(t, err)
	require.True(t, handled, "the redelivery runs the handler")
	require.Equal(t, 1, b.ledgerRows(t, "order-1"))
}

func TestInboxDuplicateKeepsTxUsable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	b.createLedger(t)
	handled, err := b.coord.InboxHandle(b.ctx, "billing", "committed", nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.True(t, handled)

	tx := b.begin(t)
	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "committed", nil)
	require.NoError(t, err)
	require.False(t, isNew, "a committed duplicate")
	requireUsable(t, b.ctx, tx)

	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "in-this-tx", nil)
	require.NoError(t, err)
	require.True(t, isNew)
	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "in-this-tx", nil)
	require.NoError(t, err)
	require.False(t, isNew, "a duplicate within the same transaction")
	requireUsable(t, b.ctx, tx)
	_, err = tx.Exec(b.ctx, `INSERT INTO ledger (ref) VALUES ('after')`)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(b.ctx))
	require.Equal(t, 1, b.ledgerRows(t, "after"))
	require.Equal(t, 2, b.inboxRows(t))
}

func TestInboxInvalid(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	tests := []struct {
		name      string
		consumer  string
		messageID string
		opts      *pgidem.InboxOpts
		want      error
	}{
		{"EmptyConsumer", "", "m", nil, pgidem.ErrInvalidKey},
		{"EmptyMessageID", "c", "", nil, pgidem.ErrInvalidKey},
		{"ControlCharacter", "c", "m\n", nil, pgidem.ErrInvalidKey},
		{"LongMessageID", "c", strings.Repeat("m", pgidem.MaxKeyBytesDefault+1), nil, pgidem.ErrInvalidKey},
		{"LongConsumer", strings.Repeat("c", pgidem.MaxNamespaceBytesDefault+1), "m", nil, pgidem.ErrInvalidKey},
		{"ShortRetention", "c", "m", &pgidem.InboxOpts{Retention: time.Second}, pgidem.ErrInvalidTTL},
		{"PayloadNotJSON", "c", "m", &pgidem.InboxOpts{Payload: []byte("{")}, pgidem.ErrInvalidPayload},
		{"PayloadNulEscape", "c", "m", &pgidem.InboxOpts{Payload: []byte(`"\u0000"`)}, pgidem.ErrInvalidPayload},
		// Over Config.MaxValueBytes: refused before it reaches jsonb, where such a payload
		// (17 M array elements) would fail with an internal error and abort the caller's
		// transaction.
		{"PayloadTooLarge", "c", "m", &pgidem.InboxOpts{Payload: []byte(`"` + strings.Repeat("x", pgidem.MaxValueBytesDefault) + `"`)}, pgidem.ErrInvalidPayload},
		{"NilFn", "c", "m", nil, pgidem.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var ran atomic.Bool
			fn := func(ctx context.Context, tx pgx.Tx) error { ran.Store(true); return nil }
			if tt.want == pgidem.ErrInvalidArgument {
				fn = nil
			}
			handled, err := b.coord.InboxHandle(b.ctx, tt.consumer, tt.messageID, tt.opts, fn)
			require.Error(t, err)
			if tt.want != nil {
				require.ErrorIs(t, err, tt.want)
			}
			require.False(t, handled)
			require.False(t, ran.Load())

			if fn == nil {
				return // InboxRecordTx takes no fn
			}
			tx := b.begin(t)
			_, err = b.coord.InboxRecordTx(b.ctx, tx, tt.consumer, tt.messageID, tt.opts)
			require.ErrorIs(t, err, tt.want)
			requireUsable(t, b.ctx, tx)
		})
	}
}

func TestInboxRetention(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, id := range []string{"old-1", "old-2", "live"} {
		handled, err := b.coord.InboxHandle(b.ctx, "billing", id, nil, func(ctx context.Context, tx pgx.Tx) error { return nil })
		require.NoError(t, err)
		require.True(t, handled)
	}
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_inbox SET expires_at = now() - interval '1 second' WHERE message_id LIKE 'old-%'`)
	require.NoError(t, err)

	// A row past its retention counts as absent before any sweep.
	tx := b.begin(t)
	isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "old-1", nil)
	require.NoError(t, err)
	require.True(t, isNew, "an expired row behaves like no row")
	require.NoError(t, tx.Rollback(b.ctx))

	res, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 1})
	require.NoError(t, err)
	require.EqualValues(t, 2, res.Inbox, "expired rows are swept")
	require.Zero(t, res.Records)
	require.Equal(t, 1, b.inboxRows(t), "the live row is kept")

	tx = b.begin(t)
	isNew, err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "live", nil)
	require.NoError(t, err)
	require.False(t, isNew)
}

// An expired inbox row that a sweep deletes while InboxRecordTx's statement is running
// (the statement has already read the row and waits on the sweep's row lock) behaves like
// no row: the message is new. If the sweep rolls back instead, the expired row is taken
// over: new as well. The sweep's DELETE is held open in a transaction of its own, so the
// interleaving is deterministic.
func TestInboxExpiredRowSweptMidStatement(t *testing.T) {
	t.Parallel()
	for _, sweepCommits := range []bool{true, false} {
		name := map[bool]string{true: "SweepCommits", false: "SweepRollsBack"}[sweepCommits]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.insertExpiredInbox(t, "billing", "m-1")

			sweep := b.begin(t)
			_, err := sweep.Exec(b.ctx, `DELETE FROM pgidem_inbox WHERE expires_at <= now()`)
			require.NoError(t, err)

			type outcome struct {
				isNew, live bool
				err         error
			}
			done := make(chan outcome, 1)
			go func() {
				var out outcome
				defer func() { done <- out }()
				tx, err := b.db.Pool.Begin(b.ctx)
				if out.err = err; err != nil {
					return
				}
				defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
				if out.isNew, out.err = b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-1", nil); out.err != nil {
					return
				}
				out.err = tx.QueryRow(b.ctx, `SELECT expires_at > now() FROM pgidem_inbox
					WHERE consumer = 'billing' AND message_id = 'm-1'`).Scan(&out.live)
			}()
			b.waitForBlocked(t, "transactionid", 1) // the record statement waits for the sweep
			if sweepCommits {
				require.NoError(t, sweep.Commit(b.ctx))
			} else {
				require.NoError(t, sweep.Rollback(b.ctx))
			}
			out := <-done
			require.NoError(t, out.err)
			require.True(t, out.isNew, "the message's row had expired: it is new, its handler must run")
			require.True(t, out.live, "the message is recorded afresh")
		})
	}
}

// Recording a duplicate of a live message is a pure read: no row lock, no transaction id
// (so no WAL flush at commit). Recording a new or expired one writes.
func TestInboxDuplicateIsPureRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ('billing', 'live', now(), now() + interval '1 day'),
		       ('billing', 'expired', now() - interval '8 days', now() - interval '1 day')`)
	require.NoError(t, err)

	tests := []struct {
		messageID string
		wantNew   bool
	}{
		{"live", false},
		{"expired", true},
		{"absent", true},
	}
	for _, tt := range tests {
		tx := b.begin(t)
		isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", tt.messageID, nil)
		require.NoError(t, err)
		require.Equal(t, tt.wantNew, isNew, tt.messageID)
		var xid *int64
		require.NoError(t, tx.QueryRow(b.ctx, `SELECT txid_current_if_assigned()`).Scan(&xid))
		require.Equal(t, tt.wantNew, xid != nil, "%s: a transaction id is assigned only by a write", tt.messageID)
		require.NoError(t, tx.Rollback(b.ctx))
	}
}

// Payloads json.Valid accepts but jsonb rejects are refused with ErrInvalidPayload before
// the transaction is touched (not a store error that aborts it); payloads at jsonb's edges
// are stored.
func TestInboxPayloadJSONBRules(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	rejected := []struct {
		name    string
		payload string
	}{
		{"NotJSON", `{`},
		{"NulEscape", `{"note":"a\u0000b"}`},
		{"NulEscapeInKey", `{"\u0000":1}`},
		{"InvalidUTF8", "{\"note\":\"\xff\"}"},
		{"LoneHighSurrogate", `["\ud800"]`},
		{"HighSurrogateThenText", `["\ud800x"]`},
		{"HighSurrogateThenHigh", `["\uD800\uD800"]`},
		{"LoneLowSurrogate", `["\udc00"]`},
		{"IntegerTooLong", `1e131072`},
		{"IntegerTooLongMantissa", `10e131071`},
		{"TooManyDecimals", `1e-16384`},
		{"TooManyDecimalsMantissa", `1.5e-16383`},
		{"ZeroTooManyDecimals", `[0.0e-16383]`},
		{"ExponentOverflow", `{"n":0e1073741823}`},
		{"ExponentBeyondInt64", `-1e-99999999999999999999999`},
	}
	for _, tt := range rejected {
		t.Run("Rejects"+tt.name, func(t *testing.T) {
			t.Parallel()
			tx := b.begin(t)
			_, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-"+tt.name, &pgidem.InboxOpts{Payload: []byte(tt.payload)})
			require.ErrorIs(t, err, pgidem.ErrInvalidPayload)
			assert.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, "bad input is not a store outage")
			requireUsable(t, b.ctx, tx)
		})
	}

	accepted := []struct {
		name    string
		payload string
	}{
		{"EscapedBackslashThenU0000", `{"note":"\\u0000"}`},
		{"SurrogatePair", `["\ud83d\ude00"]`},
		{"ReplacementCharacterEscape", `["\ufffd"]`},
		{"RawUnicode", `{"note":"čaj 🍵"}`},
		{"LargestInteger", `1e131071`},
		{"LargestIntegerSmallMantissa", `0.001e131074`},
		{"MostDecimals", `1.5e-16382`},
		{"ZeroWithHugeExponent", `0e1073741822`},
		{"NegativeZeroScaledBack", `-0.000e16383`},
		{"Mixed", `{"a":[1,-2.5e3,true,false,null,"e\"1e999999"],"b":{}}`},
	}
	for _, tt := range accepted {
		t.Run("Accepts"+tt.name, func(t *testing.T) {
			t.Parallel()
			tx := b.begin(t)
			isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m-"+tt.name, &pgidem.InboxOpts{Payload: []byte(tt.payload)})
			require.NoError(t, err)
			require.True(t, isNew)
			requireUsable(t, b.ctx, tx)
		})
	}
}

// Two transactions reusing one expired inbox row: the second blocks on the first's
// takeover and then skips (first commits) or takes over itself (first rolls back).
func TestInboxExpiredRowConcurrentTakeover(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		name := map[bool]string{true: "FirstCommits", false: "FirstRollsBack"}[commit]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			b.insertExpiredInbox(t, "billing", "m")

			first := b.begin(t)
			isNew, err := b.coord.InboxRecordTx(b.ctx, first, "billing", "m", nil)
			require.NoError(t, err)
			require.True(t, isNew)

			done := make(chan error, 1)
			var secondNew atomic.Bool
			go func() {
				tx, err := b.db.Pool.Begin(b.ctx)
				if err != nil {
					done <- err
					return
				}
				defer tx.Rollback(b.ctx) //nolint:errcheck // test cleanup
				isNew, err := b.coord.InboxRecordTx(b.ctx, tx, "billing", "m", nil)
				secondNew.Store(isNew)
				done <- err
			}()
			b.waitForBlocked(t, "transactionid", 1)
			if commit {
				require.NoError(t, first.Commit(b.ctx))
			} else {
				require.NoError(t, first.Rollback(b.ctx))
			}
			require.NoError(t, <-done)
			require.Equal(t, !commit, secondNew.Load())
		})
	}
}

// InboxHandle for a message from within the fn handling that message is refused at once,
// instead of waiting for its own uncommitted inbox row. So is InboxRecordTx for that
// message, on the handler's own tx (it is not a duplicate: a helper skipping on it would
// drop the handler's writes) and on another tx (it would wait like the nested
// InboxHandle). Another message, and a Do inside fn, are fine; KeyFromContext inside the
// handler still reports only record keys.
func TestInboxHandleNestedSameMessage(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ctx, cancel := context.WithTimeout(b.ctx, time.Minute) // failure cap for the old hang
	defer cancel()
	inner := 0
	handled, err := b.coord.InboxHandle(ctx, "billing", "m1", nil, func(ctx context.Context, tx pgx.Tx) error {
		_, _, ok := pgidem.KeyFromContext(ctx)
		require.False(t, ok, "an inbox message is not a record key")
		_, err := b.coord.InboxHandle(ctx, "billing", "m1", nil, func(context.Context, pgx.Tx) error { inner++; return nil })
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		isNew, err := b.coord.InboxRecordTx(ctx, tx, "billing", "m1", nil)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument, "not a duplicate: the handler's own message")
		require.False(t, isNew)
		requireUsable(t, ctx, tx)
		other, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = other.Rollback(b.ctx) }()
		_, err = b.coord.InboxRecordTx(ctx, other, "billing", "m1", nil)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
		isNew, err = b.coord.InboxRecordTx(ctx, other, "billing", "m3", nil)
		require.NoError(t, err)
		require.True(t, isNew, "another message is recorded")
		ok2, err := b.coord.InboxHandle(ctx, "billing", "m2", nil, func(context.Context, pgx.Tx) error { inner++; return nil })
		require.NoError(t, err)
		require.True(t, ok2)
		return nil
	})
	require.NoError(t, err)
	require.True(t, handled)
	require.Equal(t, 1, inner)
}

// insertExpiredInbox stores an inbox row for (consumer, messageID) whose retention ended a
// day ago.
func (b *testBundle) insertExpiredInbox(t *testing.T, consumer, messageID string) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_inbox (consumer, message_id, received_at, expires_at)
		VALUES ($1, $2, now() - interval '8 days', now() - interval '1 day')`, consumer, messageID)
	require.NoError(t, err)
}

// FuzzInboxPayload: a payload InboxHandle accepts is stored in the inbox row and reads
// back as equal JSON (jsonb normalises spacing, key order, duplicate keys and number
// spelling, not values); one it refuses returns an error matching ErrInvalidPayload
// before the handler runs, and records nothing.
func FuzzInboxPayload(f *testing.F) {
	for _, seed := range []string{
		"", "null", `{"sku":"mug","qty":1}`, `{"a":1,"a":2}`, `[1e2, 1.50, -0, 0.0e-5]`, `"\u0000"`,
		`"\ud800"`, `"\ud83d\ude00"`, "\"\xff\"", `{`, `1e131072`, `1e-16383`, `123456789012345678901234567890`,
		`"\ufffd"`, `[[[[[[[[[[1]]]]]]]]]]`, ` {"x" : [true, false, null] } `, "\"\u2028\"",
	} {
		f.Add([]byte(seed))
	}
	b := fuzzBundle(f)
	var seq atomic.Int64
	f.Fuzz(func(t *testing.T, payload []byte) {
		id := fmt.Sprintf("m%d", seq.Add(1))
		ran := false
		handled, err := b.coord.InboxHandle(b.ctx, "fuzz", id, &pgidem.InboxOpts{Payload: payload},
			func(context.Context, pgx.Tx) error { ran = true; return nil })
		var stored []byte
		rowErr := b.db.Pool.QueryRow(b.ctx, `SELECT payload::text FROM pgidem_inbox WHERE consumer = 'fuzz' AND message_id = $1`, id).Scan(&stored)
		if err != nil {
			require.ErrorIs(t, err, pgidem.ErrInvalidPayload, "%q", payload)
			require.False(t, ran, "the handler ran for a refused payload %q", payload)
			require.ErrorIs(t, rowErr, pgx.ErrNoRows, "a refused payload was recorded: %q", payload)
			return
		}
		require.True(t, handled)
		require.True(t, ran)
		require.NoError(t, rowErr)
		if payload == nil {
			require.Nil(t, stored, "no payload is NULL")
			return
		}
		require.NotNil(t, stored, "payload %q was stored as NULL", payload)
		requireSameJSON(t, payload, stored)
	})
}

// requireSameJSON asserts that want and got are the same JSON value: objects by their keys
// (the last of duplicates counts), numbers by their exact decimal value.
func requireSameJSON(t *testing.T, want, got []byte) {
	t.Helper()
	decode := func(p []byte) any {
		d := json.NewDecoder(bytes.NewReader(p))
		d.UseNumber()
		var v any
		require.NoError(t, d.Decode(&v), "%q", p)
		return v
	}
	require.True(t, sameJSON(decode(want), decode(got)), "sent %q, stored %q", want, got)
}

// sameJSON reports whether two values decoded with UseNumber are the same JSON value.
func sameJSON(a, b any) bool {
	switch a := a.(type) {
	case json.Number:
		b, ok := b.(json.Number)
		if !ok {
			return false
		}
		x, okx := new(big.Rat).SetString(string(a))
		y, oky := new(big.Rat).SetString(string(b))
		return okx && oky && x.Cmp(y) == 0
	case map[string]any:
		b, ok := b.(map[string]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for k, v := range a {
			if w, ok := b[k]; !ok || !sameJSON(v, w) {
				return false
			}
		}
		return true
	case []any:
		b, ok := b.([]any)
		if !ok || len(a) != len(b) {
			return false
		}
		for i := range a {
			if !sameJSON(a[i], b[i]) {
				return false
			}
		}
		return true
	default:
		return a == b
	}
}
