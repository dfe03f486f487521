package pgidem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

func TestDoBasic(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	fn := func(ctx context.Context) (string, error) {
		ns, key, ok := pgidem.KeyFromContext(ctx)
		if !ok {
			return "", errors.New("no key in context")
		}
		return fmt.Sprintf("%s/%s#%d", ns, key, runs.Add(1)), nil
	}
	first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.False(t, first.Replayed)
	require.Equal(t, 1, first.Attempts)
	require.Equal(t, "mail/order-9.invoice#1", first.Value)

	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "order-9.invoice", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, second.Replayed)
	require.Equal(t, first.Value, second.Value)
	require.EqualValues(t, 1, runs.Load())

	rec := b.lookup(t, "mail", "order-9.invoice")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"mail/order-9.invoice#1"`, string(rec.Result))
	require.WithinDuration(t, rec.CompletedAt.Add(testTTL), rec.ExpiresAt, time.Second, "TTL counts from completion")

	_, err = b.coord.Lookup(b.ctx, "mail", "nope")
	require.ErrorIs(t, err, pgidem.ErrNotFound)

	_, _, ok := pgidem.KeyFromContext(b.ctx)
	require.False(t, ok)
}

func TestConcurrentCallers(t *testing.T) {
	t.Parallel()
	const callers = 32

	t.Run("Wait", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		var runs atomic.Int32
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range callers {
			wg.Go(func() {
				<-start
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
					n := runs.Add(1)
					time.Sleep(50 * time.Millisecond) // keep the others in flight
					return fmt.Sprintf("em_%d", n), nil
				})
			})
		}
		close(start)
		wg.Wait()
		require.EqualValues(t, 1, runs.Load(), "fn ran once")
		for i := range callers {
			require.NoError(t, errs[i])
			require.Equal(t, "em_1", values[i], "caller %d", i)
		}
	})

	t.Run("Raise", func(t *testing.T) {
		t.Parallel()
		b := setup(t, &pgidem.Config{InFlight: pgidem.InFlightRaise})
		var runs, answered atomic.Int32
		release := make(chan struct{})
		values := make([]string, callers)
		errs := make([]error, callers)
		var wg sync.WaitGroup
		for i := range callers {
			wg.Go(func() {
				values[i], errs[i] = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
					runs.Add(1)
					<-release // hold the key until every other caller has answered
					return "em_1", nil
				})
				if errs[i] != nil && answered.Add(1) == callers-1 {
					close(release)
				}
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, runs.Load())
		var ok, inProgress int
		for i := range callers {
			if errs[i] == nil {
				ok++
				require.Equal(t, "em_1", values[i])
				continue
			}
			var ipe *pgidem.InProgressError
			require.ErrorAs(t, errs[i], &ipe)
			require.ErrorIs(t, errs[i], pgidem.ErrInProgress)
			require.Positive(t, ipe.RetryAfter)
			inProgress++
		}
		require.Equal(t, 1, ok)
		require.Equal(t, callers-1, inProgress)
	})

	t.Run("ManyKeys", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		const keys = 16
		var runs [keys]atomic.Int32
		var wg sync.WaitGroup
		errs := make(chan error, keys*4)
		for i := range keys * 4 {
			wg.Go(func() {
				k := i % keys
				v, err := pgidem.Do(b.ctx, b.coord, "mail", fmt.Sprintf("order-%d.invoice", k), testTTL, nil,
					func(context.Context) (int, error) {
						runs[k].Add(1)
						time.Sleep(20 * time.Millisecond)
						return k, nil
					})
				if err == nil && v != k {
					err = fmt.Errorf("key %d got value %d", k, v)
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
		for k := range keys {
			require.EqualValues(t, 1, runs[k].Load(), "key %d", k)
		}
		require.Equal(t, keys, b.count(t))
	})
}

func TestWaiterCancelledChangesNothing(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	h := b.hold(b.coord, "mail", "k", nil, "holder")
	before := b.lookup(t, "mail", "k")

	ctx, cancel := context.WithCancel(b.ctx)
	waitErr := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
			return "waiter", nil
		})
		waitErr <- err
	}()
	time.Sleep(50 * time.Millisecond) // let the waiter poll at least once
	cancel()
	require.ErrorIs(t, <-waitErr, context.Canceled)

	// A rejected (Raise) caller and a waiter that timed out never touch the holder's row.
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightRaise},
		func(context.Context) (string, error) { return "raise", nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{WaitTimeout: 30 * time.Millisecond},
		func(context.Context) (string, error) { return "timeout", nil })
	var ipe *pgidem.InProgressError
	require.ErrorAs(t, err, &ipe)
	require.True(t, ipe.Waited)

	after := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusInProgress, after.Status)
	require.Equal(t, before.Attempts, after.Attempts)
	require.Equal(t, before.CreatedAt, after.CreatedAt)

	h.unblock()
	require.NoError(t, <-h.done)
	rec := b.lookup(t, "mail", "k")
	require.JSONEq(t, `"holder"`, string(rec.Result))
}

func TestLeaseLostHolderCannotOverwrite(t *testing.T) {
	t.Parallel()
	const lease = 300 * time.Millisecond
	b := setup(t, &pgidem.Config{Lease: lease})

	started := make(chan struct{})
	type outcome struct {
		value string
		err   error
		cause error
	}
	first := make(chan outcome, 1)
	go func() {
		var cause error
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
			close(started)
			<-ctx.Done() // a stalled holder: only the heartbeat's verdict ends it
			cause = context.Cause(ctx)
			return "stale", nil
		})
		first <- outcome{v, err, cause}
	}()
	<-started
	// Simulate the stall that outlived the lease: expire it, then let a second caller take
	// over before the first holder's heartbeat runs again.
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second'`)
	require.NoError(t, err)
	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
		return "fresh", nil
	})
	require.NoError(t, err)
	require.True(t, second.TookOver)
	require.Equal(t, 2, second.Attempts)

	got := <-first
	require.ErrorIs(t, got.cause, pgidem.ErrLeaseLost, "fn's context is cancelled with cause ErrLeaseLost")
	require.ErrorIs(t, got.err, pgidem.ErrLeaseLost)
	require.Equal(t, "stale", got.value, "the value comes back with the error")

	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, `"fresh"`, string(rec.Result), "the taken-over holder did not overwrite")
	require.Equal(t, 2, rec.Attempts)
}

