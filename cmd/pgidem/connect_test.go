package main_test

import (
	"net/url"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// TestUnixSocketAddress checks that errors name a Unix-socket server as a socket path (the
// "table not found" error uses the same formatting), not as "/dir:5432".
func TestUnixSocketAddress(t *testing.T) {
	t.Parallel()
	line := requireFail(t, cli(t, "host=/nonexistent-pgidem-dir port=5433 user=alice dbname=app", "stats"), 1)
	require.Contains(t, line, "unix socket /nonexistent-pgidem-dir/.s.PGSQL.5433")
}

func TestConnection(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)

	t.Run("Unreachable", func(t *testing.T) {
		t.Parallel()
		r := cli(t, "postgres://alice:s3cret-pw@127.0.0.1:1/app", "records", "list")
		line := requireFail(t, r, 1)
		require.Contains(t, line, "pgidem: cannot connect to Postgres at 127.0.0.1:1 (database \"app\", user \"alice\", from --database-url)")
		require.NotContains(t, line, "s3cret-pw")
		require.Empty(t, r.stdout)
	})

	t.Run("UnreachableEveryCommand", func(t *testing.T) {
		t.Parallel()
		for _, args := range [][]string{
			{"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"}, {"migrate", "version"},
			{"records", "show", "a", "b"}, {"records", "forget", "a", "b"}, {"sweep"}, {"stats"},
			{"inbox", "list"}, {"inbox", "show", "a", "b"}, {"inbox", "forget", "a", "b"},
		} {
			line := requireFail(t, cli(t, "postgres://alice:s3cret-pw@127.0.0.1:1/app", args...), 1)
			require.Contains(t, line, "cannot connect to Postgres at 127.0.0.1:1", args)
			require.NotContains(t, line, "s3cret-pw", args)
		}
	})

	t.Run("Unparsable", func(t *testing.T) {
		t.Parallel()
		line := requireFail(t, cli(t, "postgres://alice:s3cret pw@[::1", "stats"), 1)
		require.Contains(t, line, "pgidem: invalid connection string from --database-url")
		require.NotContains(t, line, "s3cret")
	})

	t.Run("UnparsableUserWithoutPassword", func(t *testing.T) {
		t.Parallel()
		// A user name is no secret: the reason is shown; only a password withholds it.
		line := requireFail(t, cli(t, "postgres://alice@127.0.0.1:5432/db?sslmode=bogus", "stats"), 1)
		require.Contains(t, line, "sslmode is invalid")
		line = requireFail(t, cli(t, "postgres://alice:s3cret@127.0.0.1:5432/db?sslmode=bogus", "stats"), 1)
		require.Contains(t, line, "details withheld")
		require.NotContains(t, line, "s3cret")
	})

	t.Run("UpperCaseScheme", func(t *testing.T) {
		t.Parallel()
		// pgx would take it for keyword/value settings and the server would echo them,
		// password included.
		for _, url := range []string{"Postgresql://app:s3cret@127.0.0.1:5432/db?sslmode=bogus", " postgres://app:s3cret@127.0.0.1:5432/db?sslmode=bogus"} {
			line := requireFail(t, cli(t, url, "stats"), 1)
			require.Contains(t, line, "a URL must start with postgres:// or postgresql://", url)
			require.NotContains(t, line, "s3cret", url)
		}
	})

	t.Run("UnparsableSpacedPassword", func(t *testing.T) {
		t.Parallel()
		// libpq accepts spaces around '='; pgconn's best-effort masking does not see this
		// password.
		line := requireFail(t, cli(t, "host=127.0.0.1 password = s3cr3t-pw port=abc", "stats"), 1)
		require.Equal(t, "pgidem: invalid connection string from --database-url: it could not be parsed (details withheld: the string may contain a password)", line)

		line = requireFail(t, pgidemEnv(t, cliEnv("DATABASE_URL=postgres://alice:s3cr3t-pw@127.0.0.1:abc/app"), "stats"), 1)
		require.Contains(t, line, "from DATABASE_URL: it could not be parsed")
		require.NotContains(t, line, "s3cr3t-pw")
	})

	t.Run("UnparsableWithoutPassword", func(t *testing.T) {
		t.Parallel()
		// Nothing to hide: pgconn's detail helps.
		line := requireFail(t, cli(t, "host=127.0.0.1 port=abc", "stats"), 1)
		require.Contains(t, line, "pgidem: invalid connection string from --database-url: cannot parse `host=127.0.0.1 port=abc`: invalid port")
	})

	t.Run("ShortPassword", func(t *testing.T) {
		t.Parallel()
		// A password that is a letter of the message must not garble it.
		line := requireFail(t, cli(t, "postgres://alice:o@127.0.0.1:1/app", "stats"), 1)
		require.Contains(t, line, "connection refused")
		require.Contains(t, line, `(database "app", user "alice", from --database-url)`)
	})

	t.Run("DatabaseURLVariable", func(t *testing.T) {
		t.Parallel()
		out := requireOK(t, pgidemEnv(t, cliEnv("DATABASE_URL="+db.URL), "records", "list", "--min-attempts", "2"))
		require.Contains(t, out, "order-9.invoice")

		line := requireFail(t, pgidemEnv(t, cliEnv("DATABASE_URL=postgres://bob@127.0.0.1:1/x"), "stats"), 1)
		require.Contains(t, line, "from DATABASE_URL")
	})

	t.Run("FlagBeatsVariable", func(t *testing.T) {
		t.Parallel()
		out := requireOK(t, pgidemEnv(t, cliEnv("DATABASE_URL=postgres://bob@127.0.0.1:1/x"),
			"--database-url", db.URL, "records", "list", "--min-attempts", "2"))
		require.Contains(t, out, "order-9.invoice")
	})

	t.Run("PGVariables", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(db.URL)
		require.NoError(t, err)
		env := cliEnv("PGHOST="+u.Hostname(), "PGPORT="+u.Port(), "PGUSER="+u.User.Username(),
			"PGDATABASE="+strings.TrimPrefix(u.Path, "/"), "PGSSLMODE=disable")
		if pw, ok := u.User.Password(); ok {
			env = append(env, "PGPASSWORD="+pw)
		}
		out := requireOK(t, pgidemEnv(t, env, "records", "list", "--min-attempts", "2"))
		require.Contains(t, out, "order-9.invoice")

		line := requireFail(t, pgidemEnv(t, cliEnv("PGHOST=127.0.0.1", "PGPORT=1", "PGUSER=carol", "PGDATABASE=y"), "stats"), 1)
		require.Contains(t, line, `cannot connect to Postgres at 127.0.0.1:1 (database "y", user "carol", from libpq PG* variables)`)
	})

	t.Run("NotMigrated", func(t *testing.T) {
		t.Parallel()
		empty := testdb.NewUnmigrated(t)
		for _, args := range [][]string{{"records", "list"}, {"records", "show", "a", "b"}, {"records", "forget", "a", "b"}, {"stats"}, {"sweep"}} {
			line := requireFail(t, cli(t, empty.URL, args...), 1)
			require.Contains(t, line, "table pgidem_record not found in the connection's search_path of database "+strconv.Quote(empty.Name), args)
			require.Contains(t, line, "pass --database-url (or --schema); if it is, run 'pgidem migrate up'", args)
		}
	})

	// A connection string without a database connects to the server's default, the
	// user's name; the messages name it instead of "".
	t.Run("DefaultDatabaseNamed", func(t *testing.T) {
		t.Parallel()
		u, err := url.Parse(db.URL)
		require.NoError(t, err)
		u.Path = ""
		line := requireFail(t, cli(t, u.String(), "--schema", "zz_no_such_schema", "stats"), 1)
		require.Contains(t, line, `in database "`+u.User.Username()+`"`)

		line = requireFail(t, pgidemEnv(t, cliEnv("DATABASE_URL=postgres://dave@127.0.0.1:1"), "stats"), 1)
		require.Contains(t, line, `(database "dave", user "dave"`)
	})
}
