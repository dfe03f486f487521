package pgidem_test

// Review tests: a skeptical pass over the reservation protocol (Do/DoResult). Tests named
// Test* that pass confirm behaviour worth keeping; the ones that fail demonstrate a
// finding (see the comment above each).

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

// reviewInsert writes a record row directly. lease and expires are SQL expressions.
func reviewInsert(t *testing.T, b *testBundle, key, status, lease, expires string, fingerprint []byte) {
	t.Helper()
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, fingerprint, result, lease_expires_at, expires_at)
		VALUES ('mail', $1, $2, gen_random_uuid(), 1, $3,
			CASE WHEN $2 = 'completed' THEN '"old"'::jsonb END, `+lease+`, `+expires+`)`,
		key, status, fingerprint)
	require.NoError(t, err)
}

// reviewWaitBlocked waits until n backends of the test database wait for a heavyweight lock
// (a row lock or another transaction): a condition, not a timing assumption.
func reviewWaitBlocked(t *testing.T, b *testBundle, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting int
		err := b.db.Pool.QueryRow(b.ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting)
		return err == nil && waiting >= n
	}, 30*time.Second, 5*time.Millisecond)
}

func reviewRaise() *pgidem.DoOpts { return &pgidem.DoOpts{InFlight: pgidem.InFlightRaise} }

// ---------------------------------------------------------------------------------------
// Confirmations (expected to pass).
// ---------------------------------------------------------------------------------------

// Two takers of an expired lease: the second one's UPDATE blocks on the first's row lock,
// re-checks the WHERE clause on the new row version (READ COMMITTED) and updates nothing.
func TestTakeoverRecheckUnderReadCommitted(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	reviewInsert(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)

	tx := b.begin(t)
	// A competing taker, not yet committed.
	tag, err := tx.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = attempts + 1,
		lease_expires_at = now() + interval '1 hour' WHERE key = 'k' AND lease_expires_at <= now()`)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	var ran atomic.Bool
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(), func(context.Context) (int, error) {
			ran.Store(true)
			return 1, nil
		})
		done <- err
	}()
	reviewWaitBlocked(t, b, 1) // our takeover UPDATE waits for the competitor's row lock
	require.NoError(t, tx.Commit(b.ctx))
	require.ErrorIs(t, <-done, pgidem.ErrInProgress)
	require.False(t, ran.Load(), "the loser of the takeover race must not run fn")
	require.Equal(t, 2, b.lookup(t, "mail", "k").Attempts)
}

