package store

import "strings"

// statsStatements holds the statements of operators' statistics, with the tables'
// quoted names, which catalog statements take as parameters.
type statsStatements struct {
	recordTable, inboxTable string
	// recordStats counts each namespace's records by status, dead holders, takeovers and
	// sweepable records, with the namespace's oldest in-progress record (NULLs when
	// none) and the statement's time last.
	recordStats string
	// inboxStats counts the inbox rows and those past their retention.
	inboxStats string
}

func newStatsStatements(schema string) statsStatements {
	records := Qualify(schema, "pgidem_record")
	inbox := Qualify(schema, "pgidem_inbox")
	r := strings.NewReplacer("{t}", records, "{sweepable}", sweepableRecord("r."))
	return statsStatements{
		recordTable: records,
		inboxTable:  inbox,
		recordStats: r.Replace(`
WITH counts AS (
	SELECT namespace,
	       count(*) FILTER (WHERE status = 'in_progress'),
	       count(*) FILTER (WHERE status = 'completed'),
	       count(*) FILTER (WHERE status = 'failed'),
	       count(*) FILTER (WHERE status = 'parked'),
	       count(*) FILTER (WHERE status = 'in_progress' AND lease_expires_at <= statement_timestamp()),
	       count(*) FILTER (WHERE attempts > 1),
	       count(*) FILTER (WHERE {sweepable})
	FROM {t} r
	GROUP BY namespace
), oldest AS (
	SELECT DISTINCT ON (namespace) namespace, key, created_at, lease_expires_at
	FROM {t}
	WHERE status = 'in_progress'
	ORDER BY namespace, created_at, key
)
SELECT c.*, o.key, o.created_at, o.lease_expires_at, statement_timestamp()
FROM counts c LEFT JOIN oldest o USING (namespace)
ORDER BY c.namespace`),
		inboxStats: `SELECT count(*), count(*) FILTER (WHERE ` + expiredInbox("") + `) FROM ` + inbox,
	}
}
