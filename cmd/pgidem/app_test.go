package main_test

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
)

func TestUsage(t *testing.T) {
	t.Parallel()
	// None of these reaches the database.
	const url = "postgres://nobody@127.0.0.1:1/none"

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"UnknownFlag", []string{"records", "list", "--bogus"}, "pgidem: unknown flag: --bogus (see 'pgidem records list --help')"},
		{"UnknownRootFlag", []string{"--bogus", "stats"}, "pgidem: unknown flag: --bogus (see 'pgidem --help')"},
		{"UnknownCommand", []string{"frobnicate"}, `pgidem: unknown command "frobnicate" for "pgidem" (see 'pgidem --help')`},
		{"UnknownSubcommand", []string{"migrate", "sideways"}, `pgidem: unknown command "sideways" for "pgidem migrate" (see 'pgidem migrate --help')`},
		{"MissingSubcommand", []string{"records"}, "pgidem: missing command: one of forget, list, show (see 'pgidem records --help')"},
		{"NoCommand", nil, "pgidem: missing command: one of inbox, migrate, records, stats, sweep (see 'pgidem --help')"},
		{"BadValue", []string{"records", "list", "--limit", "many"}, `pgidem: invalid argument "many" for "--limit" flag: strconv.ParseInt: parsing "many": invalid syntax (see 'pgidem records list --help')`},
		{"ExtraArgs", []string{"stats", "now"}, `pgidem: unknown command "now" for "pgidem stats" (see 'pgidem stats --help')`},
		{"ForgetOneArg", []string{"records", "forget", "ns"}, "pgidem: pgidem records forget takes 2 arguments (NAMESPACE KEY), got 1 (see 'pgidem records forget --help')"},
		{"SchemaTooLong", []string{"--schema", strings.Repeat("s", 64), "migrate", "up"},
			`pgidem: --schema "` + strings.Repeat("s", 64) + `" is 64 bytes long; Postgres truncates identifiers to 63 bytes (see 'pgidem migrate up --help')`},
		{"SchemaBlank", []string{"--schema", " ", "stats"}, `pgidem: --schema " " is only white space (see 'pgidem stats --help')`},
		{"SchemaNotUTF8", []string{"--schema", "id\xffem", "records", "list"}, `pgidem: --schema "id\xffem" is not valid UTF-8 (see 'pgidem records list --help')`},
		// A schema migrate up would create but the coordinator (sweep) would refuse.
		{"SchemaControlCharacter", []string{"--schema", "idem\tstore", "migrate", "up"}, `pgidem: --schema "idem\tstore" contains a control character (see 'pgidem migrate up --help')`},
		{"RiverSchemaWithoutRiver", []string{"migrate", "up", "--river-schema", "queue"}, "pgidem: --river-schema needs --river (see 'pgidem migrate up --help')"},
		{"RiverSchemaTooLong", []string{"migrate", "up", "--river", "--river-schema", strings.Repeat("q", 64)},
			`pgidem: --river-schema "` + strings.Repeat("q", 64) + `" is 64 bytes long; Postgres truncates identifiers to 63 bytes (see 'pgidem migrate up --help')`},
		{"ShowKeyNotUTF8", []string{"records", "show", "invoices", "order-\xff"}, `pgidem: KEY "order-\xff" is not valid UTF-8 (see 'pgidem records show --help')`},
		{"ForgetNamespaceNotUTF8", []string{"records", "forget", "\xfe", "k"}, `pgidem: NAMESPACE "\xfe" is not valid UTF-8 (see 'pgidem records forget --help')`},
		// Names no row can have are usage errors, not a missing record. (A control
		// character is accepted: see TestControlCharacters.)
		{"ForgetEmptyArgs", []string{"records", "forget", "", ""}, "pgidem: NAMESPACE must not be empty (see 'pgidem records forget --help')"},
		{"ShowEmptyKey", []string{"records", "show", "invoices", ""}, "pgidem: KEY must not be empty (see 'pgidem records show --help')"},
		{"InboxShowEmptyConsumer", []string{"inbox", "show", "", "m-1"}, "pgidem: CONSUMER must not be empty (see 'pgidem inbox show --help')"},
		{"InboxForgetMessageIDNotUTF8", []string{"inbox", "forget", "billing", "m\xff"}, `pgidem: MESSAGE_ID "m\xff" is not valid UTF-8 (see 'pgidem inbox forget --help')`},
		{"ConsumerFilterNotUTF8", []string{"inbox", "list", "--consumer", "\xffbilling"}, `pgidem: --consumer "\xffbilling" is not valid UTF-8 (see 'pgidem inbox list --help')`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := cli(t, url, tc.args...)
			require.Equal(t, tc.want, requireFail(t, r, 2))
			require.Empty(t, r.stdout)
		})
	}

	t.Run("Help", func(t *testing.T) {
		t.Parallel()
		out := requireOK(t, cli(t, url, "--help"))
		for _, cmd := range []string{"migrate", "records", "stats", "sweep", "--database-url", "--schema", "--json"} {
			require.Contains(t, out, cmd)
		}
		out = requireOK(t, cli(t, url, "records", "forget", "--help"))
		require.Contains(t, out, "--force")
	})
}