// The reserve CTE when the conflicting row commits after the statement's snapshot: neither
// branch returns a row and the caller runs it again; when the conflicting insert rolls back,
// the caller's insert proceeds.
func TestReserveSnapshotRetry(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		name := "Rollback"
		if commit {
			name = "Commit"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, nil)
			tx := b.begin(t)
			_, err := tx.Exec(b.ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, lease_expires_at, expires_at)
				VALUES ('mail', 'k', 'in_progress', gen_random_uuid(), now() + interval '1 hour', now() + interval '2 hours')`)
			require.NoError(t, err)

			var runs atomic.Int32
			type out struct {
				res pgidem.Result[int]
				err error
			}
			done := make(chan out, 1)
			go func() {
				res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(), func(context.Context) (int, error) {
					return int(runs.Add(1)), nil
				})
				done <- out{res, err}
			}()
			reviewWaitBlocked(t, b, 1) // the speculative insert waits for the uncommitted row
			if commit {
				require.NoError(t, tx.Commit(b.ctx))
				got := <-done
				require.ErrorIs(t, got.err, pgidem.ErrInProgress)
				require.Zero(t, runs.Load())
			} else {
				require.NoError(t, tx.Rollback(b.ctx))
				got := <-done
				require.NoError(t, got.err)
				require.Equal(t, 1, got.res.Value)
				require.Equal(t, 1, got.res.Attempts)
			}
		})
	}
}

// Sweep vs a concurrent takeover of the same expired row, in both lock orders.
func TestSweepVsTakeover(t *testing.T) {
	t.Parallel()

	t.Run("SweepFirst", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		reviewInsert(t, b, "k", "completed", "NULL", "now() - interval '1 second'", nil)
		// A sweep that has locked the row and not yet committed its DELETE.
		tx := b.begin(t)
		tag, err := tx.Exec(b.ctx, `DELETE FROM pgidem_record WHERE expires_at <= now()`)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())

		done := make(chan pgidem.Result[string], 1)
		go func() {
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (string, error) {
				return "fresh", nil
			})
			assertNoErr(t, err)
			done <- res
		}()
		reviewWaitBlocked(t, b, 1) // the takeover waits for the sweep's lock
		require.NoError(t, tx.Commit(b.ctx))
		res := <-done
		require.False(t, res.Replayed)
		require.Equal(t, "fresh", res.Value)
		require.Equal(t, 1, res.Attempts)
		require.JSONEq(t, `"fresh"`, string(b.lookup(t, "mail", "k").Result))
	})

	t.Run("TakeoverFirst", func(t *testing.T) {
		t.Parallel()
		b := setup(t, nil)
		reviewInsert(t, b, "k", "completed", "NULL", "now() - interval '1 second'", nil)
		// A takeover that has updated the row and not yet committed.
		tx := b.begin(t)
		_, err := tx.Exec(b.ctx, `UPDATE pgidem_record SET status = 'in_progress', result = NULL,
			lease_expires_at = now() + interval '1 minute', expires_at = now() + interval '1 hour'`)
		require.NoError(t, err)

		res, err := b.coord.Sweep(b.ctx, nil) // SKIP LOCKED: neither blocks nor deletes
		require.NoError(t, err)
		require.Zero(t, res.Records)
		require.NoError(t, tx.Commit(b.ctx))
		res, err = b.coord.Sweep(b.ctx, nil) // the committed takeover is no longer expired
		require.NoError(t, err)
		require.Zero(t, res.Records)
		require.Equal(t, 1, b.count(t))
	})
}

// assertNoErr is require.NoError for goroutines other than the test's (no FailNow).
func assertNoErr(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("unexpected error: %v", err)
	}
}

// Replays and in-progress checks are pure reads: the row's xmin/xmax never change (a row lock
// as taken by ON CONFLICT DO UPDATE ... WHERE false would set xmax).
func TestReadPathsNeverWrite(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	version := func() string {
		var v string
		require.NoError(t, b.db.Pool.QueryRow(b.ctx, `SELECT xmin::text || '/' || xmax::text FROM pgidem_record WHERE key = 'k'`).Scan(&v))
		return v
	}
	// In progress (a fake live holder: no heartbeat writes the row during the test).
	reviewInsert(t, b, "k", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", []byte{1})
	before := version()
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(), func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{WaitTimeout: 30 * time.Millisecond}, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{2}}, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch)
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Millisecond)
	defer cancel()
	_, err = pgidem.Do(ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Equal(t, before, version(), "in-progress checks never write")

	// Completed.
	_, err = b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET status = 'completed', result = '7', lease_expires_at = NULL, completed_at = now()`)
	require.NoError(t, err)
	before = version()
	for range 5 {
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.True(t, res.Replayed)
		require.Equal(t, 7, res.Value)
	}
	require.Equal(t, before, version(), "replays never write")
}

