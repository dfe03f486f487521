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
// path's schema), or "" when the name would be too long for a channel or holds a quote or
// a backslash (it is written into the statements as a string literal): then nothing is
// notified and waiters poll.
func Channel(schema string) string {
	ch := "pgidem"
	if schema != "" {
		ch += "." + schema
	}
	if len(ch) > maxChannelBytes || strings.ContainsAny(ch, `'\`) {
		return ""
	}
	return ch
}

// NotifyPayload is the payload naming (namespace, key); control characters never occur
// in a valid namespace, so the separator is unambiguous.
func NotifyPayload(namespace, key string) string { return namespace + "\x1f" + key }

// notifyWaiters is the expression, over a finished row's namespace and key (qualified by
// alias, such as "r."), that notifies channel when a listener waits for the key. The
// exclusive try is released at once, so it neither waits nor holds anything. A payload
// the server would refuse, or a notification queue half full (a listener somewhere is
// stuck; a full one would fail the statement's commit), notifies nothing: the waiters
// poll. Its value is true when it notified. With no channel it is false.
func notifyWaiters(channel, alias string) string {
	if channel == "" {
		return "false"
	}
	ns, key := alias+"namespace", alias+"key"
	lock := "hashtext(" + ns + "), hashtext(" + key + ")"
	return `(CASE WHEN octet_length(` + ns + `) + octet_length(` + key + `) >= ` + strconv.Itoa(MaxNotifyPayload) + ` THEN false
	WHEN pg_try_advisory_lock(` + lock + `) THEN NOT pg_advisory_unlock(` + lock + `)
	WHEN pg_notification_queue_usage() > 0.5 THEN false
	ELSE pg_notify('` + channel + `', ` + ns + ` || chr(31) || ` + key + `) IS NOT NULL END)`
}

// LockInterest takes the listener's shared lock on each key named by $1 (namespaces) and
// $2 (keys), text arrays of one element per key, without waiting: a key some session
// holds exclusively is notified anyway. UnlockInterest gives them up; a key locked twice
// (two keys with one hash) is unlocked twice. Both run only in the session whose backend
// process is $3 (the listener's, read after its LISTEN) and return false elsewhere: behind
// a transaction-pooling proxy, where a session's locks would stay behind on other server
// connections, the listener stops instead.
const (
	LockInterest = `SELECT CASE WHEN pg_backend_pid() = $3 THEN (SELECT count(pg_try_advisory_lock_shared(hashtext(n), hashtext(k)))
	FROM unnest($1::text[], $2::text[]) AS u(n, k)) >= 0 ELSE false END`
	UnlockInterest = `SELECT CASE WHEN pg_backend_pid() = $3 THEN (SELECT count(pg_advisory_unlock_shared(hashtext(n), hashtext(k)))
	FROM unnest($1::text[], $2::text[]) AS u(n, k)) >= 0 ELSE false END`
)

// BackendPID reads the session's backend process id.
const BackendPID = `SELECT pg_backend_pid()`