func TestExpiredRecordIsAbsent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for i, status := range []string{"completed", "failed", "in_progress"} {
		key := "k-" + status
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
			(namespace, key, status, owner, attempts, fingerprint, result, error, lease_expires_at, expires_at)
			VALUES ('mail', $1, $2, gen_random_uuid(), 3, '\xaa', '"old"',
				CASE WHEN $2 = 'failed' THEN '{"message":"old"}'::jsonb END,
				CASE WHEN $2 = 'in_progress' THEN now() + interval '1 hour' END,
				now() - interval '1 second')`, key, status)
		require.NoError(t, err, status)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", key, testTTL,
			&pgidem.DoOpts{Fingerprint: []byte{0xbb}}, func(context.Context) (int, error) { return i, nil })
		require.NoError(t, err, status)
		require.False(t, res.Replayed, status)
		require.False(t, res.TookOver, "an expired record is not a takeover")
		require.Equal(t, 1, res.Attempts, status)
		rec := b.lookup(t, "mail", key)
		require.Equal(t, []byte{0xbb}, rec.Fingerprint, "the new fingerprint binds")
		require.False(t, rec.Expired)
	}
}

func TestReplayExactValues(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	type receipt struct {
		ID    string
		Count int
		Tags  []string
		Ptr   *int
	}
	big := strings.Repeat("x", 1<<20)

	check := func(t *testing.T, key string, want any, run func(key string) (any, bool, error)) {
		t.Helper()
		got, replayed, err := run(key)
		require.NoError(t, err)
		require.False(t, replayed)
		require.Equal(t, want, got)
		got, replayed, err = run(key)
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, want, got, "replay of %s", key)
	}
	do := func(v any) func(string) (any, bool, error) {
		return func(key string) (any, bool, error) {
			switch v := v.(type) {
			case int:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (int, error) { return v, nil })
				return r.Value, r.Replayed, err
			case string:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (string, error) { return v, nil })
				return r.Value, r.Replayed, err
			case *receipt:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (*receipt, error) { return v, nil })
				return r.Value, r.Replayed, err
			case receipt:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (receipt, error) { return v, nil })
				return r.Value, r.Replayed, err
			case []string:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) ([]string, error) { return v, nil })
				return r.Value, r.Replayed, err
			case map[string]any:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (map[string]any, error) { return v, nil })
				return r.Value, r.Replayed, err
			case struct{}:
				r, err := pgidem.DoResult(b.ctx, b.coord, "t", key, testTTL, nil, func(context.Context) (struct{}, error) { return v, nil })
				return r.Value, r.Replayed, err
			}
			panic(fmt.Sprintf("unhandled %T", v))
		}
	}
	seven := 7
	for _, tc := range []struct {
		name string
		v    any
	}{
		{"ZeroInt", 0},
		{"EmptyString", ""},
		{"NilPointer", (*receipt)(nil)},
		{"ZeroStruct", receipt{}},
		{"FullStruct", receipt{ID: "em_1", Count: 2, Tags: []string{"a", "b"}, Ptr: &seven}},
		{"EmptySlice", []string{}},
		{"NilSlice", []string(nil)},
		{"NilMap", map[string]any(nil)},
		{"JSONNullInMap", map[string]any{"a": nil}},
		{"EmptyStruct", struct{}{}},
		{"OneMiB", big},
		{"Unicode", "ünïcødé \u2028 \t"},
	} {
		check(t, tc.name, tc.v, do(tc.v))
	}

	t.Run("NotStorable", func(t *testing.T) {
		var runs int
		fn := func(context.Context) (string, error) { runs++; return "nul\x00byte", nil }
		v, err := pgidem.Do(b.ctx, b.coord, "t", "nul-result", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		require.Equal(t, "nul\x00byte", v, "the caller still gets the value")
		_, err = pgidem.Do(b.ctx, b.coord, "t", "nul-result", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "replayed, not re-run")
		require.Equal(t, 1, runs)
	})

	t.Run("EscapedReplacementCharacter", func(t *testing.T) {
		// A \ufffd escape that JSON carries on purpose (a json.RawMessage) is a valid
		// U+FFFD and is stored; one encoding/json wrote for invalid UTF-8 is not. The first
		// used to be refused like the second, losing fn's value.
		raw := json.RawMessage(`{"name":"\ufffd"}`)
		v, err := pgidem.Do(b.ctx, b.coord, "t", "fffd-raw", testTTL, nil,
			func(context.Context) (json.RawMessage, error) { return raw, nil })
		require.NoError(t, err)
		require.Equal(t, raw, v)
		v, err = pgidem.Do(b.ctx, b.coord, "t", "fffd-raw", testTTL, nil,
			func(context.Context) (json.RawMessage, error) { panic("replayed, not run") })
		require.NoError(t, err)
		require.JSONEq(t, string(raw), string(v))
		_, err = pgidem.DoInTx(b.ctx, b.coord, "t", "fffd-raw-tx", testTTL, nil,
			func(context.Context, pgx.Tx) (json.RawMessage, error) { return raw, nil })
		require.NoError(t, err)

		_, err = pgidem.Do(b.ctx, b.coord, "t", "fffd-invalid", testTTL, nil,
			func(context.Context) (string, error) { return "bad \xff byte", nil })
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		require.ErrorContains(t, err, "not valid UTF-8")
	})

	t.Run("TooLarge", func(t *testing.T) {
		// Over Config.MaxValueBytes (16 MiB by default) a result is not storable before it
		// reaches Postgres, which can refuse a large document with an internal error
		// (XX000) that looked like an outage: the record stayed in progress and the effect
		// ran again after the lease.
		runs := 0
		huge := strings.Repeat("x", pgidem.MaxValueBytesDefault)
		fn := func(context.Context) (string, error) { runs++; return huge, nil }
		_, err := pgidem.Do(b.ctx, b.coord, "t", "too-large", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		require.ErrorContains(t, err, "Config.MaxValueBytes")
		_, err = pgidem.Do(b.ctx, b.coord, "t", "too-large", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "replayed, not re-run")
		require.Equal(t, 1, runs)

		small := b.newCoord(t, &pgidem.Config{MaxValueBytes: 100})
		_, err = pgidem.DoInTx(b.ctx, small, "t", "too-large-tx", testTTL, nil,
			func(context.Context, pgx.Tx) (string, error) { return strings.Repeat("x", 100), nil })
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		_, err = pgidem.DoInTx(b.ctx, small, "t", "fits-tx", testTTL, nil,
			func(context.Context, pgx.Tx) (string, error) { return strings.Repeat("x", 98), nil })
		require.NoError(t, err, "98 characters and two quotes are 100 bytes")
	})

	t.Run("DeeperThanAReplayDecodes", func(t *testing.T) {
		// jsonb stores about 14 000 levels, but encoding/json decodes 10 000: a deeper
		// result was stored and then failed every replay with a decoding error.
		nest := func(depth int) any {
			v := any(1)
			for range depth {
				v = []any{v}
			}
			return v
		}
		runs := 0
		fn := func(context.Context) (any, error) { runs++; return nest(10_500), nil }
		_, err := pgidem.Do(b.ctx, b.coord, "t", "deep", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		_, err = pgidem.Do(b.ctx, b.coord, "t", "deep", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "replayed, not re-run")
		require.Equal(t, 1, runs)

		fn = func(context.Context) (any, error) { runs++; return nest(9_999), nil }
		_, err = pgidem.Do(b.ctx, b.coord, "t", "deep-enough", testTTL, nil, fn)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "t", "deep-enough", testTTL, nil, fn)
		require.NoError(t, err, "replays")
	})

	t.Run("RejectedByJSONB", func(t *testing.T) {
		// Valid JSON that jsonb refuses: found only by the write, after the effect ran.
		for _, raw := range []string{`"\ud800"`, `1e1000000`} {
			runs := 0
			fn := func(context.Context) (json.RawMessage, error) { runs++; return json.RawMessage(raw), nil }
			_, err := pgidem.Do(b.ctx, b.coord, "t", "jsonb-"+raw, testTTL, nil, fn)
			require.ErrorIs(t, err, pgidem.ErrResultNotStorable, raw)
			_, err = pgidem.Do(b.ctx, b.coord, "t", "jsonb-"+raw, testTTL, nil, fn)
			require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "replayed, not re-run: %s", raw)
			require.Equal(t, 1, runs, raw)
		}
	})

	t.Run("TooDeepForJSONB", func(t *testing.T) {
		// Nesting encoding/json writes but jsonb refuses with a program limit (SQLSTATE
		// 54001, stack depth), not a data exception: still not storable, never retried as
		// an outage (which left the record in progress and the effect to run again).
		runs := 0
		fn := func(context.Context) (any, error) {
			runs++
			v := any([]any{})
			for range 50000 {
				v = []any{v}
			}
			return v, nil
		}
		_, err := pgidem.Do(b.ctx, b.coord, "t", "too-deep", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
		_, err = pgidem.Do(b.ctx, b.coord, "t", "too-deep", testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "replayed, not re-run")
		require.Equal(t, 1, runs)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "t", "too-deep").Status)
	})
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	// Long enough that a loaded machine's stall never lets the InProgress case take the
	// holder's record over; no case waits for a lease to end.
	const lease = 2 * time.Second
	b := setup(t, &pgidem.Config{Lease: lease, InFlight: pgidem.InFlightRaise})
	fpA, fpB := &pgidem.DoOpts{Fingerprint: []byte("A")}, &pgidem.DoOpts{Fingerprint: []byte("B")}
	ok := func(context.Context) (string, error) { return "v", nil }
	mustNotRun := func(context.Context) (string, error) { t.Error("fn ran on a mismatch"); return "", nil }

	t.Run("Replay", func(t *testing.T) {
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpA, ok)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpB, mustNotRun)
		var fme *pgidem.FingerprintMismatchError
		require.ErrorAs(t, err, &fme)
		require.Equal(t, pgidem.StatusCompleted, fme.Status)
		v, err := pgidem.Do(b.ctx, b.coord, "fp", "done", testTTL, fpA, mustNotRun)
		require.NoError(t, err)
		require.Equal(t, "v", v)
		require.Equal(t, []byte("A"), b.lookup(t, "fp", "done").Fingerprint, "survives completion")
	})

	t.Run("InProgress", func(t *testing.T) {
		h := b.hold(b.coord, "fp", "running", fpA, "v")
		_, err := pgidem.Do(b.ctx, b.coord, "fp", "running", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "running", testTTL, fpA, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrInProgress)
		h.unblock()
		require.NoError(t, <-h.done)
	})

	t.Run("Takeover", func(t *testing.T) {
		_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
			(namespace, key, status, owner, fingerprint, lease_expires_at, expires_at)
			VALUES ('fp', 'dead', 'in_progress', gen_random_uuid(), 'A', now() - interval '1 second', now() + interval '1 hour')`)
		require.NoError(t, err)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "dead", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
		require.Equal(t, 1, b.lookup(t, "fp", "dead").Attempts, "a mismatching caller does not take over")
		res, err := pgidem.DoResult(b.ctx, b.coord, "fp", "dead", testTTL, &pgidem.DoOpts{}, ok)
		require.NoError(t, err, "no fingerprint given: no check")
		require.True(t, res.TookOver)
		require.Equal(t, []byte("A"), b.lookup(t, "fp", "dead").Fingerprint, "survives takeover")
	})

	// A record released after a takeover is kept, and so is its fingerprint: the dead
	// holder may have run the effect for payload A. A released first reservation is
	// deleted and binds nothing.
	t.Run("ReleasedAfterTakeover", func(t *testing.T) {
		fail := func(context.Context) (string, error) { return "", errors.New("fn failed") }
		b.insertDeadHolder(t, "fp", "kept", []byte("A"))
		res, err := pgidem.DoResult(b.ctx, b.coord, "fp", "kept", testTTL, fpA, fail)
		require.EqualError(t, err, "fn failed")
		require.True(t, res.TookOver)
		_, err = pgidem.Do(b.ctx, b.coord, "fp", "kept", testTTL, fpB, mustNotRun)
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)

		_, err = pgidem.Do(b.ctx, b.coord, "fp", "first", testTTL, fpA, fail)
		require.EqualError(t, err, "fn failed")
		v, err := pgidem.Do(b.ctx, b.coord, "fp", "first", testTTL, fpB, ok)
		require.NoError(t, err)
		require.Equal(t, "v", v)
	})
}