// An empty (non-nil) fingerprint is a fingerprint: Go's mismatch check and the takeover
// statement's WHERE clause agree, so a lease-expired row does not make acquire spin.
func TestEmptyFingerprint(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	reviewInsert(t, b, "expired-lease", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", []byte{})
	reviewInsert(t, b, "done", "completed", "NULL", "now() + interval '1 hour'", []byte{})
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	for _, key := range []string{"expired-lease", "done"} {
		_, err := pgidem.Do(ctx, b.coord, "mail", key, testTTL, &pgidem.DoOpts{Fingerprint: []byte{1}},
			func(context.Context) (int, error) { return 1, nil })
		require.ErrorIs(t, err, pgidem.ErrFingerprintMismatch, key)
		rec := b.lookup(t, "mail", key)
		require.NotNil(t, rec.Fingerprint)
		require.Empty(t, rec.Fingerprint)
	}
}

// Many callers racing to take over one dead holder's lease: fn runs once, attempts 2.
func TestConcurrentTakeover(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	reviewInsert(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
	const callers = 16
	var runs atomic.Int32
	var tookOver atomic.Int32
	values := make([]int32, callers)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range callers {
		wg.Go(func() {
			<-start
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int32, error) {
				return runs.Add(1), nil
			})
			assertNoErr(t, err)
			if res.TookOver {
				tookOver.Add(1)
			}
			values[i] = res.Value
		})
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 1, tookOver.Load())
	for _, v := range values {
		require.EqualValues(t, 1, v)
	}
	require.Equal(t, 2, b.lookup(t, "mail", "k").Attempts)
}

// Key edge cases: C1 controls, DEL, invalid UTF-8, encoded surrogates, the byte limit with
// multi-byte characters. fn never runs for an invalid key.
func TestKeyEdgeCases(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	ran := false
	fn := func(context.Context) (int, error) { ran = true; return 1, nil }
	for _, tc := range []struct{ ns, key string }{
		{"mail", "a\u0085b"},
		{"mail", "a\x7fb"},
		{"mail", "a\xffb"},
		{"mail", "\xed\xa0\x80"}, // UTF-16 surrogate encoded in UTF-8
		{"mail", strings.Repeat("é", 128)},
		{"ma\u009fil", "k"},
		{"mail", "trailing\n"},
	} {
		_, err := pgidem.Do(b.ctx, b.coord, tc.ns, tc.key, testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidKey, "%q/%q", tc.ns, tc.key)
		var ike *pgidem.InvalidKeyError
		require.ErrorAs(t, err, &ike)
	}
	require.False(t, ran)
	v, err := pgidem.Do(b.ctx, b.coord, "mail", strings.Repeat("é", 127)+"a", testTTL, nil, fn)
	require.NoError(t, err, "255 bytes is within the limit")
	require.Equal(t, 1, v)
}

// ---------------------------------------------------------------------------------------
// Findings (expected to fail until fixed).
// ---------------------------------------------------------------------------------------

// Regression: when heartbeats fail with store errors for a whole lease (here: blocked by a row
// lock, as a slow disk or a network blip would), the heartbeat sets lost=true and run()
// skips the finishing write entirely — although nobody took the row over and the
// owner-conditional UPDATE would succeed. fn's success is thrown away, the record stays in
// progress, and the next delivery takes over and repeats the effect (attempts 2).
func TestHeartbeatOutageStillFinishes(t *testing.T) {
	t.Parallel()
	b := setup(t, &pgidem.Config{Lease: 300 * time.Millisecond})
	var runs atomic.Int32
	fn := func(ctx context.Context) (string, error) {
		if runs.Add(1) > 1 {
			return "second", nil
		}
		tx, err := b.db.Pool.Begin(context.WithoutCancel(ctx))
		if err != nil {
			return "", err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		// Hold the row lock: every heartbeat UPDATE blocks until its timeout.
		if _, err := tx.Exec(context.WithoutCancel(ctx), `SELECT 1 FROM pgidem_record WHERE key = 'k' FOR UPDATE`); err != nil {
			return "", err
		}
		<-ctx.Done() // the heartbeat gives up after a lease without a successful renewal
		return "sent", nil
	}
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	require.Equal(t, "sent", v)
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusCompleted, rec.Status,
		"the row was never taken over (still ours), yet the successful result was not stored (err=%v)", err)
	require.NoError(t, err)

	// Consequence: once the lease has run out, the next delivery runs the effect again.
	_, err = b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second' WHERE status = 'in_progress'`)
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	require.NoError(t, err)
	require.EqualValues(t, 1, runs.Load(), "the effect ran twice")
}

