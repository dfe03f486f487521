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

func newSweepStatements(schema string) sweepStatements {
	records := strings.NewReplacer("{t}", Qualify(schema, "pgidem_record"))
	inbox := strings.NewReplacer("{t}", Qualify(schema, "pgidem_inbox"))
	return sweepStatements{
		SweepRecords: records.Replace(`
DELETE FROM {t}
WHERE (namespace, key) IN (
	SELECT namespace, key FROM {t}
	WHERE expires_at <= now()
		AND (status <> 'in_progress' OR lease_expires_at <= now())
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
		SweepInbox: inbox.Replace(`
DELETE FROM {t}
WHERE (consumer, message_id) IN (
	SELECT consumer, message_id FROM {t}
	WHERE expires_at <= now()
	LIMIT $1
	FOR UPDATE SKIP LOCKED
)`),
	}
}
