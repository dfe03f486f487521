package store

import "strings"

// sweepStatements delete one batch of expired rows each ($1: the batch size). SKIP LOCKED
// lets concurrent sweeps split the work instead of queueing.
type sweepStatements struct {
	// SweepRecords deletes expired records. A live holder's row is never expired: the
	// heartbeat keeps expires_at ahead of its lease.
	SweepRecords string
	// SweepInbox deletes inbox rows past their retention.
	SweepInbox string
}

// sweepableRecord is true for a record that a sweep deletes: past its TTL and not in
// progress under a live lease. alias qualifies the columns ("r." in a statement that
// names the table r). Listings and statistics count expired records by it too.
func sweepableRecord(alias string) string {
	return `(` + alias + `expires_at <= statement_timestamp() AND (` + alias + `status <> 'in_progress' OR ` +
		alias + `lease_expires_at <= statement_timestamp()))`
}

// expiredInbox is true for an inbox row past its retention, which a sweep deletes. alias
// qualifies the columns.
func expiredInbox(alias string) string {
	return `(` + alias + `expires_at <= statement_timestamp())`
}

func newSweepStatements(schema string) sweepStatements {
	records := strings.NewReplacer("{t}", Qualify(schema, "pgidem_record"), "{sweepable}", sweepableRecord(""))
	inbox := strings.NewReplacer("{t}", Qualify(schema, "pgidem_inbox"), "{expired}", expiredInbox(""))
	return sweepStatements{
		SweepRecords: records.Replace(`
DELETE FROM {t}
WHERE (namespace, key) IN (
	SELECT namespace, key FROM {t}
	WHERE {sweepable}
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
		SweepInbox: inbox.Replace(`
DELETE FROM {t}
WHERE (consumer, message_id) IN (
	SELECT consumer, message_id FROM {t}
	WHERE {expired}
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
	}
}