// reviewMarshal panics in MarshalJSON when Panic is set.
type reviewMarshal struct{ Panic bool }

func (m reviewMarshal) MarshalJSON() ([]byte, error) {
	if m.Panic {
		panic("MarshalJSON boom")
	}
	return []byte(`{}`), nil
}

// Regression: a panic while encoding fn's (successful) value happens after finished=true and
// after the heartbeat stopped, so neither the panic release nor the complete runs: the row is
// left in progress with no heartbeat, and after one lease the next delivery takes over and
// repeats the effect.
func TestMarshalPanicStoresRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	func() {
		defer func() { _ = recover() }() // re-panicking or returning ErrResultNotStorable are both fine
		_, _ = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (reviewMarshal, error) {
			runs.Add(1)
			return reviewMarshal{Panic: true}, nil
		})
	}()
	rec := b.lookup(t, "mail", "k")
	// Simulate the lease running out, then a redelivery.
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second' WHERE status = 'in_progress'`)
	require.NoError(t, err)
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (reviewMarshal, error) {
		runs.Add(1)
		return reviewMarshal{}, nil
	})
	t.Logf("after the panic: status=%s; redelivery: err=%v tookOver=%v attempts=%d", rec.Status, err, res.TookOver, res.Attempts)
	require.NotEqual(t, pgidem.StatusInProgress, rec.Status, "the reservation is left in progress without a heartbeat")
	require.EqualValues(t, 1, runs.Load(), "the effect ran twice")
}

// Regression: FailOpen applies to every store error in acquire, including a lookup that fails
// while *waiting* for a holder that the caller has already seen alive. The waiter then runs
// fn unprotected beside the live holder: a near-certain duplicate, not a degraded mode.
func TestFailOpenNeverBesideHolder(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)

	var down atomic.Bool
	waiterPool := b.downablePool(t, &down, nil)
	waited := make(chan struct{})
	var waitedOnce sync.Once
	waiter, err := pgidem.NewCoordinator(waiterPool, &pgidem.Config{
		FailOpen: true,
		Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
			if e.Kind == pgidem.EventWaited {
				waitedOnce.Do(func() { close(waited) })
			}
		}),
	})
	require.NoError(t, err)

	h := b.hold(b.coord, "pay", "order-9", nil, "charged-by-holder")

	var waiterRan atomic.Bool
	waiterDone := make(chan pgidem.Result[string], 1)
	go func() {
		res, _ := pgidem.DoResult(b.ctx, waiter, "pay", "order-9", testTTL, nil, func(context.Context) (string, error) {
			waiterRan.Store(true)
			return "charged-by-waiter", nil
		})
		waiterDone <- res
	}()
	<-waited
	down.Store(true)
	waiterPool.Reset() // the waiter's store becomes unreachable mid-wait
	res := <-waiterDone
	h.unblock()
	require.NoError(t, <-h.done)
	require.False(t, waiterRan.Load(), "FailOpen ran the effect beside a live holder (FailedOpen=%v)", res.FailedOpen)
}

// reviewQueryCounter counts the statements a pool sends.
type reviewQueryCounter struct{ n atomic.Int64 }