func TestInvalidInput(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		name      string
		namespace string
		key       string
		ttl       time.Duration
		opts      *pgidem.DoOpts
		want      error
	}{
		{"EmptyNamespace", "", "k", testTTL, nil, pgidem.ErrInvalidKey},
		{"EmptyKey", "ns", "", testTTL, nil, pgidem.ErrInvalidKey},
		{"NUL", "ns", "order-9\x00invoice", testTTL, nil, pgidem.ErrInvalidKey},
		{"NULNamespace", "n\x00s", "k", testTTL, nil, pgidem.ErrInvalidKey},
		{"Newline", "ns", "order-9\ninvoice", testTTL, nil, pgidem.ErrInvalidKey},
		{"Escape", "ns", "k\x1b[31m", testTTL, nil, pgidem.ErrInvalidKey},
		{"DEL", "ns", "k\x7f", testTTL, nil, pgidem.ErrInvalidKey},
		{"C1Control", "ns", "k\u0085", testTTL, nil, pgidem.ErrInvalidKey},
		{"InvalidUTF8", "ns", "k\xff\xfe", testTTL, nil, pgidem.ErrInvalidKey},
		{"TruncatedUTF8", "ns", "k\xc3", testTTL, nil, pgidem.ErrInvalidKey},
		{"Key256Bytes", "ns", strings.Repeat("k", 256), testTTL, nil, pgidem.ErrInvalidKey},
		{"Namespace65Bytes", strings.Repeat("n", 65), "k", testTTL, nil, pgidem.ErrInvalidKey},
		{"TTLBelowMin", "ns", "k", time.Minute - time.Millisecond, nil, pgidem.ErrInvalidTTL},
		{"TTLZero", "ns", "k", 0, nil, pgidem.ErrInvalidTTL},
		{"TTLNegative", "ns", "k", -time.Hour, nil, pgidem.ErrInvalidTTL},
		{"LeaseEqualsTTL", "ns", "k", 2 * time.Minute, &pgidem.DoOpts{Lease: 2 * time.Minute}, pgidem.ErrInvalidTTL},
		{"LeaseAboveTTL", "ns", "k", 2 * time.Minute, &pgidem.DoOpts{Lease: time.Hour}, pgidem.ErrInvalidTTL},
		{"LeaseTooShort", "ns", "k", testTTL, &pgidem.DoOpts{Lease: time.Millisecond}, pgidem.ErrInvalidTTL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ran := false
			_, err := pgidem.Do(b.ctx, b.coord, tc.namespace, tc.key, tc.ttl, tc.opts, func(context.Context) (int, error) {
				ran = true
				return 1, nil
			})
			require.ErrorIs(t, err, tc.want)
			require.False(t, ran, "fn must not run for invalid input")
		})
	}
	var ike *pgidem.InvalidKeyError
	_, err := pgidem.Do(b.ctx, b.coord, "ns", "a\x00b", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorAs(t, err, &ike)
	require.Equal(t, "key", ike.Field)
	require.Contains(t, ike.Error(), "U+0000")
	require.Equal(t, 0, b.count(t), "nothing stored")

	// Valid edge cases: no character is reserved, exactly at the limit.
	for _, key := range []string{"order-9:invoice", "a/b\\c%_*'\"", strings.Repeat("k", 255), "ünï 🧾", " "} {
		_, err := pgidem.Do(b.ctx, b.coord, strings.Repeat("n", 64), key, testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err, "%q", key)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		cfg   pgidem.Config
		field string
	}{
		{pgidem.Config{Lease: time.Millisecond}, "Config.Lease"},
		{pgidem.Config{Lease: time.Minute, MinTTL: time.Minute}, "Config.MinTTL"},
		{pgidem.Config{InFlight: 7}, "Config.InFlight"},
		{pgidem.Config{WaitTimeout: -1}, "Config.WaitTimeout"},
		{pgidem.Config{PollIntervalMin: time.Second, PollIntervalMax: time.Millisecond}, "Config.PollIntervalMin"},
		{pgidem.Config{MaxKeyBytes: 4000}, "Config.MaxKeyBytes"},
		// The sum must not overflow into a negative number that passes the check.
		{pgidem.Config{MaxKeyBytes: math.MaxInt}, "Config.MaxKeyBytes"},
		{pgidem.Config{MaxKeyBytes: 1 << 62, MaxNamespaceBytes: 1 << 62}, "Config.MaxKeyBytes"},
		{pgidem.Config{MaxValueBytes: -1}, "Config.MaxValueBytes"},
		{pgidem.Config{FinishTimeout: time.Nanosecond}, "Config.FinishTimeout"},
		{pgidem.Config{FinishTimeout: -1}, "Config.FinishTimeout"},
		{pgidem.Config{MaxValueBytes: pgidem.MaxValueBytesMax + 1}, "Config.MaxValueBytes"},
		// pgx.Identifier would drop the NUL and use schema "public" instead.
		{pgidem.Config{Schema: "pub\x00lic"}, "Config.Schema"},
		{pgidem.Config{Schema: "\xff"}, "Config.Schema"},
		{pgidem.Config{Schema: strings.Repeat("s", pgidem.SchemaMaxBytes+1)}, "Config.Schema"},
		{pgidem.Config{Schema: "   "}, "Config.Schema"}, // migrations.CheckSchemaName refuses it too
	} {
		_, err := pgidem.NewCoordinator(b.db.Pool, &tc.cfg)
		require.ErrorContains(t, err, tc.field)
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	}
	_, err := pgidem.NewCoordinator(nil, nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{Schema: strings.Repeat("s", pgidem.SchemaMaxBytes)})
	require.NoError(t, err)
	cfg := b.coord.Config()
	require.Equal(t, pgidem.LeaseDefault, cfg.Lease)
	require.Equal(t, pgidem.MinTTLDefault, cfg.MinTTL)
	require.Equal(t, pgidem.InFlightWait, cfg.InFlight)
}

func TestStoreUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// Nothing listens on port 1.
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	t.Run("ClosedPort", func(t *testing.T) {
		coord, err := pgidem.NewCoordinator(pool, nil)
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		var se *pgidem.StoreError
		require.ErrorAs(t, err, &se)
		require.Equal(t, "reserve", se.Op)
		require.False(t, ran)
	})

	t.Run("FailOpen", func(t *testing.T) {
		var logs bytes.Buffer
		var mu sync.Mutex
		var events []pgidem.EventKind
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{
			FailOpen: true,
			Logger:   slog.New(slog.NewTextHandler(&syncWriter{w: &logs, mu: &mu}, nil)),
			Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
				mu.Lock()
				events = append(events, e.Kind)
				mu.Unlock()
			}),
		})
		require.NoError(t, err)
		res, err := pgidem.DoResult(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 42, nil })
		require.NoError(t, err)
		require.Equal(t, 42, res.Value)
		require.True(t, res.FailedOpen)
		mu.Lock()
		defer mu.Unlock()
		require.Contains(t, logs.String(), "level=WARN")
		require.Contains(t, logs.String(), "unprotected")
		require.Contains(t, events, pgidem.EventFailOpen)
	})

	t.Run("ServerErrorNeverFailsOpen", func(t *testing.T) {
		// The server answers, but pgidem's table is missing: a misconfiguration, not an
		// outage, so FailOpen must not quietly turn deduplication off.
		db := testdb.NewUnmigrated(t)
		coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{FailOpen: true})
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
		require.ErrorContains(t, err, "migrations")
		require.False(t, ran)

		// A schema that does not exist, and a sweep: the same.
		coord, err = pgidem.NewCoordinator(db.Pool, &pgidem.Config{Schema: "nosuch"})
		require.NoError(t, err)
		_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
		require.False(t, ran)
		_, err = coord.Sweep(ctx, nil)
		require.ErrorIs(t, err, pgidem.ErrNotMigrated)
	})

	t.Run("InvalidKeyNeverFailsOpen", func(t *testing.T) {
		coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: true})
		require.NoError(t, err)
		ran := false
		_, err = pgidem.Do(ctx, coord, "mail", "bad\x00key", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrInvalidKey)
		require.False(t, ran)
	})
}

type syncWriter struct {
	w  *bytes.Buffer
	mu *sync.Mutex
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}

func TestBackendTerminatedBeforeFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// A pool of one connection whose backend an admin (or a failover) has terminated.
	pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	var pid int
	require.NoError(t, pool.QueryRow(b.ctx, "SELECT pg_backend_pid()").Scan(&pid))
	var terminated bool
	require.NoError(t, b.db.Pool.QueryRow(b.ctx, "SELECT pg_terminate_backend($1, 5000)", pid).Scan(&terminated))
	require.True(t, terminated)

	// Read first: the read fails on the dead connection. (A reserving insert that starts a
	// call instead counts the failure as a lost reply and runs again on a new connection.)
	coord := b.newCoordOn(t, pool, &pgidem.Config{Order: pgidem.OrderReadFirst})
	ran := false
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { ran = true; return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.False(t, ran, "fn must not run when the reservation could not be made")

	// The pool replaces the dead connection; the next delivery reserves and runs.
	v, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 2, nil })
	require.NoError(t, err)
	require.Equal(t, 2, v)
}

