package migrations_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/migrations"
	"github.com/pgidem/pgidem/pgidem"
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

// sweepTracer records the SQL and arguments of the DELETE statements run through a pool.
type sweepTracer struct {
	mu      sync.Mutex
	deletes []pgx.TraceQueryStartData
}

func (st *sweepTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(strings.TrimSpace(data.SQL), "DELETE") {
		st.mu.Lock()
		st.deletes = append(st.deletes, data)
		st.mu.Unlock()
	}
	return ctx
}

func (*sweepTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// DESIGN "Data model": pgidem_record (and pgidem_inbox, swept the same way) has an index
// that lets the sweeper find expired rows without a scan. After the migrations, an index
// of each table leads with expires_at, and the DELETE statements pgidem's own Sweep sends
// (recorded by a tracer on its pool, then explained with their arguments) read it, not
// the whole table, on a table of live rows with a few expired ones.
func TestSweepIndex(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tdb := testdb.NewUnmigrated(t)
	db := open(t, tdb.URL, "")
	_, err := migrations.Up(ctx, db, nil)
	require.NoError(t, err)

	fills := map[string]string{
		"pgidem_record": `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, completed_at)
			SELECT 'ns', 'k' || i, 'completed', gen_random_uuid(), '1',
				now() + CASE WHEN i <= 5 THEN interval '-1 hour' ELSE interval '1 day' END, now()
			FROM generate_series(1, 20000) AS i`,
		"pgidem_inbox": `INSERT INTO pgidem_inbox (consumer, message_id, expires_at)
			SELECT 'c', 'm' || i, now() + CASE WHEN i <= 5 THEN interval '-1 hour' ELSE interval '1 day' END
			FROM generate_series(1, 20000) AS i`,
	}
	indexes := map[string]string{}
	for table, fill := range fills {
		var index string
		err := db.QueryRowContext(ctx, `
			SELECT c.relname FROM pg_catalog.pg_index i
			JOIN pg_catalog.pg_class c ON c.oid = i.indexrelid
			JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
			WHERE i.indrelid = $1::regclass AND a.attname = 'expires_at' AND i.indisvalid AND i.indpred IS NULL
			ORDER BY c.relname LIMIT 1`, table).Scan(&index)
		require.NoError(t, err, "%s has no valid index leading with expires_at", table)
		indexes[table] = index
		_, err = db.ExecContext(ctx, fill)
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, `ANALYZE `+table)
		require.NoError(t, err)
	}

	tracer := &sweepTracer{}
	cfg, err := pgxpool.ParseConfig(tdb.URL)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	coord, err := pgidem.NewCoordinator(pool, nil)
	require.NoError(t, err)
	res, err := coord.Sweep(ctx, &pgidem.SweepOpts{MaxBatches: 1})
	require.NoError(t, err)
	require.Equal(t, pgidem.SweepResult{Records: 5, Inbox: 5}, pgidem.SweepResult{Records: res.Records, Inbox: res.Inbox})
	require.Len(t, tracer.deletes, 2, "one DELETE per table")

	for _, del := range tracer.deletes {
		table := "pgidem_record"
		if strings.Contains(del.SQL, "pgidem_inbox") {
			table = "pgidem_inbox"
		}
		var out string
		require.NoError(t, pool.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+del.SQL, del.Args...).Scan(&out))
		var plan any
		require.NoError(t, json.Unmarshal([]byte(out), &plan))
		usesIndex, seqScan := sweepPlanUses(plan, indexes[table], table)
		require.True(t, usesIndex, "the sweep of %s does not use %s:\n%s", table, indexes[table], out)
		require.False(t, seqScan, "the sweep of %s scans the table:\n%s", table, out)
	}
}
