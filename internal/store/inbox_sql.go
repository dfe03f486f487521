package store

import "strings"

// inboxStatements holds the inbox's SQL with the table name quoted in.
type inboxStatements struct {
	// InboxRecord records a message, taking over a row past its retention; it returns
	// whether this call recorded it.
	InboxRecord string
	// readInbox reads one inbox row ($1 consumer, $2 message id); forgetInbox deletes it
	// and returns it. Their columns are [InboxRow.ScanTargets]'.
	readInbox, forgetInbox string
}

func newInboxStatements(schema string) inboxStatements {
	t := Qualify(schema, "pgidem_inbox")
	r := strings.NewReplacer("{t}", t, "{cols}", inboxColumns)
	return inboxStatements{
		readInbox:   r.Replace(`SELECT {cols} FROM {t} WHERE consumer = $1 AND message_id = $2`),
		forgetInbox: r.Replace(`DELETE FROM {t} WHERE consumer = $1 AND message_id = $2 RETURNING {cols}`),
		// Record the message in one statement: take over a row past its retention, else
		// insert; the one result column says whether this call recorded it.
		//
		// A live row is only read: the UPDATE's condition is judged on the statement's
		// snapshot, so it locks nothing, and ON CONFLICT DO NOTHING takes no lock and never
		// raises a unique violation (which would abort the caller's transaction). No
		// transaction id is assigned, so a duplicate costs a read. (ON CONFLICT DO UPDATE …
		// WHERE <expired> would do this in one clause, but it locks the conflicting row —
		// and assigns an xid — before judging the WHERE, so every duplicate would write.)
		//
		// Concurrency, under READ COMMITTED:
		//   - an expired row another transaction is taking over: the UPDATE waits for it;
		//     after its commit the UPDATE re-checks the new row version (live: nothing to
		//     take) and the INSERT conflicts, so the message is a duplicate; after its
		//     rollback the UPDATE takes the row over.
		//   - an expired row a sweep deletes meanwhile (before or while the UPDATE reaches
		//     it): the UPDATE skips the deleted row and the INSERT goes ahead, so an expired
		//     row behaves like no row even mid-statement.
		//   - a concurrent first insert: the INSERT waits for that transaction; after its
		//     commit it does nothing (duplicate), after its rollback it inserts.
		InboxRecord: r.Replace(`
WITH takeover AS (
	UPDATE {t} SET payload = $3::jsonb, received_at = statement_timestamp(),
		expires_at = statement_timestamp() + $4 * interval '1 microsecond'
	WHERE consumer = $1 AND message_id = $2 AND expires_at <= statement_timestamp()
	RETURNING true
), ins AS (
	INSERT INTO {t} (consumer, message_id, payload, received_at, expires_at)
	SELECT $1, $2, $3::jsonb, statement_timestamp(), statement_timestamp() + $4 * interval '1 microsecond'
	WHERE NOT EXISTS (SELECT FROM takeover)
	ON CONFLICT (consumer, message_id) DO NOTHING
	RETURNING true
)
SELECT EXISTS (SELECT FROM takeover) OR EXISTS (SELECT FROM ins)`),
	}
}