func (c *reviewQueryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *reviewQueryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// Regression: huge poll intervals are accepted but overflow: jitter(d) computes d/2 + rand(d),
// which wraps negative for d > ~MaxInt64/1.5, and backoff*2 wraps (with PollIntervalMax =
// MaxInt64 and the default min it reaches 0 after ~57 polls and stays there). A negative or
// zero sleep turns the wait loop into a hot loop hammering the database.
func TestPollIntervalBounded(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	// Huge intervals overflowed the backoff arithmetic into a hot loop; they are refused.
	_, err := pgidem.NewCoordinator(b.db.Pool, &pgidem.Config{
		PollIntervalMin: time.Duration(math.MaxInt64),
		PollIntervalMax: time.Duration(math.MaxInt64),
	})
	require.ErrorContains(t, err, "Config.PollIntervalMax")
	// The largest accepted interval still waits rather than spins.
	reviewInsert(t, b, "k", "in_progress", "now() + interval '1 hour'", "now() + interval '2 hours'", nil)
	var counter reviewQueryCounter
	pool := b.newPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = &counter })
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{
		PollIntervalMin: pgidem.PollIntervalMaxMax,
		PollIntervalMax: pgidem.PollIntervalMaxMax,
		WaitTimeout:     500 * time.Millisecond,
	})
	require.NoError(t, err)
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrInProgress)
	require.Less(t, counter.n.Load(), int64(5), "the waiter polled %d times", counter.n.Load())
}

// Regression: json.Marshal silently replaces invalid UTF-8 in strings with U+FFFD, so the replay
// returns a different value from the one fn returned (and the first caller got).
func TestInvalidUTF8ResultNotStorable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	sig := "sig:\xff\xfe" // raw bytes, e.g. a provider's binary token in a string
	fn := func(context.Context) (string, error) { return sig, nil }
	first, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	if err != nil {
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable) // an acceptable fix
		return
	}
	require.Equal(t, sig, first.Value)
	second, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, second.Replayed)
	require.Equal(t, []byte(sig), []byte(second.Value), "the replay differs from fn's value")
}

// Regression: the NUL check in run() is bytes.Contains(json, `\u0000`), which also matches the
// escaped text backslash-u-0-0-0-0 (encoded as `\\u0000`). A perfectly storable result is
// recorded as a failure and every caller gets ErrResultNotStorable.
func TestLiteralBackslashU0000Storable(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	text := `escape NUL as \u0000 in JSON`
	fn := func(context.Context) (string, error) { return text, nil }
	v, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	require.NoError(t, err, "false positive of the NUL check")
	require.Equal(t, text, v)
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, text, res.Value)
}

// Documented limits of replay through jsonb: T = json.RawMessage comes back as the same JSON
// value in jsonb's normal form; T = any decodes numbers as float64 (encoding/json's rule).
func TestReplayJSONLimits(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	t.Run("RawMessage", func(t *testing.T) {
		raw := json.RawMessage(`{"b":1,"a":[1,2]}`)
		fn := func(context.Context) (json.RawMessage, error) { return raw, nil }
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "raw", testTTL, nil, fn)
		require.NoError(t, err)
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "raw", testTTL, nil, fn)
		require.NoError(t, err)
		require.JSONEq(t, string(raw), string(v), "the same JSON value")
		require.Equal(t, `{"a": [1, 2], "b": 1}`, string(v), "in jsonb's normal form")
	})
	t.Run("AnyInt", func(t *testing.T) {
		fn := func(context.Context) (any, error) { return int64(1<<53 + 1), nil }
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "any", testTTL, nil, fn)
		require.NoError(t, err)
		v, err := pgidem.Do(b.ctx, b.coord, "mail", "any", testTTL, nil, fn)
		require.NoError(t, err)
		require.Equal(t, float64(1<<53), v, "encoding/json decodes numbers into any as float64")
	})
}

// Regression: errors not of the documented type.
func TestErrorTypes(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	fn := func(context.Context) (int, error) { return 1, nil }

	t.Run("OptsLeaseBelowMinIsInvalidTTLError", func(t *testing.T) {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, &pgidem.DoOpts{Lease: time.Millisecond}, fn)
		require.ErrorIs(t, err, pgidem.ErrInvalidTTL)
		var ite *pgidem.InvalidTTLError
		require.ErrorAs(t, err, &ite, "ErrInvalidTTL documents *InvalidTTLError for detail")
	})
	t.Run("LookupInvalidKey", func(t *testing.T) {
		_, err := b.coord.Lookup(b.ctx, "mail", "a\x00b")
		require.ErrorIs(t, err, pgidem.ErrInvalidKey, "an invalid key is not an unavailable store (got %v)", err)
	})
}