// With every connection of the pool in use, a call whose context ends before it gets one
// returns the context's error at once, with nothing sent, whichever statement it starts
// with; the reserving statement used to wait on its detached context (FinishTimeout, twice
// through the lost-reply check) and return a store error.
func TestPoolExhaustedBeforeFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		name         string
		maxBatch     int
		reserveFirst bool
	}{
		{"Read", 0, false},
		{"ReserveFirst", 0, true},
		{"ReserveFirstUnbatched", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancelCause(b.ctx)
			defer cancel(nil)
			var armed, waited atomic.Bool
			tracer := &acquireSignal{onAcquire: func(actx context.Context) {
				// The call is waiting for the pool's only connection: its caller leaves.
				if armed.Load() && actx.Value(testCallKey{}) != nil {
					waited.Store(true)
					time.AfterFunc(20*time.Millisecond, func() { cancel(nil) }) // let it block in the pool first
				}
			}}
			pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1; c.ConnConfig.Tracer = tracer })
			coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: tc.maxBatch, FinishTimeout: time.Minute})
			held, err := pool.Acquire(b.ctx)
			require.NoError(t, err)
			defer held.Release() // before the pool's cleanup closes it, should a check fail
			armed.Store(true)

			ran := false
			_, err = pgidem.Do(context.WithValue(ctx, testCallKey{}, true), coord, "mail", tc.name, testTTL, &pgidem.DoOpts{ReserveFirst: tc.reserveFirst},
				func(context.Context) (int, error) { ran = true; return 1, nil })
			require.True(t, waited.Load(), "the call waited for a connection")
			require.ErrorIs(t, err, context.Canceled)
			require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, "the caller's cancellation, not the store's failure")
			require.False(t, ran)
			held.Release()

			rec, err := coord.Lookup(b.ctx, "mail", tc.name)
			require.ErrorIs(t, err, pgidem.ErrNotFound, "nothing was sent: no reservation is left behind (%+v)", rec)
			v, err := pgidem.Do(b.ctx, coord, "mail", tc.name, testTTL, &pgidem.DoOpts{ReserveFirst: tc.reserveFirst},
				func(context.Context) (int, error) { return 2, nil })
			require.NoError(t, err)
			require.Equal(t, 2, v)
		})
	}
}

// With every connection of the pool in use and a caller whose context has no deadline (a
// consumer loop), a call fails after FinishTimeout instead of waiting for ever, whichever
// statement it starts with, and its error says the pool had no connection to spare: the
// usual cause is handlers holding connections while they call Do (InboxHandle), not the
// server. The indexed read a call starts with used to wait as long as ctx allowed.
func TestPoolExhaustedFailsAfterFinishTimeout(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, reserveFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("ReserveFirst=%v", reserveFirst), func(t *testing.T) {
			t.Parallel()
			pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 2 })
			coord := b.newCoordOn(t, pool, &pgidem.Config{FinishTimeout: 300 * time.Millisecond})
			for range 2 {
				held, err := pool.Acquire(b.ctx)
				require.NoError(t, err)
				defer held.Release()
			}
			done := make(chan error, 1)
			ran := false
			go func() {
				_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: reserveFirst},
					func(context.Context) (int, error) { ran = true; return 1, nil })
				done <- err
			}()
			select {
			case err := <-done:
				require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
				require.ErrorIs(t, err, context.DeadlineExceeded)
				require.Contains(t, err.Error(), "none of the pool's 2 became free in time")
				require.False(t, ran)
			case <-time.After(20 * time.Second):
				t.Fatal("the call still waits for a connection")
			}
		})
	}
}

// A statement that got its connection and then waited on the server (a table lock held by
// a migration, say) times out after FinishTimeout without the pool hint: resizing the
// pool would not help.
func TestServerWaitIsNotBlamedOnThePool(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	locker := b.begin(t)
	_, err := locker.Exec(b.ctx, `LOCK TABLE pgidem_record IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	pool := b.newPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	// Without ReserveFirst the call reads first.
	coord := b.newCoordOn(t, pool, &pgidem.Config{FinishTimeout: 300 * time.Millisecond, Order: pgidem.OrderReadFirst})
	for _, reserveFirst := range []bool{false, true} {
		_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: reserveFirst},
			func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
		require.NotContains(t, err.Error(), "became free", "ReserveFirst=%v", reserveFirst)
	}
	require.NoError(t, locker.Rollback(b.ctx))

	// A server that accepts connections and never answers: the pool has connections to
	// spare, and the wait is for one being dialled.
	blackhole, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer blackhole.Close()
	go func() {
		for {
			conn, err := blackhole.Accept()
			if err != nil {
				return
			}
			defer conn.Close() // held open, never answered, until the listener closes
		}
	}()
	silent := b.newPool(t, func(c *pgxpool.Config) {
		c.MaxConns = 4
		c.ConnConfig.ConnectTimeout = 2 * time.Second
		c.ConnConfig.DialFunc = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", blackhole.Addr().String())
		}
	})
	coord = b.newCoordOn(t, silent, &pgidem.Config{FinishTimeout: 300 * time.Millisecond})
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.NotContains(t, err.Error(), "became free", "a connection being dialled is the server's wait")
}

// A caller whose context ends while its reserving statement waits on the server (behind an
// open transaction's record for the key), on a pool whose only connection another
// goroutine is queued for, releases the reservation its statement then makes on that same
// connection. The release used to need a second connection: the queued goroutine got the
// freed one, the release failed after FinishTimeout, and the key stayed in progress for a
// lease, then counted a takeover (attempts 2) that never was. And when that release fails
// on the kept connection (it broke), the connection is given back before the release is
// tried again on the pool, whose only connection it was.
func TestCancelledReservationReleasedOnItsConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	for _, tc := range []struct {
		name          string
		maxBatch      int
		queued, broke bool
	}{
		{"Queued", 1, true, false},
		{"QueuedBatching", 0, true, false},
		{"ReleaseConnectionBroke", 1, false, true},
		{"ReleaseConnectionBrokeBatching", 0, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) { // one at a time: the wait below counts the database's waiters
			key := tc.name
			d := &lostReplyDialer{marker: []byte("WITH deleted AS"), unsent: true}
			d.fired.Store(!tc.broke)
			hogQueued := make(chan struct{})
			tracer := &acquireSignal{onAcquire: func(actx context.Context) {
				if actx.Value(hogKey{}) != nil {
					close(hogQueued)
				}
			}}
			pool := b.dialerPool(t, d, func(cfg *pgxpool.Config) { cfg.MaxConns = 1; cfg.ConnConfig.Tracer = tracer })
			coord := b.newCoordOn(t, pool, &pgidem.Config{MaxBatch: tc.maxBatch, FinishTimeout: 10 * time.Second})
			tx, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(b.ctx) }()
			_, err = tx.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
				VALUES ('mail', $1, 'in_progress', gen_random_uuid(), now() + interval '1 minute', now() + interval '1 hour')`, key)
			require.NoError(t, err)

			ctx, cancel := context.WithCancel(b.ctx)
			done := make(chan error, 1)
			go func() {
				_, err := pgidem.Do(ctx, coord, "mail", key, testTTL, &pgidem.DoOpts{ReserveFirst: true},
					func(context.Context) (int, error) { return 1, nil })
				done <- err
			}()
			// The reserving insert waits for the open transaction: under batching, its own
			// statement, once the shared round gave up at its lock timeout.
			require.Eventually(t, func() bool {
				var waiting int
				err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
					WHERE datname = current_database() AND wait_event_type = 'Lock'
						AND query NOT LIKE '%set_config(''lock_timeout''%'`).Scan(&waiting)
				return err == nil && waiting == 1
			}, 30*time.Second, 5*time.Millisecond)
			hogged := make(chan *pgxpool.Conn, 1)
			waitedBefore := pool.Stat().EmptyAcquireCount()
			if tc.queued {
				go func() {
					conn, err := pool.Acquire(context.WithValue(b.ctx, hogKey{}, true)) // queued for the only connection
					if err != nil {
						conn = nil
					}
					hogged <- conn
				}()
				<-hogQueued // its Acquire started, on a pool whose only connection the call holds
			}
			cancel()
			require.NoError(t, tx.Rollback(b.ctx)) // the insert now reserves the key
			require.ErrorIs(t, <-done, context.Canceled)
			if tc.broke {
				require.True(t, d.fired.Load(), "the release's first attempt broke its connection")
			}
			if tc.queued {
				conn := <-hogged
				require.NotNil(t, conn)
				require.Greater(t, pool.Stat().EmptyAcquireCount(), waitedBefore, "the other goroutine waited for the connection")
				conn.Release()
			}
			rec, err := coord.Lookup(b.ctx, "mail", key)
			if err == nil {
				require.NotEqual(t, pgidem.StatusInProgress, rec.Status, "the reservation was left in progress (%+v)", rec)
			} else {
				require.ErrorIs(t, err, pgidem.ErrNotFound)
			}
		})
	}
}

func TestBackendTerminatedDuringFn(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(ctx context.Context) (string, error) {
		// Kill every connection the pool holds, as a failover or an admin would.
		_, err := b.db.Pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`)
		if err != nil {
			return "", err
		}
		return "sent", nil
	})
	require.NoError(t, err, "the finishing write retries on a fresh connection")
	require.Equal(t, "sent", v)
	require.JSONEq(t, `"sent"`, string(b.lookup(t, "mail", "k").Result))
}

