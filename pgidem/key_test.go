package pgidem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/pgidem"
)

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

// FuzzKey: a namespace and key that Do accepts are stored byte-exact (Lookup finds a
// record with the same namespace and key, and fn's value replays); one Do refuses returns
// an error matching ErrInvalidKey (an *InvalidKeyError) and fn does not run.
func FuzzKey(f *testing.F) {
	for _, seed := range [][2]string{
		{"mail", "order-9.invoice"}, {"", "k"}, {"ns", ""}, {"ns", "order-9\x00invoice"},
		{"ns", "k\u0085"}, {"ns", "k\x7f"}, {"ns", "k\xff\xfe"}, {"ns", "k\xc3"},
		{"ns", "\xed\xa0\x80"}, {"ns", "é\u2028\ufeff\U0001F600"}, {"ns", strings.Repeat("é", 127) + "a"},
		{"ns", strings.Repeat("k", 256)}, {strings.Repeat("n", 65), "k"}, {"ns", " "}, {"ns", `'";--\`},
	} {
		f.Add(seed[0], seed[1])
	}
	b := fuzzBundle(f)
	f.Fuzz(func(t *testing.T, namespace, key string) {
		ran := false
		v, err := pgidem.Do(b.ctx, b.coord, namespace, key, testTTL, nil, func(ctx context.Context) (string, error) {
			ran = true
			ns, k, ok := pgidem.KeyFromContext(ctx)
			require.True(t, ok)
			return ns + "\n" + k, nil
		})
		if err != nil {
			require.ErrorIs(t, err, pgidem.ErrInvalidKey, "%q/%q", namespace, key)
			var ike *pgidem.InvalidKeyError
			require.ErrorAs(t, err, &ike)
			require.False(t, ran, "fn ran for a refused key %q/%q", namespace, key)
			return
		}
		require.Equal(t, namespace+"\n"+key, v)
		rec, err := b.coord.Lookup(b.ctx, namespace, key)
		require.NoError(t, err, "%q/%q", namespace, key)
		require.Equal(t, namespace, rec.Namespace)
		require.Equal(t, key, rec.Key)
		require.Equal(t, pgidem.StatusCompleted, rec.Status)
		res, err := pgidem.DoResult(b.ctx, b.coord, namespace, key, testTTL, nil, func(context.Context) (string, error) {
			return "", errors.New("fn ran again for a completed key")
		})
		require.NoError(t, err)
		require.True(t, res.Replayed)
		require.Equal(t, namespace+"\n"+key, res.Value)
		_, err = b.coord.Forget(b.ctx, namespace, key, nil) // the same input may come again
		require.NoError(t, err)
	})
}