// Regression: storeError passes through any error that wraps context.DeadlineExceeded,
// judging by the error chain instead of the caller's ctx. pgx's connect_timeout (and any
// internal driver deadline) produces exactly such an error when the server hangs, so the call
// returns a bare timeout that does not match ErrStoreUnavailable — and FailOpen never engages
// in the most common outage mode — although the caller's context is fine.
func TestConnectTimeoutIsStoreError(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	var mu sync.Mutex
	acceptDone := make(chan struct{})
	go func() { // a server that accepts and never answers
		defer close(acceptDone)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-acceptDone
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	pool, err := pgxpool.New(context.Background(),
		"postgres://postgres@"+ln.Addr().String()+"/postgres?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	coord, err := pgidem.NewCoordinator(pool, &pgidem.Config{FailOpen: true})
	require.NoError(t, err)

	res, err := pgidem.DoResult(context.Background(), coord, "mail", "k", testTTL, nil, reviewFn1)
	t.Logf("err=%v failedOpen=%v", err, res.FailedOpen)
	require.True(t, res.FailedOpen, "FailOpen must engage when the store does not answer")
	require.NoError(t, err)

	coord2, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)
	_, err = pgidem.Do(context.Background(), coord2, "mail", "k", testTTL, nil, reviewFn1)
	require.ErrorIs(t, err, pgidem.ErrStoreUnavailable)
}

func reviewFn1(context.Context) (int, error) { return 1, nil }

// Regression: sweep options accepted but misbehaving: a negative MaxBatches silently
// sweeps nothing; a negative BatchSize becomes a SQL error reported as ErrStoreUnavailable.
func TestSweepRejectsNegativeOpts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	reviewInsert(t, b, "old", "completed", "NULL", "now() - interval '1 second'", nil)
	_, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{BatchSize: -1})
	require.Error(t, err)
	require.False(t, errors.Is(err, pgidem.ErrStoreUnavailable), "a bad option is not an unreachable store: %v", err)
	res, err := b.coord.Sweep(b.ctx, &pgidem.SweepOpts{MaxBatches: -1})
	require.True(t, err != nil || res.Records == 1, "MaxBatches -1 neither errs nor sweeps")
}

// Regression: hook.go promises exactly one outcome event (Executed, Replayed, InProgress,
// InvalidKey, StoreError, FailOpen) per call; a fingerprint mismatch reports none.
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
	_, err := pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{1}}, reviewFn1)
	require.NoError(t, err)
	mu.Lock()
	events = nil
	mu.Unlock()
	_, err = pgidem.Do(b.ctx, coord, "mail", "k", testTTL, &pgidem.DoOpts{Fingerprint: []byte{2}}, reviewFn1)
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

