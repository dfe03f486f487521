package main_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// --json wrote <, > and & as \u003c, \u003e and \u0026 (encoding/json's default, for HTML
// pages); it writes them as they are.
func TestJSONNotHTMLEscaped(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", fixture{namespace: "html", key: "<a&b>", status: "completed",
		result: ptr(`{"body": "<p>Tom & Jerry</p>"}`), expiresIn: time.Hour, age: time.Minute})

	for _, args := range [][]string{{"records", "show", "html", "<a&b>", "--json"}, {"records", "list", "--json"}} {
		out := requireOK(t, cli(t, db.URL, args...))
		require.Contains(t, out, `"key": "<a&b>"`, args)
		require.Contains(t, out, `"body": "<p>Tom & Jerry</p>"`, args)
		require.NotContains(t, out, `\u00`, args)
	}
}

// Table output quotes names with white space, quotes or characters that do not print, so
// a key with a trailing space or two spaces in a row never looks like another key.
func TestTableQuotesNames(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "order-9", status: "completed", expiresIn: time.Hour, age: 4 * time.Minute},
		fixture{namespace: "mail", key: "order-9 ", status: "completed", expiresIn: time.Hour, age: 3 * time.Minute},
		fixture{namespace: "mail", key: `say "hi"`, status: "completed", expiresIn: time.Hour, age: 2 * time.Minute},
		fixture{namespace: "two  words", key: "zero\u200bwidth", status: "in_progress", leaseIn: time.Hour, expiresIn: time.Hour, age: time.Minute})
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES ('billing ', 'm 1', now() + interval '1 day')`)
	require.NoError(t, err)

	out := requireOK(t, cli(t, db.URL, "records", "list"))
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 5)
	require.Regexp(t, `^"two  words" +"zero\\u200bwidth" +in_progress `, lines[1])
	require.Regexp(t, `^mail +"say \\"hi\\"" +completed `, lines[2])
	require.Regexp(t, `^mail +"order-9 " +completed `, lines[3])
	require.Regexp(t, `^mail +order-9 +completed `, lines[4])

	// What the table shows, unquoted as the shell does, finds the record.
	out = requireOK(t, cli(t, db.URL, "records", "show", "mail", "order-9 "))
	require.Contains(t, out, "namespace      mail\n")
	require.Contains(t, out, `key            "order-9 "`+"\n")

	out = requireOK(t, cli(t, db.URL, "stats"))
	require.Contains(t, out, `"two  words"`)
	require.Contains(t, out, `"zero\u200bwidth"`)
	out = requireOK(t, cli(t, db.URL, "inbox", "list"))
	require.Contains(t, out, `"billing "  "m 1"`)
	out = requireOK(t, cli(t, db.URL, "inbox", "show", "billing ", "m 1"))
	require.Contains(t, out, `consumer    "billing "`+"\n")

	// --json has the exact text.
	var record map[string]any
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "show", "mail", "order-9 ", "--json"))), &record))
	require.Equal(t, "order-9 ", record["key"])
}

// Singular counts read "1 record", not "1 records"; a sweep without an inbox table names
// the table with its schema.
func TestCountsAndInboxName(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO pgidem_inbox (consumer, message_id, expires_at)
		VALUES ('billing', 'm-1', now() - interval '1 day')`)
	require.NoError(t, err)
	out := requireOK(t, cli(t, db.URL, "stats"))
	require.Contains(t, out, "table pgidem_record: 1 record (1 expired, not swept)")
	require.Contains(t, out, "table pgidem_inbox: 1 message (1 expired, not swept)")
	require.Equal(t, "swept 1 expired record and 1 expired inbox row\n", requireOK(t, cli(t, db.URL, "sweep")))

	schema := testdb.NewUnmigrated(t)
	requireOK(t, cli(t, schema.URL, "--schema", "idem", "migrate", "up"))
	// Every migration above the records table's, the inbox's among them.
	requireOK(t, cli(t, schema.URL, "--schema", "idem", "migrate", "down", "--to", "1"))
	require.Equal(t, "swept 0 expired records (no inbox table idem.pgidem_inbox)\n",
		requireOK(t, cli(t, schema.URL, "--schema", "idem", "sweep")))
}
