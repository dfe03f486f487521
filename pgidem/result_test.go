package pgidem_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

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
		// U+FFFD and is stored; one encoding/json wrote for invalid UTF-8 is not.
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
		// (XX000) that would look like an outage, leave the record in progress and let the
		// effect run again after the lease.
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

// A stored result that no longer decodes into the caller's type is a typed error, from Do
// and DoTx alike, and fn does not run.
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

// A Permanent error whose message contains NUL (which jsonb refuses inside a string) is
// still stored as a failure: the next caller replays the failure instead of finding the
// key in progress, and the effect does not run again.
func TestPermanentFailureWithNULIsStored(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (int, error) {
		return 0, pgidem.Permanent(errors.New("bad\x00byte"))
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	rec := b.lookup(t, "mail", "k")
	require.Equal(t, pgidem.StatusFailed, rec.Status, "the permanent failure was not stored")

	var ran atomic.Bool
	_, err = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, raiseOpts(), func(context.Context) (int, error) {
		ran.Store(true)
		return 1, nil
	})
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	require.False(t, ran.Load())
}

type nulErrorMarshal struct{}

func (nulErrorMarshal) MarshalJSON() ([]byte, error) { return nil, errors.New("cannot\x00encode") }

// The same for a result that is not storable because its MarshalJSON error contains NUL:
// the "not storable" failure record is stored, and the caller gets ErrResultNotStorable,
// not a store error.
func TestNotStorableMessageWithNUL(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	_, err := pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (nulErrorMarshal, error) {
		return nulErrorMarshal{}, nil
	})
	t.Logf("err=%v", err)
	require.ErrorIs(t, err, pgidem.ErrResultNotStorable)
	require.Equal(t, pgidem.StatusFailed, b.lookup(t, "mail", "k").Status, "the effect ran but the record is left in progress")
}

// A holder whose result's MarshalJSON panics after its reservation was deleted (or taken
// over) under it reports the lost lease before the panic continues, as a holder whose fn
// panics does.
func TestMarshalPanicAfterLeaseLostIsReported(t *testing.T) {
	t.Parallel()
	var lost atomic.Int64
	b := setup(t, &pgidem.Config{Hook: pgidem.HookFunc(func(_ context.Context, e pgidem.Event) {
		if e.Kind == pgidem.EventLeaseLost {
			lost.Add(e.Count)
		}
	})})
	require.PanicsWithValue(t, "MarshalJSON boom", func() {
		_, _ = pgidem.Do(b.ctx, b.coord, "pay", "k", testTTL, nil, func(ctx context.Context) (panicMarshal, error) {
			_, err := b.db.Pool.Exec(ctx, `DELETE FROM pgidem_record`) // an operator's forced forget
			require.NoError(t, err)
			return panicMarshal{Panic: true}, nil
		})
	})
	require.Equal(t, int64(1), lost.Load())
}

// A failure message too long to keep is cut, so the failure is still stored and replayed
// (jsonb refuses strings over 256 MiB; a record is no log). Do and DoInTx alike.
func TestLongFailureMessageTruncated(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	long := strings.Repeat("é", 100_000) // 200 KB, cut at a character boundary
	check := func(t *testing.T, err error) {
		t.Helper()
		var stored *pgidem.StoredFailureError
		require.ErrorAs(t, err, &stored)
		require.True(t, strings.HasSuffix(stored.Message, "(truncated)"), stored.Message[len(stored.Message)-40:])
		require.LessOrEqual(t, len(stored.Message), 64<<10)
		require.True(t, utf8.ValidString(stored.Message))
	}
	permanent := pgidem.Permanent(errors.New(long))

	_, err := pgidem.Do(b.ctx, b.coord, "t", "do", testTTL, nil, func(context.Context) (int, error) { return 0, permanent })
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	_, err = pgidem.Do(b.ctx, b.coord, "t", "do", testTTL, nil, func(context.Context) (int, error) { return 1, nil })
	check(t, err)

	_, err = pgidem.DoInTx(b.ctx, b.coord, "t", "dotx", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 0, permanent })
	require.ErrorIs(t, err, pgidem.ErrPermanent)
	_, err = pgidem.DoInTx(b.ctx, b.coord, "t", "dotx", testTTL, nil, func(context.Context, pgx.Tx) (int, error) { return 1, nil })
	check(t, err)
}

// panicMarshal panics in MarshalJSON when Panic is set.
type panicMarshal struct{ Panic bool }

func (m panicMarshal) MarshalJSON() ([]byte, error) {
	if m.Panic {
		panic("MarshalJSON boom")
	}
	return []byte(`{}`), nil
}

