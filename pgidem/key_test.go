package pgidem_test

import (
	"context"
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