// TestNonDefaultSchema runs pgidem end to end in a schema of its own: migrations through
// the CLI, the coordinator writing records, the CLI reading, forgetting and sweeping them,
// and the down migration removing everything but the version table.
func TestNonDefaultSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.NewUnmigrated(t)
	const schema = "Idem Store" // needs quoting: proves every identifier is quoted
	table := `"Idem Store".pgidem_record`

	out := requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "up"))
	require.Contains(t, out, "applied 00001_create_pgidem_record.sql")
	require.Contains(t, requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "status")), `"`+db.Name+`"`)
	require.Contains(t, requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "status")), `, schema "Idem Store"`+"\n")

	var tables []string
	require.NoError(t, db.Pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(n.nspname || '.' || c.relname ORDER BY n.nspname, c.relname), '{}')
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE c.relkind IN ('r', 'v') AND c.relname LIKE 'pgidem%'`).Scan(&tables))
	require.Contains(t, tables, schema+".pgidem_record")
	require.Contains(t, tables, schema+".pgidem_record_overview")
	require.Contains(t, tables, schema+"."+migrations.VersionTable)
	for _, name := range tables {
		require.True(t, strings.HasPrefix(name, schema+"."), "object outside the schema: %s", name)
	}

	// The coordinator writes in the schema.
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{Schema: schema})
	require.NoError(t, err)
	v, err := pgidem.Do(ctx, coord, "invoices", "order-9.invoice", time.Hour, nil,
		func(context.Context) (int, error) { return 1001, nil })
	require.NoError(t, err)
	require.Equal(t, 1001, v)
	insert(t, db.Pool, table, fixture{namespace: "invoices", key: "order-1.invoice", status: "completed",
		expiresIn: -time.Hour, age: 48 * time.Hour})

	// The CLI reads it there, and only there.
	out = requireOK(t, cli(t, db.URL, "--schema", schema, "records", "list"))
	require.Contains(t, out, "order-9.invoice")
	out = requireOK(t, cli(t, db.URL, "--schema", schema, "records", "show", "invoices", "order-9.invoice"))
	require.Contains(t, out, "result         1001\n")
	out = requireOK(t, cli(t, db.URL, "--schema", schema, "stats"))
	require.Contains(t, out, `table Idem Store.pgidem_record: 2 records (1 expired, not swept)`)
	require.Contains(t, out, `table Idem Store.pgidem_inbox: 0 messages`)
	line := requireFail(t, cli(t, db.URL, "records", "list"), 1)
	require.Contains(t, line, "not found in the connection's search_path")
	line = requireFail(t, cli(t, db.URL, "--schema", "elsewhere", "records", "list"), 1)
	require.Contains(t, line, `schema "elsewhere" does not exist in database`)
	require.Contains(t, line, `pgidem is installed in schema "Idem Store" of this database: pass --schema`)

	require.Equal(t, "swept 1 expired record and 0 expired inbox rows\n",
		requireOK(t, cli(t, db.URL, "--schema", schema, "sweep")))
	requireOK(t, cli(t, db.URL, "--schema", schema, "records", "forget", "invoices", "order-9.invoice"))
	_, err = coord.Lookup(ctx, "invoices", "order-9.invoice")
	require.ErrorIs(t, err, pgidem.ErrNotFound)

	requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "down", "--to", "0"))
	var left []string
	require.NoError(t, db.Pool.QueryRow(ctx, `
		SELECT coalesce(array_agg(c.relname ORDER BY c.relname), '{}')
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1`, schema).Scan(&left))
	for _, name := range left {
		require.True(t, strings.HasPrefix(name, migrations.VersionTable) || strings.HasPrefix(name, migrations.LockTable),
			"left behind: %s", name)
	}
	require.True(t, strings.HasPrefix(requireOK(t, cli(t, db.URL, "--schema", schema, "migrate", "version")), "0 (latest is "))
}

// An explicitly empty --database-url (a misspelled shell variable) does not fall back to
// DATABASE_URL or the PG* variables, nor an empty --schema to the search_path, so a forget,
// sweep or rollback aimed at one database or schema never runs on another: both are usage
// errors, like an empty --namespace.
func TestEmptyFlagValues(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)
	withVariable := cliEnv("DATABASE_URL=" + db.URL)

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"DatabaseURL", []string{"--database-url", "", "records", "forget", "invoices", "order-9.invoice"},
			"pgidem: --database-url must not be empty (omit it to use DATABASE_URL, else libpq's PG* variables) (see 'pgidem records forget --help')"},
		{"DatabaseURLBlank", []string{"--database-url", " ", "sweep"},
			"pgidem: --database-url must not be empty (omit it to use DATABASE_URL, else libpq's PG* variables) (see 'pgidem sweep --help')"},
		{"DatabaseURLEquals", []string{"--database-url=", "migrate", "down", "--to", "0", "--force"},
			"pgidem: --database-url must not be empty (omit it to use DATABASE_URL, else libpq's PG* variables) (see 'pgidem migrate down --help')"},
		{"Schema", []string{"--schema", "", "records", "forget", "invoices", "order-9.invoice"},
			"pgidem: --schema must not be empty (omit it to use the connection's search_path) (see 'pgidem records forget --help')"},
		// Refused like --namespace "", instead of listing every record.
		{"Status", []string{"records", "list", "--status", ""},
			"pgidem: --status must not be empty (omit it to list every status) (see 'pgidem records list --help')"},
		{"StatusEquals", []string{"records", "list", "--status="},
			"pgidem: --status must not be empty (omit it to list every status) (see 'pgidem records list --help')"},
		{"RiverSchema", []string{"migrate", "up", "--river", "--river-schema", ""},
			"pgidem: --river-schema must not be empty (omit it to use --schema, else the search_path) (see 'pgidem migrate up --help')"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := pgidemEnv(t, withVariable, tc.args...)
			require.Equal(t, tc.want, requireFail(t, r, 2))
			require.Empty(t, r.stdout)
		})
	}
	require.Equal(t, 5, countRecords(t, db.Pool, "pgidem_record"), "nothing forgotten or swept")
	// Omitted, the variable is used.
	require.Contains(t, requireOK(t, pgidemEnv(t, withVariable, "records", "show", "invoices", "order-9.invoice")), "order-9.invoice")
}

// A failed write on standard output (a full disk, here /dev/full) is reported by every
// command, which exits non-zero instead of losing its output silently.
func TestWriteOutputError(t *testing.T) {
	t.Parallel()
	full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
	if err != nil && runtime.GOOS != "linux" {
		t.Skipf("no /dev/full on %s: %v", runtime.GOOS, err) // Linux, CI's system, has one
	}
	require.NoError(t, err)
	defer full.Close()
	db := testdb.New(t)
	latest, _ := latestVersion(t)

	for _, args := range [][]string{
		{"--help"},
		{"records", "list", "--help"},
		{"migrate", "version"},
		{"migrate", "version", "--json"},
		{"migrate", "status"},
		{"migrate", "up"},
		{"migrate", "down", "--to", strconv.FormatInt(latest, 10)},
		{"stats"},
		{"stats", "--json"},
		{"records", "list"},
		{"records", "list", "--json"},
		{"inbox", "list"},
		{"inbox", "list", "--json"},
		{"sweep"},
		{"sweep", "--json"},
	} {
		r := pgidemOut(t, full, cliEnv(), append([]string{"--database-url", db.URL}, args...)...)
		line := requireFail(t, r, 1)
		require.True(t, strings.HasPrefix(line, "pgidem: write output: "), "%v: %s", args, line)
		require.Contains(t, line, "no space left on device", args)
		require.Contains(t, line, "; the command itself succeeded", args)
	}
}

// A forget or sweep whose output could not be written says what it did (the delete was
// done), not only "write output: …", which would read as if it had failed.
func TestWriteOutputErrorAfterChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	full, err := os.OpenFile("/dev/full", os.O_WRONLY, 0)
	if err != nil && runtime.GOOS != "linux" {
		t.Skipf("no /dev/full on %s: %v", runtime.GOOS, err)
	}
	require.NoError(t, err)
	defer full.Close()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "invoices", key: "order-9", status: "completed", expiresIn: time.Hour, age: time.Minute},
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour},
		fixture{namespace: "mail", key: "old-2", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
	_, err = db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES ('billing', 'm-1', now() + interval '1 day')`)
	require.NoError(t, err)

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"records", "forget", "invoices", "order-9"}, "records forget deleted the record"},
		{[]string{"records", "forget", "--json", "mail", "old-1"}, "records forget deleted the record"},
		{[]string{"inbox", "forget", "billing", "m-1"}, "inbox forget deleted the inbox row"},
		{[]string{"sweep"}, "sweep deleted 1 expired record and 0 expired inbox rows"},
	} {
		r := pgidemOut(t, full, cliEnv(), append([]string{"--database-url", db.URL}, tc.args...)...)
		line := requireFail(t, r, 1)
		require.Regexp(t, `^pgidem: write output: .*no space left on device; the command itself succeeded \(`+regexp.QuoteMeta(tc.want)+`\)$`, line, tc.args)
	}
	require.Zero(t, countRecords(t, db.Pool, "pgidem_record"))
	require.Zero(t, countRecords(t, db.Pool, "pgidem_inbox"))
}

