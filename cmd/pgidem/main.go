// Command pgidem is the operator's tool for pgidem: it runs pgidem's migrations, inspects and
// forgets idempotency records and inbox rows, sweeps expired rows and prints per-namespace
// statistics.
//
// Install it from a clone of the repository with
//
//	go install ./cmd/pgidem
//
// (or go install github.com/pgidem/pgidem/cmd/pgidem@latest once the module is published).
//
// # Commands
//
//	pgidem migrate up|down|status|version   pgidem's schema (own version table and lock).
//	                                        up --river also migrates River under a lock.
//	pgidem records list                     Records, filtered by namespace, status, attempts, expiry.
//	pgidem records show NAMESPACE KEY       One record in full.
//	pgidem records forget NAMESPACE KEY     Delete a record so its effect can run again.
//	pgidem inbox list|show|forget           Inbox rows: the messages a consumer handled.
//	pgidem sweep                            Delete expired records and inbox rows (cron, without River).
//	pgidem stats                            Per-namespace counts, stuck and taken-over records, size.
//
// # Connection
//
// The database comes from --database-url, else the DATABASE_URL environment variable, else
// libpq's PG* variables (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGSERVICE, …) with
// libpq's defaults. Both URLs (postgres://user@host:5432/db) and keyword/value strings
// (host=… dbname=…) are accepted. Unless the connection string (or PGCONNECT_TIMEOUT) sets
// a positive connect_timeout the CLI gives up connecting after 10 seconds; this includes an
// explicit connect_timeout=0, which libpq takes as "wait forever" (pgx reports it the same
// as no setting). A connection error names the address tried and where it came from, never
// the password; a connection string that cannot be parsed and may contain a password is
// reported by its source only, without its text. The CLI's sessions use the UTC time zone,
// whatever the connection string or the server says. --schema names the schema holding
// pgidem's tables (at most 63 bytes, compared exactly: IDEM is not idem); by default they
// are found through the connection's search_path. An explicitly empty --database-url or
// --schema (an unset shell variable) is a usage error, not the default.
//
// # Output and exit codes
//
// Results go to standard output as aligned tables, or as JSON with --json (<, > and &
// written as they are). In tables a namespace, key, consumer or message id with white
// space, a quote or a character that does not print (and "" and "-") is quoted in Go
// syntax. So "order-9 " and "order-9" differ; show and forget take it unquoted. A key
// with a control character, which only SQL can store, is shown as "order\t9": pass it in
// bash as $'order\t9'. Errors go to standard error as one line starting with "pgidem: ".
//
// The exit code is:
//   - 0 on success.
//   - 1 when the command failed, including an unreachable or unparsable database address,
//     a missing record, or a refused forget. Also 1 when its output could not be written
//     (a full disk, say); the message then says whether the command itself succeeded.
//   - 2 for a usage error: an unknown command or flag, a malformed or empty flag value, or
//     wrong arguments. Wrong arguments are an empty namespace or key, or one that is not
//     valid UTF-8, which no row can hold.
//
// Like other Unix commands, pgidem writing to a closed pipe (pgidem records list | head -1)
// is ended by SIGPIPE (exit status 141 in the shell).
//
// # Interrupts
//
// SIGINT (Ctrl-C) or SIGTERM stops the command, which says "interrupted" and what it
// interrupted. The statement in flight is cancelled on the server, whose answer (awaited
// for up to 3 seconds) tells forget and sweep what they deleted: a cancelled forget
// deleted nothing. Without an answer the outcome is unknown, and the message says so. A
// second SIGINT or SIGTERM ends the process at once, without a word.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	go func() {
		// The first signal ends ctx, and the command winds down (up to interruptGrace and
		// interruptCloseWait). Restore the default handling at once, so that a second
		// Ctrl-C ends the process instead of being swallowed.
		<-ctx.Done()
		stop()
	}()
	code := run(ctx, os.Args[1:], &env{
		stdout: os.Stdout,
		stderr: os.Stderr,
		getenv: os.Getenv,
	})
	stop()
	os.Exit(code)
}
