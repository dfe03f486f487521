package store

// Notify sends one notification per payload ($2, text[]) on channel $1: the waiters of
// each finished record wake (pg_notify is delivered when the statement commits).
const Notify = `SELECT pg_notify($1, p) FROM unnest($2::text[]) AS p`

// Channel is the notification channel of the records in schema ("" names the search
// path's schema).
func Channel(schema string) string {
	if schema == "" {
		return "pgidem"
	}
	return "pgidem." + schema
}
