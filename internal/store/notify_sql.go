package store

import (
	"strconv"
	"strings"
)

// Waiters are woken only where one waits. A listener (internal/protocol, notify.go) holds
// a shared advisory lock on (hashtext(namespace), hashtext(key)) for every key its
// waiters wait for; the statements that finish a record try that lock exclusively and
// notify only when the try fails, so a record nobody waits for costs no notification. The
// two-int lock form never meets the single-bigint locks of the transactional calls
// (txlock.go); a hash collision only sends a notification nobody needs.

// maxChannelBytes is the longest channel name pg_notify accepts (NAMEDATALEN - 1).
const maxChannelBytes = 63

// MaxNotifyPayload bounds a notification's payload below the server's limit (8000
// bytes); a longer key is not notified (its waiters poll).
const MaxNotifyPayload = 7900

// Channel is the notification channel of the records in schema ("" names the search
// path's schema), or "" when the name would be too long for a channel: then nothing is
// notified and waiters poll.
func Channel(schema string) string {
	ch := "pgidem"
	if schema != "" {
		ch += "." + schema
	}
	if len(ch) > maxChannelBytes {
		return ""
	}
	return ch
}

// NotifyPayload is the payload naming (namespace, key); control characters never occur
// in a valid namespace, so the separator is unambiguous.
func NotifyPayload(namespace, key string) string { return namespace + "\x1f" + key }

// notifyWaiters is the expression, over a finished row's namespace and key (qualified by
// alias, such as "r."), that notifies channel when a listener waits for the key. The
// exclusive try is released at once, so it neither waits nor holds anything. Its value is
// true when it notified. With no channel it is false.
func notifyWaiters(channel, alias string) string {
	if channel == "" {
		return "false"
	}
	ns, key := alias+"namespace", alias+"key"
	lock := "hashtext(" + ns + "), hashtext(" + key + ")"
	return `(CASE WHEN octet_length(` + ns + `) + octet_length(` + key + `) >= ` + strconv.Itoa(MaxNotifyPayload) + ` THEN false
	WHEN pg_try_advisory_lock(` + lock + `) THEN NOT pg_advisory_unlock(` + lock + `)
	ELSE pg_notify('` + strings.ReplaceAll(channel, "'", "''") + `', ` + ns + ` || chr(31) || ` + key + `) IS NOT NULL END)`
}

// LockInterest takes the listener's shared lock on each key named by $1 (namespaces) and
// $2 (keys), text arrays of one element per key; UnlockInterest gives them up. A key
// locked twice (two keys with one hash) is unlocked twice.
const (
	LockInterest   = `SELECT pg_advisory_lock_shared(hashtext(n), hashtext(k)) FROM unnest($1::text[], $2::text[]) AS u(n, k)`
	UnlockInterest = `SELECT pg_advisory_unlock_shared(hashtext(n), hashtext(k)) FROM unnest($1::text[], $2::text[]) AS u(n, k)`
)
