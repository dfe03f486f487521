package pgidemtest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"reflect"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgidem/pgidem/pgidem"
)

// TestingT is the part of testing.TB the helpers use; *testing.T and *testing.B satisfy it.
type TestingT interface {
	Errorf(format string, args ...any)
	FailNow()
	Helper()
}

// RequireOpts are optional checks on the record a helper found. A nil *RequireOpts, or a
// zero field, checks nothing beyond the record's status.
type RequireOpts struct {
	// Attempts, when above 0, is the attempt count the record must have. 1 says the effect
	// started once under the key; more says a holder was taken over after its lease ended
	// (a crashed worker), so the effect may have run more than once
	// ([pgidem.Record.Attempts]).
	Attempts int

	// Result, when not nil, is the value a completed record must store
	// ([RequireCompleted] only). It is encoded with encoding/json, as pgidem encodes the
	// value fn returned, and compared with the stored JSON as a JSON value. Object key
	// order and spacing do not matter. Numbers compare by exact value: 1, 1.0 and 1e0 are
	// equal; the number 42 and the string "42" are not. A json.RawMessage is taken as
	// the JSON it holds, so json.RawMessage("null") expects the result of an fn that
	// returned a nil pointer, slice or map; a []byte is encoded (as base64) like any other
	// value, as pgidem stores it. Given to [RequireFailed], it fails the test.
	Result any

	// Message, when not empty, is the text a failed record's stored error must have
	// ([RequireFailed] only): the message of the error given to [pgidem.Permanent], as
	// [pgidem.StoredFailureError] reports it (cut to 64 KiB when stored). Given to
	// [RequireCompleted], it fails the test.
	Message string
}

// RequireCompleted fails tb unless the key has a completed record within its TTL that
// passes opts, and returns that record (nil after failing tb, for a tb whose FailNow
// returns). It fails tb, too, when opts sets a field that does not apply. And it fails tb
// when the record cannot be read: an invalid key, the store unreachable, pgidem's tables missing, a
// nil coordinator, or a nil tx given to a Tx form. Cancelling ctx stops the read and fails
// tb.
func RequireCompleted(ctx context.Context, tb TestingT, c *pgidem.Coordinator, namespace, key string, opts *RequireOpts) *pgidem.Record {
	tb.Helper()
	return require(tb, pgidem.StatusCompleted, namespace, key, opts, lookup(ctx, c, false, nil, namespace, key))
}

// RequireCompletedTx is [RequireCompleted] reading inside tx, so it sees what tx has
// written and not yet committed.
func RequireCompletedTx(ctx context.Context, tb TestingT, c *pgidem.Coordinator, tx pgx.Tx, namespace, key string, opts *RequireOpts) *pgidem.Record {
	tb.Helper()
	return require(tb, pgidem.StatusCompleted, namespace, key, opts, lookup(ctx, c, true, tx, namespace, key))
}

// RequireFailed fails tb unless the key has a stored failure within its TTL (fn returned a
// [pgidem.Permanent] error, which later calls replay as a [*pgidem.StoredFailureError])
// that passes opts, and returns that record (nil after failing tb). It fails tb, too, when
// the record cannot be read and when opts sets a field that does not apply, as
// [RequireCompleted] does. Cancelling ctx stops the read and fails tb.
func RequireFailed(ctx context.Context, tb TestingT, c *pgidem.Coordinator, namespace, key string, opts *RequireOpts) *pgidem.Record {
	tb.Helper()
	return require(tb, pgidem.StatusFailed, namespace, key, opts, lookup(ctx, c, false, nil, namespace, key))
}

// RequireFailedTx is [RequireFailed] reading inside tx.
func RequireFailedTx(ctx context.Context, tb TestingT, c *pgidem.Coordinator, tx pgx.Tx, namespace, key string, opts *RequireOpts) *pgidem.Record {
	tb.Helper()
	return require(tb, pgidem.StatusFailed, namespace, key, opts, lookup(ctx, c, true, tx, namespace, key))
}

// RequireNoRecord fails tb when the key has a record within its TTL, whatever its status:
// the next call with the key would run its effect. A row past its TTL passes, as it counts
// as absent. It fails tb, too, when the record cannot be read. Cancelling ctx stops the
// read and fails tb.
func RequireNoRecord(ctx context.Context, tb TestingT, c *pgidem.Coordinator, namespace, key string) {
	tb.Helper()
	requireNone(tb, namespace, key, lookup(ctx, c, false, nil, namespace, key))
}

// RequireNoRecordTx is [RequireNoRecord] reading inside tx, so a record tx has written and
// not yet committed counts.
func RequireNoRecordTx(ctx context.Context, tb TestingT, c *pgidem.Coordinator, tx pgx.Tx, namespace, key string) {
	tb.Helper()
	requireNone(tb, namespace, key, lookup(ctx, c, true, tx, namespace, key))
}

// found is the outcome of one lookup.
type found struct {
	rec *pgidem.Record // nil: no row
	err error          // a failed read, not ErrNotFound
}

// lookup reads the record, inside tx when inTx.
func lookup(ctx context.Context, c *pgidem.Coordinator, inTx bool, tx pgx.Tx, namespace, key string) found {
	if c == nil {
		return found{err: errors.New("the coordinator is nil")}
	}
	var rec *pgidem.Record
	var err error
	switch {
	case !inTx:
		rec, err = c.Lookup(ctx, namespace, key)
	case tx == nil:
		// Reading through the pool instead would miss what the test's transaction holds.
		return found{err: errors.New("the transaction is nil")}
	default:
		rec, err = c.LookupTx(ctx, tx, namespace, key)
	}
	if errors.Is(err, pgidem.ErrNotFound) {
		return found{}
	}
	return found{rec: rec, err: err}
}