func TestErrors(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	t.Run("OrdinaryErrorReleases", func(t *testing.T) {
		boom := errors.New("smtp timeout")
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "retry", testTTL, nil, func(context.Context) (int, error) { return 0, boom })
		require.Same(t, boom, err, "returned unchanged")
		_, err = b.coord.Lookup(b.ctx, "mail", "retry")
		require.ErrorIs(t, err, pgidem.ErrNotFound, "released")
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "retry", testTTL, nil, func(context.Context) (int, error) { return 2, nil })
		require.NoError(t, err)
		require.Equal(t, 2, v, "the next call runs fn")
	})

	t.Run("PermanentErrorReplays", func(t *testing.T) {
		declined := errors.New("card declined")
		_, err := pgidem.Do(b.ctx, b.coord, "pay", "order-9", testTTL, nil, func(context.Context) (int, error) {
			return 0, pgidem.Permanent(declined)
		})
		require.ErrorIs(t, err, declined)
		require.ErrorIs(t, err, pgidem.ErrPermanent)
		res, err := pgidem.DoResult(b.ctx, b.coord, "pay", "order-9", testTTL, nil, func(context.Context) (int, error) {
			t.Error("fn ran after a permanent failure")
			return 1, nil
		})
		require.True(t, res.Replayed)
		require.ErrorIs(t, err, pgidem.ErrPermanent)
		var sfe *pgidem.StoredFailureError
		require.ErrorAs(t, err, &sfe)
		require.Equal(t, "card declined", sfe.Message)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "pay", "order-9").Status)
		require.Nil(t, pgidem.Permanent(nil))
	})

	t.Run("PanicReleases", func(t *testing.T) {
		require.PanicsWithValue(t, "kaboom", func() {
			_, _ = pgidem.Do(b.ctx, b.coord, "mail", "panic", testTTL, nil, func(context.Context) (int, error) { panic("kaboom") })
		})
		_, err := b.coord.Lookup(b.ctx, "mail", "panic")
		require.ErrorIs(t, err, pgidem.ErrNotFound)
	})

	t.Run("CancelledCallerStillFinishes", func(t *testing.T) {
		ctx, cancel := context.WithCancel(b.ctx)
		v, err := pgidem.Do(ctx, b.coord, "mail", "cancel", testTTL, nil, func(ctx context.Context) (string, error) {
			cancel()
			<-ctx.Done()
			return "sent-anyway", nil
		})
		require.NoError(t, err)
		require.Equal(t, "sent-anyway", v)
		rec := b.lookup(t, "mail", "cancel")
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
	})

	t.Run("CancelledBeforeReserve", func(t *testing.T) {
		ctx, cancel := context.WithCancel(b.ctx)
		cancel()
		_, err := pgidem.Do(ctx, b.coord, "mail", "never", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, context.Canceled)
		_, err = b.coord.Lookup(b.ctx, "mail", "never")
		require.ErrorIs(t, err, pgidem.ErrNotFound)
	})
}

func TestSweep(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, lease_expires_at, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, NULL::timestamptz, now() - interval '1 minute'
		FROM generate_series(1, 25) i
		UNION ALL
		SELECT 'sweep', 'live-' || i, 'completed', gen_random_uuid(), 'null', NULL, now() + interval '1 hour'
		FROM generate_series(1, 5) i
		UNION ALL
		SELECT 'sweep', 'held', 'in_progress', gen_random_uuid(), NULL::jsonb, now() + interval '1 minute', now() - interval '1 minute'`)
	require.NoError(t, err)

	var swept atomic.Int64
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventSwept {
			swept.Add(e.Count)
		}
	})})
	res, err := coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 10, MaxBatches: 2})
	require.NoError(t, err)
	require.EqualValues(t, 20, res.Records, "bounded by MaxBatches")
	res, err = coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 10})
	require.NoError(t, err)
	require.EqualValues(t, 5, res.Records)
	require.EqualValues(t, 25, swept.Load())
	require.Equal(t, 6, b.count(t), "live records and the held reservation stay")
}

// Concurrent sweeps on a pool whose sessions default to REPEATABLE READ split the rows as
// under READ COMMITTED. A row another sweep deleted after a statement's snapshot used to
// fail that statement with a serialization failure: three of four sweeps returned a store
// error.
func TestSweepConcurrentUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	})
	coord := b.newCoordOn(t, pool, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, now() - interval '1 minute'
		FROM generate_series(1, 10000) i`)
	require.NoError(t, err)
	var wg sync.WaitGroup
	var total atomic.Int64
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			res, err := coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: 50})
			errs[i] = err
			total.Add(res.Records)
		})
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, 10000, total.Load())
	require.Zero(t, b.count(t))
}

