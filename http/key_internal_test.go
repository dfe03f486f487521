package pgidemhttp

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseKey(t *testing.T) {
	t.Parallel()

	valid := []struct{ field, key string }{
		{`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{`8e03978e-40d5-43e8-bc93-6894a57f9324`, "8e03978e-40d5-43e8-bc93-6894a57f9324"}, // unquoted, Stripe-style
		{` "abc" `, "abc"},
		{`"a b"`, "a b"},
		{`"a\"b\\c"`, `a"b\c`},
		{`"abc";v=1`, "abc"}, // parameters are ignored
		{`"abc";v`, "abc"},
		{`"abc";a=1;b="x;y";c=?1;d=:aGk=:;e=tok/en;f=-1.5`, "abc"},
		{`"abc"; v=1 `, "abc"},
		{`"abc"   `, "abc"},
	}
	for _, tt := range valid {
		key, err := parseKey(tt.field)
		require.NoError(t, err, tt.field)
		require.Equal(t, tt.key, key, tt.field)
	}

	invalid := []struct{ field, msg string }{
		{``, "empty"},
		{`   `, "empty"},
		{`""`, "empty"},
		{`"abc`, "no closing double quote"},
		{`"a\x"`, "invalid escape"},
		{`"a\`, "invalid escape"},
		{"\"a\x01b\"", "byte 0x01"},
		{"\"caf\xc3\xa9\"", "byte 0xc3"},
		{`"abc", "def"`, "more than one value"},
		{`"abc"x`, "after the closing double quote"},
		{`"abc" ;v=1`, "after the closing double quote"}, // RFC 8941: parameters follow at once
		{`"a";p, "b"`, "more than one value"},
		{`"a";`, "without a valid name"},
		{`"a";;;==,,`, "without a valid name"},
		{`"a";P=1`, "without a valid name"},
		{`"a";p=`, "without a value"},
		{`"a";p="x`, "without a closing double quote"},
		{`"a";p=1,`, "more than one value"},
		{`a b`, `' '`},
		{`a,b`, `','`},
		{`a;b`, `';'`},
		{`a"b`, `'"'`},
		{"ab\x7f", "byte 0x7f"},
	}
	for _, tt := range invalid {
		_, err := parseKey(tt.field)
		require.Error(t, err, tt.field)
		require.Contains(t, err.Error(), tt.msg, tt.field)
	}
}

func TestRecordKey(t *testing.T) {
	t.Parallel()

	k := RecordKey("user-42", "k1")
	require.Len(t, k, recordKeyPrefixLen+len("k1"))
	require.Equal(t, ":k1", k[recordKeyPrefixLen-1:])
	require.NotContains(t, k, "user-42", "the principal is not written to the record")
	require.Equal(t, k, RecordKey("user-42", "k1"), "stable")
	require.NotEqual(t, k, RecordKey("user-43", "k1"))
	require.NotEqual(t, RecordKey("a:b", "c"), RecordKey("a", "b:c"))
	require.Len(t, RecordKey(strings.Repeat("p", 5000), "k"), recordKeyPrefixLen+1, "any principal takes the same room")
}