// A closed pipe (pgidem records list | head -1) ends the CLI with SIGPIPE, as it ends
// other Unix commands, rather than with exit status 1.
func TestClosedPipe(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)
	r, w, err := os.Pipe()
	require.NoError(t, err)
	require.NoError(t, r.Close())
	defer w.Close()
	cmd := exec.Command(binaryPath, "--database-url", db.URL, "records", "list")
	cmd.Env = cliEnv()
	cmd.Stdout = w
	err = cmd.Run()
	require.Error(t, err)
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	require.True(t, ws.Signaled(), "%v", err)
	require.Equal(t, syscall.SIGPIPE, ws.Signal())

	for _, path := range []string{"../../README.md", "../../docs/inspect.md"} {
		doc, err := os.ReadFile(path)
		require.NoError(t, err)
		text := strings.Join(strings.Fields(string(doc)), " ")
		require.True(t, strings.Contains(text, "closed pipe (`pgidem records list | head -1`)") &&
			strings.Contains(text, "SIGPIPE (status 141"), "%s does not say that a closed pipe ends pgidem with SIGPIPE", path)
	}
}

// A namespace, key, consumer or message id with a control character cannot be stored by
// pgidem, but can by SQL; such a row is listed (quoted: "order\t9"), and shown and
// forgotten when passed as the help says ($'order\t9'): the argument check accepts it.
func TestControlCharacters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "invoices", key: "order\t9", status: "completed", expiresIn: time.Hour, age: 2 * time.Minute},
		fixture{namespace: "ops\nteam", key: "k\x01", status: "completed", expiresIn: time.Hour, age: time.Minute})
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_inbox (consumer, message_id, expires_at) VALUES (E'billing\t', E'm\r1', now() + interval '1 day')`)
	require.NoError(t, err)

	out := requireOK(t, cli(t, db.URL, "records", "list"))
	require.Contains(t, out, `invoices     "order\t9"`)
	require.Contains(t, out, `"ops\nteam"  "k\x01"`)

	out = requireOK(t, cli(t, db.URL, "records", "show", "invoices", "order\t9"))
	require.Contains(t, out, `key            "order\t9"`+"\n")
	out = requireOK(t, cli(t, db.URL, "records", "list", "--namespace", "ops\nteam"))
	require.Contains(t, out, `"k\x01"`)
	require.NotContains(t, out, "invoices")
	out = requireOK(t, cli(t, db.URL, "records", "forget", "ops\nteam", "k\x01"))
	require.Contains(t, out, "deleted:\n")
	out = requireOK(t, cli(t, db.URL, "records", "forget", "invoices", "order\t9"))
	require.Contains(t, out, `key            "order\t9"`)
	require.Zero(t, countRecords(t, db.Pool, "pgidem_record"))

	out = requireOK(t, cli(t, db.URL, "inbox", "list", "--consumer", "billing\t", "--message-id", "m\r1"))
	require.Contains(t, out, `"billing\t"  "m\r1"`)
	out = requireOK(t, cli(t, db.URL, "inbox", "show", "billing\t", "m\r1"))
	require.Contains(t, out, `consumer    "billing\t"`)
	requireOK(t, cli(t, db.URL, "inbox", "forget", "billing\t", "m\r1"))
	require.Zero(t, countRecords(t, db.Pool, "pgidem_inbox"))

	// The help and docs/inspect.md say how to pass such a key.
	require.Contains(t, requireOK(t, cli(t, db.URL, "records", "forget", "--help")), `in bash $'a\tb'`)
	doc, err := os.ReadFile("../../docs/inspect.md")
	require.NoError(t, err)
	require.Contains(t, string(doc), "`$'order\\t9'`")
}