// Forget on a pool whose sessions default to REPEATABLE READ, blocked behind a concurrent
// write to the record that then commits, reads the record again and deletes it. The
// server refuses the first statement with a serialization failure, which Forget used to
// return as a store error.
func TestForgetUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	pool := b.newPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "repeatable read"
	})
	coord := b.newCoordOn(t, pool, nil)
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err)
	tx := b.begin(t)
	_, err = tx.Exec(b.ctx, `UPDATE pgidem_record SET updated_at = now() WHERE namespace = 'mail' AND key = 'k'`)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() {
		_, err := coord.Forget(b.ctx, "mail", "k", nil)
		done <- err
	}()
	reviewWaitBlocked(t, b, 1)
	require.NoError(t, tx.Commit(b.ctx))
	require.NoError(t, <-done)
	_, err = coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound)
}

// countStoreErrors returns a coordinator with config (nil: defaults) whose
// EventStoreErrors are counted.
func (b *testBundle) countStoreErrors(t *testing.T, config *pgidem.Config) (*pgidem.Coordinator, *atomic.Int64) {
	t.Helper()
	var cfg pgidem.Config
	if config != nil {
		cfg = *config
	}
	var n atomic.Int64
	cfg.Hook = pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventStoreError {
			n.Add(1)
		}
	})
	return b.newCoord(t, &cfg), &n
}

// A sweep whose context ends mid-statement returns the context's error, and it is not a
// store error: nothing is logged at error or counted (a River sweep job cut short by its
// timeout used to count as one). The cut batch rolls back.
func TestSweepCancelledMidStatement(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at)
		SELECT 'sweep', 'expired-' || i, 'completed', gen_random_uuid(), 'null'::jsonb, now() - interval '1 minute'
		FROM generate_series(1, 5) i;
	CREATE FUNCTION slow_delete() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN PERFORM pg_sleep(0.5); RETURN OLD; END$$;
	CREATE TRIGGER slow_delete BEFORE DELETE ON pgidem_record FOR EACH ROW EXECUTE FUNCTION slow_delete()`)
	require.NoError(t, err)
	coord, storeErrors := b.countStoreErrors(t, nil)
	ctx, cancel := context.WithTimeout(b.ctx, 300*time.Millisecond) // the batch takes 2.5 s
	defer cancel()
	res, err := coord.Sweep(ctx, nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.Zero(t, res.Records)
	require.Zero(t, storeErrors.Load())
	require.Equal(t, 5, b.count(t), "the cut batch rolled back")
}

// A statement cut off by the caller's own deadline (River's JobTimeout, an HTTP request's)
// is not a store outage: the call returns an error matching context.DeadlineExceeded and
// not ErrStoreUnavailable, and nothing is logged at error or counted as EventStoreError.
// DoTx waiting for another transaction's lock and Lookup blocked behind a table lock used
// to report "store unavailable".
func TestCallerDeadlineIsNotStoreError(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	check := func(name string, err error) {
		t.Helper()
		require.ErrorIs(t, err, context.DeadlineExceeded, name)
		require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable, name)
		require.Zero(t, storeErrors.Load(), name)
	}

	// Another transaction holds the key's DoTx lock.
	other, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer other.Rollback(b.ctx) //nolint:errcheck
	_, err = pgidem.DoTx(b.ctx, coord, other, "ledger", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err = pgidem.DoInTx(ctx, coord, "ledger", "k", testTTL, &pgidem.DoOpts{InFlight: pgidem.InFlightWait, WaitTimeout: time.Minute},
		func(context.Context, pgx.Tx) (int, error) { return 2, nil })
	check("DoTx lock wait", err)

	// A table lock blocks every read of pgidem_record.
	_, err = other.Exec(b.ctx, "LOCK TABLE pgidem_record IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)
	ctx, cancel = context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err = coord.Lookup(ctx, "mail", "k")
	check("Lookup", err)
}

// A finishing write that runs out of Config.FinishTimeout (the row locked by another
// session) is a store error, logged and counted, although the deadline that passed is a
// context's: the write's own, not the caller's.
func TestFinishTimeoutIsStoreError(t *testing.T) {
	t.Parallel()
	for _, maxBatch := range []int{1, 0} {
		t.Run(fmt.Sprintf("MaxBatch=%d", maxBatch), func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			coord, storeErrors := b.countStoreErrors(t, &pgidem.Config{FinishTimeout: 200 * time.Millisecond, MaxBatch: maxBatch})
			locker, err := b.db.Pool.Begin(b.ctx)
			require.NoError(t, err)
			defer locker.Rollback(b.ctx) //nolint:errcheck
			_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(ctx context.Context) (int, error) {
				_, err := locker.Exec(ctx, "SELECT 1 FROM pgidem_record WHERE namespace = 'mail' AND key = 'k' FOR UPDATE")
				return 1, err
			})
			require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.Positive(t, storeErrors.Load())
		})
	}
}

// A reserving write blocked behind an open DoTx ends at Config.FinishTimeout, a bound of
// its own: a store error for op "reserve", logged and counted, even when the caller's
// deadline passed meanwhile.
func TestDetachedReserveTimeoutUnderCallerDeadline(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, &pgidem.Config{FinishTimeout: 1500 * time.Millisecond})
	tx := b.begin(t)
	_, err := pgidem.DoTx(b.ctx, coord, tx, "mail", "k", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	require.NoError(t, err)
	// The caller's deadline passes while the reserving write waits on the row lock, which
	// it does until FinishTimeout.
	ctx, cancel := context.WithTimeout(b.ctx, 300*time.Millisecond)
	defer cancel()
	_, err = pgidem.Do(ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{ReserveFirst: true}, func(context.Context) (int, error) { return 2, nil })
	var storeErr *pgidem.StoreError
	require.ErrorAs(t, err, &storeErr)
	require.Equal(t, "reserve", storeErr.Op)
	require.Positive(t, storeErrors.Load())
}

// DoTx whose fn's statement is cut off by the caller's deadline, and which then fails
// permanently: storing the failure fails on the closed connection, which is the
// deadline's doing, not the store's. It used to be logged and counted as a store error.
func TestDoTxCallerDeadlineThenPermanent(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	coord, storeErrors := b.countStoreErrors(t, nil)
	tx := b.begin(t)
	ctx, cancel := context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err := pgidem.DoTx(ctx, coord, tx, "mail", "k", testTTL, nil, func(ctx context.Context, tx pgx.Tx) (int, error) {
		_, err := tx.Exec(ctx, "SELECT pg_sleep(5)")
		require.Error(t, err)
		return 0, pgidem.Permanent(errors.New("declined"))
	})
	notStored, ok := err.(*pgidem.FailureNotStoredError)
	require.True(t, ok, "%T: %v", err, err)
	require.ErrorIs(t, notStored.Cause, context.DeadlineExceeded)
	require.NotErrorIs(t, err, pgidem.ErrStoreUnavailable)
	require.Zero(t, storeErrors.Load())
}

// Forget deletes a record so the next call runs the effect again; it refuses a record in
// progress under a live lease unless forced, and deletes one whose holder died.
func TestForget(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	runs := 0
	fn := func(context.Context) (int, error) { runs++; return runs, nil }
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "done", testTTL, nil, fn)
	require.NoError(t, err)

	rec, err := b.coord.Forget(b.ctx, "mail", "done", nil)
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusCompleted, rec.Status)
	require.JSONEq(t, "1", string(rec.Result))
	_, err = b.coord.Forget(b.ctx, "mail", "done", nil)
	require.ErrorIs(t, err, pgidem.ErrNotFound)
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "done", testTTL, nil, fn)
	require.NoError(t, err)
	require.Equal(t, 2, v, "forgotten: the effect ran again")

	// A live holder is refused, then forced.
	h := b.hold(b.coord, "mail", "live", nil, "held")
	_, err = b.coord.Forget(b.ctx, "mail", "live", nil)
	var inProgress *pgidem.InProgressError
	require.ErrorAs(t, err, &inProgress)
	require.Positive(t, inProgress.RetryAfter)
	require.Equal(t, pgidem.StatusInProgress, b.lookup(t, "mail", "live").Status, "refused: still there")
	rec, err = b.coord.Forget(b.ctx, "mail", "live", &pgidem.ForgetOpts{Force: true})
	require.NoError(t, err)
	require.Equal(t, pgidem.StatusInProgress, rec.Status)
	h.unblock()
	require.ErrorIs(t, <-h.done, pgidem.ErrLeaseLost, "the forced-out holder's completion finds no row")

	// A holder that died (its lease ran out) needs no force.
	_, err = b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
		VALUES ('mail', 'dead', 'in_progress', gen_random_uuid(), now() - interval '1 second', now() + interval '1 hour')`)
	require.NoError(t, err)
	_, err = b.coord.Forget(b.ctx, "mail", "dead", nil)
	require.NoError(t, err)

	_, err = b.coord.Forget(b.ctx, "mail", "", nil)
	require.ErrorIs(t, err, pgidem.ErrInvalidKey)
}