// Releasing a reservation that took over a dead holder's keeps the evidence: the row stays
// with its lease ended (the next caller takes over at once) and its attempts, so the record
// says the effect may have run more than once all along. Taking the released row over
// counts no attempt and reports no takeover (its holder did not die). Releasing used to
// delete the row, and the next call started afresh with attempts 1. A first reservation
// that is released still leaves no row.
func TestReleaseAfterTakeoverKeepsAttempts(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	transient := errors.New("transient")
	failing := func(context.Context) (int, error) { return 0, transient }
	requireKept := func(t *testing.T, key string, attempts int) {
		t.Helper()
		rec := b.lookup(t, "mail", key)
		require.Equal(t, pgidem.StatusInProgress, rec.Status)
		require.Equal(t, attempts, rec.Attempts)
		require.False(t, rec.LeaseExpiresAt.After(rec.UpdatedAt), "its lease ended when it was released")
		var tookOver bool
		require.NoError(t, b.db.Pool.QueryRow(b.ctx,
			`SELECT took_over FROM pgidem_record_overview WHERE namespace = 'mail' AND key = $1`, key).Scan(&tookOver))
		require.True(t, tookOver, "the overview shows the takeover")
	}

	t.Run("Error", func(t *testing.T) {
		reviewInsert(t, b, "err", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "err", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		require.True(t, res.TookOver)
		requireKept(t, "err", 2)

		res, err = pgidem.DoResult(b.ctx, b.coord, "mail", "err", testTTL, reviewRaise(),
			func(context.Context) (int, error) { return 7, nil })
		require.NoError(t, err, "taken over at once, without waiting for a lease")
		require.False(t, res.TookOver, "a released record's holder did not stop renewing: no takeover")
		require.Equal(t, 2, res.Attempts, "the release counted no attempt")
		rec := b.lookup(t, "mail", "err")
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		require.Equal(t, 2, rec.Attempts, "the dead holder may have run the effect too")
	})

	t.Run("Panic", func(t *testing.T) {
		reviewInsert(t, b, "panic", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		require.Panics(t, func() {
			_, _ = pgidem.Do(b.ctx, b.coord, "mail", "panic", testTTL, nil,
				func(context.Context) (int, error) { panic("boom") })
		})
		requireKept(t, "panic", 2)
		res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "panic", testTTL, nil,
			func(context.Context) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.Equal(t, 2, res.Attempts)
	})

	t.Run("DoTx", func(t *testing.T) {
		reviewInsert(t, b, "dotx", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
		_, err := pgidem.DoResult(b.ctx, b.coord, "mail", "dotx", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		tx := b.begin(t)
		res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "dotx", testTTL, nil,
			func(context.Context, pgx.Tx) (int, error) { return 1, nil })
		require.NoError(t, err)
		require.False(t, res.TookOver)
		require.Equal(t, 2, res.Attempts, "DoTx counts no attempt for a released record either")
		require.NoError(t, tx.Commit(b.ctx))
	})

	t.Run("FirstReservation", func(t *testing.T) {
		_, err := pgidem.DoResult(b.ctx, b.coord, "mail", "first", testTTL, nil, failing)
		require.ErrorIs(t, err, transient)
		_, err = b.coord.Lookup(b.ctx, "mail", "first")
		require.ErrorIs(t, err, pgidem.ErrNotFound, "a released first reservation leaves no row")
	})
}

// The heartbeat is stopped before a release: a renewal that ran after the release would
// revive the lease of the kept row, and the key would look held by nobody for a whole
// lease. Here the release waits on a row lock long enough for a heartbeat tick to queue
// behind it.
func TestReleaseIsNotRevivedByHeartbeat(t *testing.T) {
	t.Parallel()
	const lease = 600 * time.Millisecond // a tick every 200 ms, each renewal waiting up to 200 ms
	b := setup(t, &pgidem.Config{Lease: lease})
	reviewInsert(t, b, "k", "in_progress", "now() - interval '1 second'", "now() + interval '1 hour'", nil)
	locker, err := b.db.Pool.Begin(b.ctx)
	require.NoError(t, err)
	defer locker.Rollback(b.ctx) //nolint:errcheck
	transient := errors.New("transient")
	done := make(chan error, 1)
	go func() {
		_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) {
			// After the takeover committed: lock the row so the release has to wait.
			_, err := locker.Exec(b.ctx, `SELECT 1 FROM pgidem_record WHERE key = 'k' FOR UPDATE`)
			require.NoError(t, err)
			return 0, transient
		})
		done <- err
	}()
	reviewWaitBlocked(t, b, 1)
	// Had the heartbeat still been running, its renewal would now be queued behind the
	// release (and it gives up only after a whole lease without a renewal).
	time.Sleep(lease / 2)
	require.NoError(t, locker.Commit(b.ctx))
	require.ErrorIs(t, <-done, transient)
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusInProgress, rec.Status)
	require.False(t, rec.LeaseExpiresAt.After(rec.UpdatedAt), "the lease stays ended")
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, reviewRaise(),
		func(context.Context) (int, error) { return 1, nil })
	require.NoError(t, err, "the next caller takes over at once")
}

