package main_test

import (
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

func TestSweep(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour},
		fixture{namespace: "mail", key: "old-2", status: "completed", expiresIn: -3 * time.Hour, age: 30 * time.Hour},
	)

	require.Equal(t, "swept 3 expired records and 0 expired inbox rows\n",
		requireOK(t, cli(t, db.URL, "sweep", "--batch-size", "1")))
	require.Equal(t, 4, countRecords(t, db.Pool, "pgidem_record"))

	var res map[string]int64
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "sweep", "--json"))), &res))
	require.Equal(t, map[string]int64{"records": 0, "inbox": 0}, res)

	requireFail(t, cli(t, db.URL, "sweep", "--batch-size", "0"), 2)
	// A batch size beyond int4 is fine: it is a bigint LIMIT.
	require.Equal(t, "swept 0 expired records and 0 expired inbox rows\n",
		requireOK(t, cli(t, db.URL, "sweep", "--batch-size", "3000000000")))
}

// TestSweepWithoutInbox covers a database holding only the record table (migrations
// vendored selectively): sweep deletes the expired records and reports no inbox, as stats
// does, instead of failing after deleting them.
func TestSweepWithoutInbox(t *testing.T) {
	t.Parallel()
	db := upTo(t, 1)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour},
		fixture{namespace: "mail", key: "new-1", status: "completed", expiresIn: 2 * time.Hour, age: time.Hour})

	require.Equal(t, "swept 1 expired record (no inbox table public.pgidem_inbox)\n", requireOK(t, cli(t, db.URL, "sweep")))
	require.Equal(t, 1, countRecords(t, db.Pool, "pgidem_record"))

	var res map[string]any
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "sweep", "--json"))), &res))
	require.Equal(t, map[string]any{"records": float64(0), "inbox": nil}, res)
}

// TestSweepFailsPartWay checks that a sweep failing on the inbox after deleting records says
// how many it deleted.
func TestSweepFailsPartWay(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
	_, err := db.Pool.Exec(context.Background(), "ALTER TABLE pgidem_inbox RENAME COLUMN expires_at TO expires")
	require.NoError(t, err)

	line := requireFail(t, cli(t, db.URL, "sweep"), 1)
	require.Contains(t, line, "(before failing, the sweep deleted 1 expired record and 0 expired inbox rows)")
	require.Zero(t, countRecords(t, db.Pool, "pgidem_record"))
}

// TestExpiredMatchesSweep checks that records list --expired and the EXPIRED counts of
// stats count what the sweep deletes: not a record past its TTL that is in progress under
// a live lease.
func TestExpiredMatchesSweep(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "done", status: "completed", expiresIn: -time.Hour, age: 30 * time.Hour},
		fixture{namespace: "mail", key: "dead", status: "in_progress", leaseIn: -time.Hour, expiresIn: -time.Hour, age: 30 * time.Hour},
		fixture{namespace: "mail", key: "held", status: "in_progress", leaseIn: time.Hour, expiresIn: -time.Hour, age: 30 * time.Hour})

	out := requireOK(t, cli(t, db.URL, "records", "list", "--expired"))
	require.Contains(t, out, " done ")
	require.Contains(t, out, " dead ")
	require.NotContains(t, out, " held ")

	var stats struct {
		Namespaces []struct {
			Expired int64 `json:"expired"`
		} `json:"namespaces"`
		Table struct {
			Expired int64 `json:"expired"`
		} `json:"table"`
	}
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "stats", "--json"))), &stats))
	require.Len(t, stats.Namespaces, 1)
	require.Equal(t, int64(2), stats.Namespaces[0].Expired)
	require.Equal(t, int64(2), stats.Table.Expired)
	require.Contains(t, requireOK(t, cli(t, db.URL, "stats")), "3 records (2 expired, not swept)")

	require.Equal(t, "swept 2 expired records and 0 expired inbox rows\n", requireOK(t, cli(t, db.URL, "sweep")))
	require.Equal(t, "no records match\n", requireOK(t, cli(t, db.URL, "records", "list", "--expired")))
}

// A database error during sweep (here: the role may not delete) is reported as the other
// commands report errors, not as "store unavailable", since the server answered.
func TestSweepDatabaseError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record",
		fixture{namespace: "mail", key: "old-1", status: "completed", expiresIn: -2 * time.Hour, age: 30 * time.Hour})
	role := "pgidem_cli_reader_" + db.Name
	_, err := db.Pool.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = db.Pool.Exec(ctx, "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = db.Pool.Exec(ctx, "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	_, err = db.Pool.Exec(ctx, "GRANT SELECT ON pgidem_record, pgidem_inbox TO "+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.User(role)

	line := requireFail(t, cli(t, u.String(), "sweep"), 1)
	require.True(t, strings.HasPrefix(line, "pgidem: sweep: ERROR: permission denied for table pgidem_record"), line)
	require.NotContains(t, line, "unavailable")
	require.Equal(t, 1, countRecords(t, db.Pool, "pgidem_record"))
}
