package pgidemhttp

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
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

// FuzzParseKey sends any Idempotency-Key field (once, or twice) through a Middleware on a
// real database and holds that:
//   - a field the middleware accepts is a key parseKey reads, non-empty printable ASCII
//     within the limit, handed to the handler as is ([RequestKey]), stored byte-exact in
//     the record's key ([RecordKey]), and the same key sent again as a quoted string
//     (RFC 8941) reads back to it and replays the stored response;
//   - a field it refuses (invalid, too long, sent twice) never runs the handler, is
//     answered 400 and leaves no record.
func FuzzParseKey(f *testing.F) {
	for _, seed := range []string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `8e03978e-40d5-43e8-bc93-6894a57f9324`, ` "abc" `,
		`"a\"b\\c"`, `"abc";a=1;b="x;y";c=?1;d=:aGk=:;e=tok/en;f=-1.5`, `"abc"; v=1 `, "\t\"k\"\t",
		``, `""`, `"abc`, `"a\x"`, `"a\`, "\"a\x01b\"", "\"caf\xc3\xa9\"", `"abc", "def"`, `"abc"x`,
		`"abc" ;v=1`, `"a";`, `"a";P=1`, `"a";p=`, `"a";p="x`, `a b`, `a,b`, "ab\x7f",
		`"` + strings.Repeat("k", 232) + `"`, `"` + strings.Repeat("k", 233) + `"`,
	} {
		f.Add(seed, false)
	}
	f.Add(`"k"`, true)

	db := testdb.New(f)
	coord, err := pgidem.NewCoordinator(db.Pool, nil)
	require.NoError(f, err)
	const principalHeader = "X-Fuzz-Principal"
	mw, err := New(coord, &Config{Principal: func(r *http.Request) (string, error) { return r.Header.Get(principalHeader), nil }})
	require.NoError(f, err)
	var runs, inputs atomic.Int64
	var handed atomic.Value
	h := mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		_, key, _ := RequestKey(r.Context())
		handed.Store(key)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d", n)
	}))
	send := func(principal string, fields ...string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader("x"))
		r.Header.Set(principalHeader, principal)
		r.Header[HeaderKey] = fields
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}

	f.Fuzz(func(t *testing.T, field string, twice bool) {
		ctx := context.Background()
		// A principal of its own per input: the fuzzer repeats inputs, and each must
		// find no record.
		principal := fmt.Sprintf("fuzz-%d-%d", os.Getpid(), inputs.Add(1))
		fields := []string{field}
		if twice {
			fields = append(fields, field)
		}
		before := runs.Load()
		w := send(principal, fields...)
		key, err := parseKey(field)
		if twice || err != nil || len(key) > mw.maxKey {
			require.Equal(t, before, runs.Load(), "a refused field ran the handler: %q", field)
			require.Equal(t, http.StatusBadRequest, w.Code, w.Body.String())
			require.Contains(t, w.Body.String(), `"code":"idempotency_key_invalid"`)
			var n int
			require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM pgidem_record WHERE left(key, $1) = $2`,
				recordKeyPrefixLen, RecordKey(principal, "")).Scan(&n))
			require.Zero(t, n, "a refused field left a record")
			return
		}
		require.Equal(t, http.StatusCreated, w.Code, "%q: %s", field, w.Body.String())
		require.Equal(t, before+1, runs.Load())
		require.Equal(t, key, handed.Load(), "the handler sees the key as parsed")
		require.NotEmpty(t, key)
		for i := 0; i < len(key); i++ {
			require.True(t, key[i] >= ' ' && key[i] < 0x7f, "%q holds byte 0x%02x", key, key[i])
		}
		rec, err := coord.Lookup(ctx, NamespaceDefault, RecordKey(principal, key))
		require.NoError(t, err)
		require.Equal(t, RecordKey(principal, key), rec.Key, "the record's key is byte-exact")

		quoted := `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
		back, err := parseKey(quoted)
		require.NoError(t, err, quoted)
		require.Equal(t, key, back)
		replay := send(principal, quoted)
		require.Equal(t, "true", replay.Header().Get(HeaderReplayed), "%q then %q", field, quoted)
		require.Equal(t, w.Body.String(), replay.Body.String())
		require.Equal(t, before+1, runs.Load(), "a replay ran the handler")
	})
}
