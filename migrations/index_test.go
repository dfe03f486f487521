package migrations_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
)

// sweepPlanUses reports whether an EXPLAIN (FORMAT JSON) plan reads index anywhere, and whether
// it scans table sequentially anywhere.
func sweepPlanUses(plan any, index, table string) (usesIndex, seqScan bool) {
	switch v := plan.(type) {
	case map[string]any:
		if v["Index Name"] == index {
			usesIndex = true
		}
		if v["Node Type"] == "Seq Scan" && v["Relation Name"] == table {
			seqScan = true
		}
		for _, child := range v {
			u, s := sweepPlanUses(child, index, table)
			usesIndex, seqScan = usesIndex || u, seqScan || s
		}
	case []any:
		for _, child := range v {
			u, s := sweepPlanUses(child, index, table)
			usesIndex, seqScan = usesIndex || u, seqScan || s
		}
	}
	return usesIndex, seqScan
}

// DESIGN "Data model": pgidem_record (and pgidem_inbox, swept the same way) has an index
// that lets the sweeper find expired rows without a scan: after the migrations, an index
// leads with expires_at, and the sweep's DELETE (the statement of pgidem's sweep.go,
// store.go and inbox.go) reads it, not the whole table, on a table of live rows with a
// few expired ones.
func TestSweepIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	_, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)

	tests := []struct {
		table, fill, sweep string
	}{
		{
			table: "pgidem_record",
			fill: `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
				SELECT 'ns', 'k' || i, 'completed', gen_random_uuid(), '1',
					now() + CASE WHEN i <= 5 THEN interval '-1 hour' ELSE interval '1 day' END, now()
				FROM generate_series(1, 20000) AS i`,
			sweep: `DELETE FROM pgidem_record
				WHERE (namespace, key) IN (
					SELECT namespace, key FROM pgidem_record
					WHERE expires_at <= now()
						AND (status <> 'in_progress' OR lease_expires_at <= now())
					LIMIT 1000
					FOR UPDATE SKIP LOCKED
				)`,
		},
		{
			table: "pgidem_inbox",
			fill: `INSERT INTO pgidem_inbox (consumer, message_id, expires_at)
				SELECT 'c', 'm' || i, now() + CASE WHEN i <= 5 THEN interval '-1 hour' ELSE interval '1 day' END
				FROM generate_series(1, 20000) AS i`,
			sweep: `DELETE FROM pgidem_inbox
				WHERE (consumer, message_id) IN (
					SELECT consumer, message_id FROM pgidem_inbox
					WHERE expires_at <= now()
					LIMIT 1000
					FOR UPDATE SKIP LOCKED
				)`,
		},
	}
	for _, tt := range tests {
		var index string
		err := db.QueryRowContext(ctx, `
			SELECT c.relname FROM pg_catalog.pg_index i
			JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
			JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
			WHERE i.indrelid = $1::regclass AND a.attname = 'expires_at' AND i.indisvalid AND i.indpred IS NULL
			ORDER BY c.relname LIMIT 1`, tt.table).Scan(&index)
		require.NoError(t, err, "%s has no valid index leading with expires_at", tt.table)

		_, err = db.ExecContext(ctx, tt.fill)
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, `ANALYZE `+tt.table)
		require.NoError(t, err)
		var out string
		require.NoError(t, db.QueryRowContext(ctx, `EXPLAIN (FORMAT JSON) `+tt.sweep).Scan(&out))
		var plan any
		require.NoError(t, json.Unmarshal([]byte(out), &plan))
		usesIndex, seqScan := sweepPlanUses(plan, index, tt.table)
		require.True(t, usesIndex, "the sweep of %s does not use %s:\n%s", tt.table, index, out)
		require.False(t, seqScan, "the sweep of %s scans the table:\n%s", tt.table, out)
	}
}
