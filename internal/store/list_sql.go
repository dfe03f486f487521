package store

import "strings"

// listStatements holds the statements operators' tools use to list records and inbox
// rows. Every filter is a parameter, "" (or false, or 0) for none; the LIMIT is always
// bound, the largest bigint for none.
type listStatements struct {
	// listRecords lists records newest first without their result and error (NULL):
	// $1 namespace, $2 status, $3 minimum attempts, $4 sweepable only, $5 limit. The
	// columns are namespace and key, then [Row.ScanTargets]'.
	listRecords string
	// listRecordsValues is listRecords with each record's result and error, read by scalar
	// subqueries on the primary key (in the statement's snapshot: the same row). Postgres
	// evaluates such expensive output expressions after the ORDER BY and the LIMIT, so
	// only the records returned have their values read, and no value is sorted; reading
	// r.result in the select list would carry every matching record's value through the
	// sort. Hence the LIMIT is always there.
	listRecordsValues string
	// listInbox lists inbox rows newest first: $1 consumer, $2 message id, $3 expired
	// only, $4 limit. The columns are [InboxRow.ScanTargets]'.
	listInbox string
}

// inboxColumns are the columns of an inbox statement, in InboxRow.ScanTargets' order.
const inboxColumns = `consumer, message_id, payload, received_at, expires_at,
	expires_at <= statement_timestamp() AS expired, statement_timestamp() AS db_now`

func newListStatements(schema string) listStatements {
	records := strings.NewReplacer("{t}", Qualify(schema, "pgidem_record"), "{sweepable}", sweepableRecord("r."))
	list := `
SELECT r.namespace, r.key, {cols} FROM {t} r
WHERE ($1 = '' OR r.namespace = $1) AND ($2 = '' OR r.status = $2) AND r.attempts >= $3
	AND (NOT $4 OR {sweepable})
ORDER BY r.created_at DESC, r.namespace, r.key
LIMIT $5`
	values := rowColumnsWith(
		`(SELECT v.result FROM {t} v WHERE v.namespace = r.namespace AND v.key = r.key)`,
		`(SELECT v.error FROM {t} v WHERE v.namespace = r.namespace AND v.key = r.key)`)
	inbox := strings.NewReplacer("{t}", Qualify(schema, "pgidem_inbox"), "{cols}", inboxColumns, "{expired}", expiredInbox(""))
	return listStatements{
		listRecords:       records.Replace(strings.Replace(list, "{cols}", rowColumnsWith("NULL::jsonb", "NULL::jsonb"), 1)),
		listRecordsValues: records.Replace(strings.Replace(list, "{cols}", values, 1)),
		listInbox: inbox.Replace(`
SELECT {cols} FROM {t}
WHERE ($1 = '' OR consumer = $1) AND ($2 = '' OR message_id = $2) AND (NOT $3 OR {expired})
ORDER BY received_at DESC, consumer, message_id
LIMIT $4`),
	}
}
