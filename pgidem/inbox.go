package pgidem

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
)

// InboxRetentionDefault is the default [InboxOpts.Retention]: seven days.
const InboxRetentionDefault = 7 * 24 * time.Hour

// Inbox event kinds, reported to [Config.Hook] with the consumer as Event.Namespace.
const (
	// EventInboxRecorded: a message was recorded as new; its handler runs.
	EventInboxRecorded EventKind = "inbox_recorded"
	// EventInboxDuplicate: a message was already recorded; its handler is skipped.
	EventInboxDuplicate EventKind = "inbox_duplicate"
)

// InboxOpts are optional settings for [Coordinator.InboxRecordTx] and
// [Coordinator.InboxHandle]. A nil *InboxOpts means all defaults.
type InboxOpts struct {
	// Retention is how long the message stays recorded, counted from the statement that
	// recorded it (not from the commit, so a handler that runs longer than Retention
	// commits a row that has already expired). A redelivery within it is skipped; after it the row counts as absent
	// (whether or not [Coordinator.Sweep] has deleted it) and the message would be handled
	// again. Make it outlive the broker's retention and its longest redelivery horizon. At
	// least [Config.MinTTL], otherwise [*InvalidTTLError]. Default [InboxRetentionDefault]
	// (7 days).
	Retention time.Duration

	// Payload is stored in the row's payload column (jsonb) for inspection with SQL; it is
	// never read back by pgidem. It must be JSON that jsonb accepts, which is stricter than
	// [encoding/json.Valid]: valid UTF-8 throughout, no \u0000 escape, no unpaired UTF-16
	// surrogate escape (\ud800 alone), numbers within Postgres's numeric range (at
	// most 131072 digits before the decimal point and 16383 after it, exponent included),
	// and nesting at most 10000 levels deep (encoding/json's limit, which pgidem's check
	// uses); and it must be at most [Config.MaxValueBytes] bytes (16 MiB by default). The
	// database must use the UTF8 encoding (as pgidem needs for keys and results too):
	// in another, a character it cannot represent fails the statement as a *StoreError.
	// A payload that breaks a rule returns an error matching [ErrInvalidPayload] before the
	// transaction is touched, so it stays usable and the handler does not run; record
	// without a payload (or with a sanitised one) to handle such a message. Default nil:
	// NULL.
	Payload []byte
}

// ErrInvalidPayload means [InboxOpts.Payload] cannot be stored in the inbox's jsonb
// column: it is not JSON, it is JSON that jsonb rejects, or it is larger than
// [Config.MaxValueBytes] (see InboxOpts.Payload). It is
// returned wrapped with the reason, before any statement runs; the message is not recorded.
var ErrInvalidPayload = errors.New("pgidem: invalid inbox payload")

// inboxStatements holds the inbox's SQL with the table name quoted in.
type inboxStatements struct {
	record, sweep string
}