// Whether a call took over is decided on the row its takeover statement locked, not on its
// earlier read: here the read sees a released record (no takeover), but before the
// takeover writes, another holder took the key over and died (its lease ran out). That is
// a takeover: attempts go up and Result.TookOver says so.
func TestTookOverDecidedAtWrite(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"Do", "DoTxCommitDuringFn", "DoTxCommitDuringWrite", "DoTxReadUncommittedCommitDuringWrite"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			testTookOverDecidedAtWrite(t, mode)
		})
	}
}

// testTookOverDecidedAtWrite: mode says who takes the key over (Do or DoTx) and, for DoTx,
// whether the other holder commits while fn runs or while DoTx's write waits for its lock.
func testTookOverDecidedAtWrite(t *testing.T, mode string) {
	b := setup(t, nil)
	_, err := b.db.Pool.Exec(b.ctx, `INSERT INTO pgidem_record
		(namespace, key, status, owner, attempts, lease_expires_at, updated_at, expires_at)
		VALUES ('mail', 'k', 'in_progress', gen_random_uuid(), 2, now() - interval '1 second',
			now() - interval '1 second', now() + interval '1 hour')`) // released
	require.NoError(t, err)
	crashed := b.begin(t) // another holder's takeover, committed after our read
	_, err = crashed.Exec(b.ctx, `UPDATE pgidem_record SET owner = gen_random_uuid(), attempts = 3,
		lease_expires_at = now() - interval '1 millisecond', updated_at = now() - interval '1 second'
		WHERE namespace = 'mail' AND key = 'k'`)
	require.NoError(t, err)
	type outcome struct {
		res pgidem.Result[int]
		err error
	}
	done := make(chan outcome, 1)
	if mode != "Do" {
		// DoTx reads, then runs fn, then writes.
		inFn, proceed := make(chan struct{}), make(chan struct{})
		go func() {
			iso := pgx.ReadCommitted
			if mode == "DoTxReadUncommittedCommitDuringWrite" {
				iso = pgx.ReadUncommitted // Postgres runs it as READ COMMITTED
			}
			tx, err := b.db.Pool.BeginTx(b.ctx, pgx.TxOptions{IsoLevel: iso})
			if err != nil {
				done <- outcome{err: err}
				return
			}
			defer tx.Rollback(b.ctx) //nolint:errcheck // a no-op after commit
			res, err := pgidem.DoTxResult(b.ctx, b.coord, tx, "mail", "k", testTTL, nil,
				func(context.Context, pgx.Tx) (int, error) {
					close(inFn)
					<-proceed
					return 1, nil
				})
			if err == nil {
				err = tx.Commit(b.ctx)
			}
			done <- outcome{res, err}
		}()
		<-inFn
		if mode == "DoTxCommitDuringFn" {
			require.NoError(t, crashed.Commit(b.ctx))
			close(proceed)
		} else { // the CommitDuringWrite modes
			close(proceed)
			reviewWaitBlocked(t, b, 1) // DoTx's write waits for the other holder's row lock
			require.NoError(t, crashed.Commit(b.ctx))
		}
	} else {
		go func() {
			res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
			done <- outcome{res, err}
		}()
		reviewWaitBlocked(t, b, 1) // the takeover statement waits for the other holder's row lock
		require.NoError(t, crashed.Commit(b.ctx))
	}
	out := <-done
	require.NoError(t, out.err)
	require.True(t, out.res.TookOver, "the holder whose lease it took over died")
	require.Equal(t, 4, out.res.Attempts)
}