func TestNilArguments(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do[int](b.ctx, b.coord, "mail", "k", testTTL, nil, nil)
	require.ErrorContains(t, err, "must not be nil")
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	_, err = pgidem.Do(b.ctx, nil, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorContains(t, err, "must not be nil")
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	for _, opts := range []*pgidem.DoOpts{{WaitTimeout: -1}, {InFlight: 9}} {
		_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, opts, func(context.Context) (int, error) { panic("not run") })
		require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	}
	_, err = b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: -1})
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.Equal(t, 0, b.count(t))
}

// DoTx in a read-only transaction, which can never write the record, refuses before fn
// runs; it used to run fn and fail only at the record's write.
func TestDoTxReadOnlyTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(b.ctx) }()
	_, err = pgidem.DoTx(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
		func(context.Context, pgx.Tx) (int, error) { panic("fn must not run") })
	require.ErrorIs(t, err, pgidem.ErrInvalidArgument)
	require.ErrorContains(t, err, "read-only")
	var one int
	require.NoError(t, tx.QueryRow(b.ctx, "SELECT 1").Scan(&one), "tx stays usable")
}

func TestSweepStoreErrorReported(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, "DROP TABLE pgidem_inbox")
	require.NoError(t, err)
	var events []pgidem.Event
	var mu sync.Mutex
	coord := b.newCoord(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		mu.Lock()
		defer mu.Unlock()
		events = append(events, e)
	})})
	_, err = coord.Sweep(b.ctx, nil)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
	_, err = coord.Lookup(b.ctx, "mail", "k")
	require.ErrorIs(t, err, pgidem.ErrNotFound, "a missing record is not a store error")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []pgidem.Event{{Kind: pgidem.EventStoreError, Namespace: "", Count: 1}}, events)
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

// A stored result that no longer decodes into the caller's type is a typed error, from Do
// and DoTx alike, and fn does not run. It used to be an error matching nothing.
func TestReplayNotDecodable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "typed", "k", testTTL, nil, func(context.Context) (int, error) { return 42, nil })
	require.NoError(t, err)
	mustNotRun := func(context.Context) (string, error) { t.Error("fn ran"); return "", nil }
	res, err := pgidem.DoResult(b.ctx, b.coord, "typed", "k", testTTL, nil, mustNotRun)
	require.ErrorIs(t, err, pgidem.ErrReplayNotDecodable)
	require.ErrorContains(t, err, "typed/k")
	var typeErr *json.UnmarshalTypeError
	require.ErrorAs(t, err, &typeErr)
	require.True(t, res.Replayed)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "typed", "k", testTTL, nil, func(context.Context, pgx.Tx) (string, error) {
		t.Error("fn ran")
		return "", nil
	})
	require.ErrorIs(t, err, pgidem.ErrReplayNotDecodable)
}

// A PermanentError made without an error (a literal, or a typed nil) is stored as a
// permanent failure like any other; pgidem used to panic on it after fn returned and
// leave the record in progress until its lease ended.
func TestPermanentErrorWithoutErr(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var typedNil *pgidem.PermanentError
	for i, perr := range []error{&pgidem.PermanentError{}, typedNil} {
		key := fmt.Sprintf("k%d", i)
		_, err := pgidem.Do(b.ctx, b.coord, "perm", key, testTTL, nil, func(context.Context) (int, error) { return 0, perr })
		require.ErrorIs(t, err, pgidem.ErrPermanent, "case %d", i)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "perm", key).Status, "case %d", i)
		_, err = pgidem.DoInTx(b.ctx, b.coord, "perm-tx", key, testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 0, perr })
		require.ErrorIs(t, err, pgidem.ErrPermanent, "case %d", i)
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, "perm-tx", key).Status, "case %d", i)
	}
}

// Result.LeaseLost tells that the write after fn found the reservation taken over, also
// when fn's own error is returned unchanged (the release found no row of its own).
func TestResultLeaseLost(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	boom := errors.New("boom")
	res, err := pgidem.DoResult(b.ctx, b.coord, "lost", "k", testTTL, nil, func(context.Context) (int, error) {
		_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid() WHERE namespace = 'lost' AND key = 'k'`)
		require.NoError(t, err)
		return 0, boom
	})
	require.Equal(t, boom, err, "fn's error, unchanged")
	require.True(t, res.LeaseLost)

	res, err = pgidem.DoResult(b.ctx, b.coord, "lost", "k2", testTTL, nil, func(context.Context) (int, error) { return 0, boom })
	require.Equal(t, boom, err)
	require.False(t, res.LeaseLost, "released normally")
}

// testCallKey marks the context of the call a test watches in the pool's tracer.
type testCallKey struct{}

// hogKey marks the context of a test's own Acquire that queues for a pool's connection.
type hogKey struct{}