// A panic while encoding fn's (successful) value, after the heartbeat stopped, still
// finishes the record: the row is not left in progress, and the next delivery does not take
// over and repeat the effect.
func TestMarshalPanicStoresRecord(t *testing.T) {
	t.Parallel()
	b := setup(t, nil)
	var runs atomic.Int32
	func() {
		defer func() { _ = recover() }() // re-panicking or returning ErrResultNotStorable are both fine
		_, _ = pgidem.Do(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (panicMarshal, error) {
			runs.Add(1)
			return panicMarshal{Panic: true}, nil
		})
	}()
	rec := b.lookup(t, "mail", "k")
	// Simulate the lease running out, then a redelivery.
	_, err := b.db.Pool.Exec(b.ctx, `UPDATE pgidem_record SET lease_expires_at = now() - interval '1 second' WHERE status = 'in_progress'`)
	require.NoError(t, err)
	res, err := pgidem.DoResult(b.ctx, b.coord, "mail", "k", testTTL, nil, func(context.Context) (panicMarshal, error) {
		runs.Add(1)
		return panicMarshal{}, nil
	})
	t.Logf("after the panic: status=%s; redelivery: err=%v tookOver=%v attempts=%d", rec.Status, err, res.TookOver, res.Attempts)
	require.NotEqual(t, pgidem.StatusInProgress, rec.Status, "the reservation is left in progress without a heartbeat")
	require.EqualValues(t, 1, runs.Load(), "the effect ran twice")
}

// A result holding invalid UTF-8 is refused with ErrResultNotStorable: encoding/json would
// replace it with U+FFFD, and the replay would differ from what fn returned.
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

// The text backslash-u-0-0-0-0 (encoded as `\\u0000`) is not a NUL: a result holding it is
// stored and replayed like any other.
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

// FuzzResultRoundTrip: a string, a float64 or a []byte that fn returns replays equal
// through jsonb, or is refused with ErrResultNotStorable; a refused value is still handed
// to the first caller, and the failure is stored and replayed without running fn again.
func FuzzResultRoundTrip(f *testing.F) {
	f.Add("", 0.0, []byte(nil))
	f.Add("receipt em_1", 1.5, []byte("raw"))
	f.Add("nul\x00byte", math.Inf(1), []byte{0, 0xff})
	f.Add("bad \xff byte", math.NaN(), []byte{})
	f.Add(`\u0000 "quoted" \\`, math.Copysign(0, -1), []byte("\x00"))
	f.Add("\ufffd\u2028\U0001F600", math.MaxFloat64, []byte("\xed\xa0\x80"))
	f.Add("\xed\xa0\x80", math.SmallestNonzeroFloat64, []byte(`"`))
	f.Add("<&>", 1e21, []byte(strings.Repeat("x", 100)))
	b := fuzzBundle(f)
	var seq atomic.Int64
	f.Fuzz(func(t *testing.T, s string, n float64, raw []byte) {
		key := fmt.Sprintf("k%d", seq.Add(1))
		fuzzRoundTrip(t, b, "string", key, s, func(a, b string) bool { return a == b })
		fuzzRoundTrip(t, b, "float", key, n, func(a, b float64) bool { return a == b || a != a && b != b }) // NaN is itself
		fuzzRoundTrip(t, b, "bytes", key, raw, bytes.Equal)
	})
}

// fuzzRoundTrip stores v as fn's value under namespace/key and checks its replay with eq.
func fuzzRoundTrip[T any](t *testing.T, b *testBundle, namespace, key string, v T, eq func(a, b T) bool) {
	t.Helper()
	runs := 0
	fn := func(context.Context) (T, error) { runs++; return v, nil }
	got, err := pgidem.Do(b.ctx, b.coord, namespace, key, testTTL, nil, fn)
	require.True(t, eq(v, got), "the first caller gets fn's value: %#v, got %#v", v, got)
	if err != nil {
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "%#v", v)
		_, err = pgidem.Do(b.ctx, b.coord, namespace, key, testTTL, nil, fn)
		require.ErrorIs(t, err, pgidem.ErrResultNotStorable, "the failure is replayed: %#v", v)
		require.Equal(t, 1, runs, "fn ran again for a stored failure")
		require.Equal(t, pgidem.StatusFailed, b.lookup(t, namespace, key).Status)
		return
	}
	res, err := pgidem.DoResult(b.ctx, b.coord, namespace, key, testTTL, nil, fn)
	require.NoError(t, err)
	require.True(t, res.Replayed)
	require.Equal(t, 1, runs, "fn ran again for a completed key")
	require.True(t, eq(v, res.Value), "replay of %#v gave %#v", v, res.Value)
}