func newInboxStatements(schema string) inboxStatements {
	t := qualify(schema, "pgidem_inbox")
	r := strings.NewReplacer("{t}", t)
	return inboxStatements{
		// Record the message in one statement: take over a row past its retention, else
		// insert; the one result column says whether this call recorded it.
		//
		// A live row is only read: the UPDATE's condition is judged on the statement's
		// snapshot, so it locks nothing, and ON CONFLICT DO NOTHING takes no lock and never
		// raises a unique violation (which would abort the caller's transaction). No
		// transaction id is assigned, so a duplicate costs a read. (ON CONFLICT DO UPDATE …
		// WHERE <expired> would do this in one clause, but it locks the conflicting row —
		// and assigns an xid — before judging the WHERE, so every duplicate would write.)
		//
		// Concurrency, under READ COMMITTED:
		//   - an expired row another transaction is taking over: the UPDATE waits for it;
		//     after its commit the UPDATE re-checks the new row version (live: nothing to
		//     take) and the INSERT conflicts, so the message is a duplicate; after its
		//     rollback the UPDATE takes the row over.
		//   - an expired row a sweep deletes meanwhile (before or while the UPDATE reaches
		//     it): the UPDATE skips the deleted row and the INSERT goes ahead, so an expired
		//     row behaves like no row even mid-statement.
		//   - a concurrent first insert: the INSERT waits for that transaction; after its
		//     commit it does nothing (duplicate), after its rollback it inserts.
		record: r.Replace(`
WITH takeover AS (
	UPDATE {t} SET payload = $3::jsonb, received_at = statement_timestamp(),
		expires_at = statement_timestamp() + $4 * interval '1 microsecond'
	WHERE consumer = $1 AND message_id = $2 AND expires_at <= statement_timestamp()
	RETURNING true
), ins AS (
	INSERT INTO {t} (consumer, message_id, payload, received_at, expires_at)
	SELECT $1, $2, $3::jsonb, statement_timestamp(), statement_timestamp() + $4 * interval '1 microsecond'
	WHERE NOT EXISTS (SELECT FROM takeover)
	ON CONFLICT (consumer, message_id) DO NOTHING
	RETURNING true
)
SELECT EXISTS (SELECT FROM takeover) OR EXISTS (SELECT FROM ins)`),

		// Delete one batch of rows past their retention; see statements.sweep.
		sweep: r.Replace(`
DELETE FROM {t}
WHERE (consumer, message_id) IN (
	SELECT consumer, message_id FROM {t}
	WHERE expires_at <= now()
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
	}
}

// inboxCall is one validated inbox request.
type inboxCall struct {
	consumer, messageID string
	retention           time.Duration
	payload             []byte
}

func (c *Coordinator) newInboxCall(consumer, messageID string, opts *InboxOpts) (*inboxCall, error) {
	if opts == nil {
		opts = &InboxOpts{}
	}
	if err := validatePart("consumer", consumer, c.config.MaxNamespaceBytes); err != nil {
		return nil, err
	}
	if err := validatePart("message_id", messageID, c.config.MaxKeyBytes); err != nil {
		return nil, err
	}
	ic := &inboxCall{consumer: consumer, messageID: messageID,
		retention: cmp.Or(opts.Retention, InboxRetentionDefault), payload: opts.Payload}
	if ic.retention < c.config.MinTTL {
		return nil, &InvalidTTLError{TTL: ic.retention, MinTTL: c.config.MinTTL, Lease: c.config.Lease}
	}
	if ic.payload != nil {
		if err := checkPayload(ic.payload, c.config.MaxValueBytes); err != nil {
			return nil, fmt.Errorf("%w: InboxOpts.Payload %v", ErrInvalidPayload, err)
		}
	}
	return ic, nil
}

// Postgres numeric limits, in decimal digits (src/include/utils/numeric.h): the weight of
// the leading digit (NUMERIC_WEIGHT_MAX base-10000 digits) and the digits after the
// decimal point (NUMERIC_DSCALE_MAX), and the exponent bound of numeric input (INT_MAX/2).
const (
	numericMaxWeight   = 4*0x7FFF + 3 // 131071: up to 131072 digits before the point
	numericMaxScale    = 0x3FFF       // 16383
	numericMaxExponent = 1<<30 - 1    // INT_MAX/2, exclusive
)

// checkPayload reports why jsonb would reject b: not JSON, not valid UTF-8 (json.Valid
// lets it through inside strings), a \u0000 escape (jsonb cannot store NUL in text), an
// unpaired surrogate escape, or a number outside numeric's range. Each of these would
// otherwise fail the INSERT and abort the caller's transaction.
func checkPayload(b []byte, maxBytes int) error {
	if len(b) > maxBytes {
		return fmt.Errorf("is %d bytes, more than Config.MaxValueBytes (%d)", len(b), maxBytes)
	}
	if !json.Valid(b) {
		return errors.New("is not valid JSON")
	}
	if !utf8.Valid(b) {
		return errors.New("is not valid UTF-8")
	}
	for i := 0; i < len(b); {
		var n int
		var err error
		switch c := b[i]; {
		case c == '"':
			n, err = checkPayloadString(b[i:])
		case c == '-' || '0' <= c && c <= '9':
			var fits bool
			if n, fits = numericFits(b[i:]); !fits {
				err = errors.New("contains a number outside Postgres's numeric range")
			}
		default:
			n = 1
		}
		if err != nil {
			return err
		}
		i += n
	}
	return nil
}

// checkPayloadString checks the escapes of the JSON string at the start of b (valid JSON)
// and returns its length.
func checkPayloadString(b []byte) (int, error) {
	for i := 1; i < len(b); i++ {
		switch b[i] {
		case '"':
			return i + 1, nil
		case '\\':
			if b[i+1] != 'u' {
				i++ // skip the escaped character
				continue
			}
			unit := hex16(b[i+2 : i+6])
			i += 5
			switch {
			case unit == 0:
				return 0, errors.New("contains a \\u0000 escape; jsonb cannot store NUL")
			case utf16.IsSurrogate(unit) && unit < 0xDC00: // high: a low one must follow
				if i+6 < len(b) && b[i+1] == '\\' && b[i+2] == 'u' {
					if low := hex16(b[i+3 : i+7]); 0xDC00 <= low && low <= 0xDFFF {
						i += 6
						continue
					}
				}
				return 0, errors.New("contains an unpaired UTF-16 surrogate escape")
			case utf16.IsSurrogate(unit):
				return 0, errors.New("contains an unpaired UTF-16 surrogate escape")
			}
		}
	}
	return len(b), nil
}

// hex16 decodes the four hexadecimal digits of a \u escape (checked by json.Valid).
func hex16(h []byte) rune {
	var v rune
	for _, c := range h {
		switch {
		case c <= '9':
			c -= '0'
		case c >= 'a':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		v = v<<4 | rune(c)
	}
	return v
}

// numericFits returns the length of the JSON number at the start of b (valid JSON) and
// whether Postgres's numeric input accepts it.
func numericFits(b []byte) (int, bool) {
	i := 0
	if b[i] == '-' {
		i++
	}
	digits := func() (start, end int) {
		start = i
		for i < len(b) && '0' <= b[i] && b[i] <= '9' {
			i++
		}
		return start, i
	}
	intStart, intEnd := digits()
	fracStart, fracEnd := i, i
	if i < len(b) && b[i] == '.' {
		i++
		fracStart, fracEnd = digits()
	}
	var exp int64
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		negative := b[i] == '-'
		if b[i] == '+' || b[i] == '-' {
			i++
		}
		expStart, expEnd := digits()
		for _, c := range b[expStart:expEnd] {
			exp = min(exp*10+int64(c-'0'), numericMaxExponent) // saturate: no overflow
		}
		if negative {
			exp = -exp
		}
	}
	if exp >= numericMaxExponent || exp <= -numericMaxExponent {
		return i, false
	}
	if scale := int64(fracEnd-fracStart) - exp; scale > numericMaxScale {
		return i, false
	}
	// The weight of the leading non-zero digit; zero has none.
	mantissa := [2][]byte{b[intStart:intEnd], b[fracStart:fracEnd]}
	leading := int64(intEnd - intStart - 1)
	for _, part := range mantissa {
		for _, c := range part {
			if c != '0' {
				return i, leading+exp <= numericMaxWeight
			}
			leading--
		}
	}
	return i, true
}

// InboxRecordTx records message messageID of consumer in the caller's transaction tx and
// reports whether it is new. Run the handler's writes in tx when it returns true, skip the
// message when it returns false; the caller's commit makes the record and the handler's
// rows visible together, and a rollback leaves neither, so the redelivery runs again.
//
// The message id names the delivery (a Kafka event id, an SQS message id); consumer
// scopes it, so two consumer groups handling one topic keep separate inboxes. Both follow
// the key rules ([ErrInvalidKey]): consumer within [Config.MaxNamespaceBytes], messageID
// within [Config.MaxKeyBytes]; an invalid one returns an [*InvalidKeyError] before tx is
// touched. A retention below [Config.MinTTL] returns an [*InvalidTTLError], a payload
// jsonb would reject an error matching [ErrInvalidPayload], also before tx is touched.
//
// The insert uses ON CONFLICT DO NOTHING, never a caught unique violation, so a duplicate
// leaves tx usable, and recording a duplicate is a pure read (no row lock, no transaction
// id). A concurrent transaction recording the same message blocks until the first one
// ends: after its commit this call returns false, after its rollback true. A row past its
// retention counts as absent and is reused (true), whether or not a concurrent
// [Coordinator.Sweep] deletes it meanwhile.
//
// Under REPEATABLE READ or SERIALIZABLE a concurrent duplicate, or a concurrent Sweep
// deleting the expired row this call would reuse, may instead fail with a serialization
// failure (SQLSTATE 40001, returned as a [*StoreError] whose Err is the *pgconn.PgError);
// retry the transaction. Database errors are returned as a [*StoreError] for op "inbox";
// roll tx back after one. A tx that cannot take the row returns an error matching
// [ErrInvalidArgument] instead: one already committed or rolled back, or one an earlier
// failed statement aborted. A read-only tx is refused by the server (a *StoreError, as
// from a server that refuses writes), which aborts it: roll it back. A call for the message from within the
// [Coordinator.InboxHandle] fn handling it returns an error matching [ErrInvalidArgument]
// before tx is touched: on that fn's tx it would report a duplicate (and the caller skip
// the handler's writes), on another it would wait for the handler's uncommitted row.
// Cancelling ctx ends the statement (pgx may close the connection, which ends tx). Safe
// for concurrent use on different transactions.
func (c *Coordinator) InboxRecordTx(ctx context.Context, tx pgx.Tx, consumer, messageID string, opts *InboxOpts) (bool, error) {
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err == nil {
		err = checkNotHeld(ctx, "InboxRecordTx", c.config.Schema, consumer, messageID, true)
	}
	if err != nil {
		c.emitInvalid(ctx, consumer)
		return false, err
	}
	if tx == nil {
		return false, invalidArgument("InboxRecordTx: tx is nil")
	}
	return c.inboxRecord(ctx, tx, ic, true)
}

// inboxRecord records ic's message in db. callersTx is true when db is the caller's
// transaction (InboxRecordTx): one already ended or aborted is then the caller's mistake,
// not a store error.
func (c *Coordinator) inboxRecord(ctx context.Context, db executor, ic *inboxCall, callersTx bool) (bool, error) {
	var inserted bool
	err := db.QueryRow(ctx, c.sql.inbox.record, ic.consumer, ic.messageID, jsonText(ic.payload),
		micros(ic.retention)).Scan(&inserted)
	if txErr := unusableTx("InboxRecordTx", err); callersTx && txErr != nil {
		c.emitInvalid(ctx, ic.consumer)
		return false, txErr
	}
	if err != nil {
		return false, c.inboxStoreError(ctx, ic, "inbox", err)
	}
	if !inserted {
		if c.config.Logger.Enabled(ctx, slog.LevelDebug) { // keep the duplicate path allocation-free
			c.config.Logger.DebugContext(ctx, "pgidem: inbox duplicate skipped",
				slog.String("consumer", ic.consumer), slog.String("message_id", ic.messageID))
		}
		c.emit(ctx, EventInboxDuplicate, ic.consumer, 1)
		return false, nil
	}
	c.emit(ctx, EventInboxRecorded, ic.consumer, 1)
	return true, nil
}

func (c *Coordinator) inboxStoreError(ctx context.Context, ic *inboxCall, op string, err error) error {
	return c.reportStoreError(ctx, ic.consumer, storeError(op, err),
		slog.String("consumer", ic.consumer), slog.String("message_id", ic.messageID))
}

// InboxHandle handles message messageID of consumer at most once: it begins a transaction
// on the coordinator's pool, records the message ([Coordinator.InboxRecordTx]) and, when it
// is new, runs fn in that transaction and commits. handled is true when fn ran and the
// commit succeeded; false with a nil error means the message was a duplicate and fn did not
// run.
//
// fn must not commit or roll back tx. If fn returns an error or panics, the transaction is
// rolled back — fn's writes and the inbox row alike — and the error is returned (a panic
// continues), so the redelivery runs fn again. (A fn that ended tx itself and then returns
// an error gets an error matching [ErrInvalidArgument] that wraps its own: whatever fn
// committed stays, the inbox row included, so a redelivery is skipped.) A failed commit
// returns a [*StoreError] for op "commit", except when the failure is fn's doing, which returns an error saying so,
// neither logged nor counted as a store error: fn returned nil after one of its
// statements failed (the server aborts the transaction, so the commit rolls back); the
// server refused the commit for a deferred constraint fn's writes broke (SQLSTATE class
// 23: nothing is committed, and a redelivery would be refused the same way); or fn
// committed or rolled back tx itself (matching [ErrInvalidArgument]: fn's writes and the
// inbox row went with whichever fn called, so a redelivery is skipped or runs fn again). Validation and
// concurrency are as in InboxRecordTx: a concurrent duplicate waits for the first
// transaction and then skips, or runs if the first rolled back. A nil fn, or a call for
// the message from within the fn handling it (directly or through other calls; it would
// wait for its own uncommitted row), returns an error matching [ErrInvalidArgument] and
// runs nothing.
//
// fn's writes must go through its tx to be exactly-once; an effect outside the database
// (a mail) needs [Do] inside fn, keyed by the effect. Do takes a second connection from
// the pool while InboxHandle holds one: size the pool above the number of concurrent
// handlers, twice that so that none waits. With no connection to spare the handlers wait
// on each other, and a Do that gets no connection within [Config.FinishTimeout] fails
// with an [ErrStoreUnavailable] error saying so (or ends with ctx, if that comes first):
// before the effect, nothing ran; after it, the record stays in progress until its lease
// ends, and the next delivery runs the effect again. Cancelling ctx ends the current statement (pgx may close the connection) and
// the transaction rolls back. Safe for concurrent use.
func (c *Coordinator) InboxHandle(ctx context.Context, consumer, messageID string, opts *InboxOpts, fn func(ctx context.Context, tx pgx.Tx) error) (handled bool, err error) {
	if fn == nil {
		return false, invalidArgument("InboxHandle: fn must not be nil")
	}
	ic, err := c.newInboxCall(consumer, messageID, opts)
	if err == nil {
		err = checkNotHeld(ctx, "InboxHandle", c.config.Schema, consumer, messageID, true)
	}
	if err != nil {
		c.emitInvalid(ctx, consumer)
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	// READ WRITE explicitly: a pool whose sessions default to read-only transactions
	// still records, and a server that refuses writes (a hot standby) fails the BEGIN as
	// a store error.
	tx, err := c.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadWrite})
	if err != nil {
		return false, c.inboxStoreError(ctx, ic, "begin", err)
	}
	ended := false
	defer func() {
		if !ended { // error or panic
			c.rollbackDetached(ctx, tx)
		}
	}()
	isNew, err := c.inboxRecord(ctx, tx, ic, false)
	if err != nil {
		return false, err
	}
	if !isNew {
		// Nothing was written. Should ctx be cancelled now, pgx closes the connection and
		// the server ends the transaction just the same.
		ended = true
		_ = tx.Rollback(ctx)
		return false, nil
	}
	if fnErr := fn(withKey(ctx, c.config.Schema, consumer, messageID, true), tx); fnErr != nil {
		ended = true
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.config.FinishTimeout)
		defer cancel()
		if err := tx.Rollback(rctx); errors.Is(err, pgx.ErrTxClosed) {
			// fn committed or rolled back tx itself and then failed: its error does not say
			// what happened to the message (after a commit the redelivery is skipped), so
			// it is refused as a fn that returns nil is, keeping fn's error in the chain.
			return false, fmt.Errorf("%w (fn returned: %w)", commitRefused("InboxHandle", err), fnErr)
		}
		return false, fnErr
	}
	ended = true
	if err := tx.Commit(ctx); err != nil {
		if refused := commitRefused("InboxHandle", err); refused != nil {
			return false, refused
		}
		return false, c.inboxStoreError(ctx, ic, "commit", err)
	}
	return true, nil
}