func require(tb TestingT, want pgidem.Status, namespace, key string, opts *RequireOpts, f found) *pgidem.Record {
	tb.Helper()
	name := namespace + "/" + key
	switch {
	case opts != nil && opts.Result != nil && want != pgidem.StatusCompleted:
		tb.Errorf("pgidemtest: %s: RequireOpts.Result applies to a completed record (RequireCompleted) only", name)
	case opts != nil && opts.Message != "" && want != pgidem.StatusFailed:
		tb.Errorf("pgidemtest: %s: RequireOpts.Message applies to a failed record (RequireFailed) only", name)
	case f.err != nil:
		tb.Errorf("pgidemtest: %s: reading the record: %v", name, f.err)
	case f.rec == nil:
		tb.Errorf("pgidemtest: %s: want a %s record, found none", name, want)
	case f.rec.Expired:
		tb.Errorf("pgidemtest: %s: want a %s record, found one past its TTL (counts as none): %s", name, want, describe(f.rec))
	case f.rec.Status != want:
		tb.Errorf("pgidemtest: %s: want a %s record, found %s", name, want, describe(f.rec))
	default:
		if problems := check(want, opts, f.rec); len(problems) > 0 {
			tb.Errorf("pgidemtest: %s: %s; found %s", name, strings.Join(problems, "; "), describe(f.rec))
			break
		}
		return f.rec
	}
	tb.FailNow()
	return nil
}

func requireNone(tb TestingT, namespace, key string, f found) {
	tb.Helper()
	switch {
	case f.err != nil:
		tb.Errorf("pgidemtest: %s/%s: reading the record: %v", namespace, key, f.err)
	case f.rec != nil && !f.rec.Expired:
		tb.Errorf("pgidemtest: %s/%s: want no record, found %s", namespace, key, describe(f.rec))
	default:
		return
	}
	tb.FailNow()
}

// check returns what in rec does not pass opts, one phrase each.
func check(status pgidem.Status, opts *RequireOpts, rec *pgidem.Record) []string {
	if opts == nil {
		return nil
	}
	var problems []string
	if opts.Attempts > 0 && rec.Attempts != opts.Attempts {
		problems = append(problems, fmt.Sprintf("want attempts %d", opts.Attempts))
	}
	if opts.Result != nil && status == pgidem.StatusCompleted {
		if p := checkResult(opts.Result, rec.Result); p != "" {
			problems = append(problems, p)
		}
	}
	if opts.Message != "" && status == pgidem.StatusFailed {
		var stored struct {
			Message string `json:"message"`
		}
		if err := json.Unmarshal(rec.Error, &stored); err != nil || stored.Message != opts.Message {
			problems = append(problems, fmt.Sprintf("want the stored error %q", opts.Message))
		}
	}
	return problems
}

// checkResult compares a wanted value with a stored JSON result as JSON values; it
// returns what differs, or "".
func checkResult(want any, stored json.RawMessage) string {
	var wantJSON []byte
	if raw, ok := want.(json.RawMessage); ok {
		wantJSON = raw
	} else {
		var err error
		if wantJSON, err = json.Marshal(want); err != nil {
			return fmt.Sprintf("RequireOpts.Result does not encode as JSON: %v", err)
		}
	}
	wantValue, err := decodeJSON(wantJSON)
	if err != nil {
		return fmt.Sprintf("RequireOpts.Result is not valid JSON: %v", err)
	}
	storedValue, err := decodeJSON(stored)
	if err == nil && reflect.DeepEqual(wantValue, storedValue) {
		return ""
	}
	return fmt.Sprintf("want the result %s", compact(wantJSON))
}

// decodeJSON decodes one JSON value with its numbers in a canonical form of their exact
// value.
func decodeJSON(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if dec.More() {
		return nil, errors.New("more than one JSON value")
	}
	return normalizeNumbers(v), nil
}

// exactNumber is a JSON number as the exact rational it denotes, in lowest terms: its own
// type, so that no JSON string equals it.
type exactNumber string

// normalizeNumbers replaces each json.Number with its exactNumber, so that 1, 1.0 and 1e0
// compare equal and two large integers one apart do not.
func normalizeNumbers(v any) any {
	switch v := v.(type) {
	case json.Number:
		if r, ok := new(big.Rat).SetString(v.String()); ok {
			return exactNumber(r.RatString())
		}
		return exactNumber(v.String())
	case []any:
		for i := range v {
			v[i] = normalizeNumbers(v[i])
		}
	case map[string]any:
		for k := range v {
			v[k] = normalizeNumbers(v[k])
		}
	}
	return v
}

// compact returns b without insignificant spaces, for messages; b itself when it is not
// JSON.
func compact(b []byte) string {
	var buf bytes.Buffer
	if json.Compact(&buf, b) != nil {
		return string(b)
	}
	return buf.String()
}

// describe renders rec for a failure message: status, attempts, and what the status
// carries.
func describe(rec *pgidem.Record) string {
	var b strings.Builder
	fmt.Fprintf(&b, "status %s, attempts %d", rec.Status, rec.Attempts)
	switch rec.Status {
	case pgidem.StatusCompleted:
		fmt.Fprintf(&b, ", result %s", compact(rec.Result))
	case pgidem.StatusFailed:
		fmt.Fprintf(&b, ", error %s", compact(rec.Error))
	case pgidem.StatusInProgress:
		fmt.Fprintf(&b, ", lease expires %s", rec.LeaseExpiresAt.UTC().Format(time.RFC3339Nano))
	}
	fmt.Fprintf(&b, ", expires %s", rec.ExpiresAt.UTC().Format(time.RFC3339Nano))
	return b.String()
}
