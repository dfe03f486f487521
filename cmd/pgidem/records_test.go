package main_test

import (
	"context"
	"encoding/json"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
	"github.com/pgidem/pgidem/pgidem"
)

func TestRecordsList(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)

	keys := func(t *testing.T, args ...string) []string {
		t.Helper()
		var records []struct {
			Namespace string `json:"namespace"`
			Key       string `json:"key"`
		}
		out := requireOK(t, cli(t, db.URL, append([]string{"records", "list", "--json"}, args...)...))
		require.NoError(t, json.Unmarshal([]byte(out), &records))
		var got []string
		for _, r := range records {
			got = append(got, r.Namespace+"/"+r.Key)
		}
		return got
	}

	t.Run("Table", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "records", "list"))
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 6)
		require.Equal(t, []string{"NAMESPACE", "KEY", "STATUS", "ATTEMPTS", "AGE", "LEASE", "EXPIRES"}, strings.Fields(lines[0]))
		// Newest first.
		require.Equal(t, []string{"invoices", "order-10.invoice", "in_progress", "1", "1h0m", "in", "1h0m", "in", "1d0h"}, strings.Fields(lines[1]))
		require.Equal(t, []string{"invoices", "order-9.invoice", "completed", "2", "2h0m", "-", "in", "23h0m"}, strings.Fields(lines[2]))
		require.Equal(t, []string{"mail", "order-8.receipt", "completed", "1", "3h0m", "-", "in", "1h0m"}, strings.Fields(lines[3]))
		require.Equal(t, []string{"invoices", "order-7.invoice", "in_progress", "1", "4h0m", "expired", "1h0m", "ago", "in", "20h0m"}, strings.Fields(lines[4]))
		require.Equal(t, []string{"mail", "order-9.receipt", "failed", "1", "1d1h", "-", "expired", "1h0m", "ago"}, strings.Fields(lines[5]))
	})

	t.Run("Filters", func(t *testing.T) {
		require.Equal(t, []string{"invoices/order-10.invoice", "invoices/order-9.invoice", "invoices/order-7.invoice"},
			keys(t, "--namespace", "invoices"))
		require.Equal(t, []string{"invoices/order-10.invoice", "invoices/order-7.invoice"}, keys(t, "--status", "in_progress"))
		require.Equal(t, []string{"invoices/order-9.invoice"}, keys(t, "--min-attempts", "2"))
		require.Equal(t, []string{"mail/order-9.receipt"}, keys(t, "--expired"))
		require.Equal(t, []string{"mail/order-8.receipt"}, keys(t, "--namespace", "mail", "--status", "completed"))
		require.Equal(t, []string{"invoices/order-10.invoice", "invoices/order-9.invoice"}, keys(t, "--limit", "2"))
		require.Len(t, keys(t, "--limit", "0"), 5)
		require.Empty(t, keys(t, "--namespace", "nope'; DROP TABLE pgidem_record; --"))
		require.Equal(t, 5, countRecords(t, db.Pool, "pgidem_record"))
	})

	t.Run("LimitNotice", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "records", "list", "--limit", "1"))
		require.Contains(t, out, "(first 1 record; raise --limit for more)")
		out = requireOK(t, cli(t, db.URL, "records", "list", "--limit", "4"))
		require.Len(t, strings.Split(strings.TrimSpace(out), "\n"), 1+4+1, "header, 4 records, the note")
		require.Contains(t, out, "(first 4 records; raise --limit for more)")
		require.Len(t, keys(t, "--limit", "4"), 4)
	})

	t.Run("NoLimitNoticeWhenExact", func(t *testing.T) {
		// Exactly --limit records match: none is left out.
		out := requireOK(t, cli(t, db.URL, "records", "list", "--limit", "5"))
		require.NotContains(t, out, "raise --limit")
		require.Len(t, strings.Split(strings.TrimSpace(out), "\n"), 1+5)
		out = requireOK(t, cli(t, db.URL, "records", "list", "--namespace", "mail", "--limit", "2"))
		require.NotContains(t, out, "raise --limit")
	})

	t.Run("Empty", func(t *testing.T) {
		require.Equal(t, "no records match\n", requireOK(t, cli(t, db.URL, "records", "list", "--namespace", "none")))
		require.Equal(t, "[]\n", requireOK(t, cli(t, db.URL, "records", "list", "--namespace", "none", "--json")))
	})

	t.Run("JSONFields", func(t *testing.T) {
		var records []map[string]any
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "list", "--json", "--min-attempts", "2"))), &records))
		require.Len(t, records, 1)
		r := records[0]
		require.Equal(t, "completed", r["status"])
		require.Equal(t, float64(2), r["attempts"])
		require.Equal(t, true, r["took_over"])
		require.Equal(t, map[string]any{"invoice_id": "inv_1001", "amount_cents": float64(4200)}, r["result"])
		require.Nil(t, r["lease_remaining_seconds"])
		require.InDelta(t, 7230, r["age_seconds"], 600)
	})

	t.Run("BadFilters", func(t *testing.T) {
		line := requireFail(t, cli(t, db.URL, "records", "list", "--status", "done"), 2)
		require.Contains(t, line, "--status must be one of")
		require.Contains(t, line, "parked")
		requireFail(t, cli(t, db.URL, "records", "list", "--min-attempts", "x"), 2)
		requireFail(t, cli(t, db.URL, "records", "list", "--limit", "-1"), 2)
		requireFail(t, cli(t, db.URL, "records", "list", "extra"), 2)
		// Values that parse as an int but do not fit the query's parameters are usage
		// errors too, not database failures.
		require.Contains(t, requireFail(t, cli(t, db.URL, "records", "list", "--min-attempts", "3000000000"), 2),
			"--min-attempts must be between 0 and 2147483647, got 3000000000")
		require.Contains(t, requireFail(t, cli(t, db.URL, "records", "list", "--limit", "9223372036854775807"), 2),
			"--limit must be between 0 (no limit) and 2147483647")
		require.Contains(t, requireFail(t, cli(t, db.URL, "records", "list", "--namespace", "mail\xff"), 2),
			`--namespace "mail\xff" is not valid UTF-8`)
		require.Empty(t, keys(t, "--min-attempts", "2147483647", "--limit", "2147483647"), "the bounds themselves are accepted")
	})
}

func TestRecordsShow(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)

	t.Run("Table", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "records", "show", "invoices", "order-9.invoice"))
		require.Contains(t, out, "status         completed\n")
		require.Contains(t, out, "attempts       2 (taken over: the effect may have run more than once)\n")
		require.Contains(t, out, `result         {"invoice_id": "inv_1001", "amount_cents": 4200}`)
		require.Contains(t, out, "lease expires  -\n")
		require.Regexp(t, `expires +\S+ \(in 23h0m\)`, out)
	})

	t.Run("InProgress", func(t *testing.T) {
		out := requireOK(t, cli(t, db.URL, "records", "show", "invoices", "order-7.invoice"))
		require.Regexp(t, `lease expires +\S+ \(expired 1h0m ago\)`, out)
		require.Contains(t, out, "result         -\n")
	})

	t.Run("JSON", func(t *testing.T) {
		var r map[string]any
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "show", "mail", "order-9.receipt", "--json"))), &r))
		require.Equal(t, "failed", r["status"])
		require.Equal(t, map[string]any{"message": "mailbox unavailable"}, r["error"])
		require.Equal(t, true, r["expired"])
	})

	t.Run("Missing", func(t *testing.T) {
		line := requireFail(t, cli(t, db.URL, "records", "show", "invoices", "order-404"), 1)
		require.Equal(t, `pgidem: no record for namespace "invoices" key "order-404"`, line)
	})

	t.Run("WrongArgs", func(t *testing.T) {
		line := requireFail(t, cli(t, db.URL, "records", "show", "invoices"), 2)
		require.Contains(t, line, "takes 2 arguments (NAMESPACE KEY), got 1")
		// An empty --namespace (an unset variable) would list every namespace.
		line = requireFail(t, cli(t, db.URL, "records", "list", "--namespace", ""), 2)
		require.Contains(t, line, "--namespace must not be empty")
	})
}

func TestRecordsForget(t *testing.T) {
	t.Parallel()

	t.Run("RefusesLiveInProgress", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t)
		insert(t, db.Pool, "pgidem_record", standardFixtures()...)

		line := requireFail(t, cli(t, db.URL, "records", "forget", "invoices", "order-10.invoice"), 1)
		require.Contains(t, line, `refusing to forget namespace "invoices" key "order-10.invoice"`)
		require.Contains(t, line, "pass --force")
		require.Equal(t, 5, countRecords(t, db.Pool, "pgidem_record"))

		r := cli(t, db.URL, "records", "forget", "invoices", "order-10.invoice", "--force")
		require.Zero(t, r.code, r.stderr)
		require.Contains(t, r.stderr, "warning: the record was in progress under a live lease")
		out := r.stdout
		require.True(t, strings.HasPrefix(out, "deleted:\n"), out)
		require.Contains(t, out, "key            order-10.invoice\n")
		require.Contains(t, out, "status         in_progress\n")
		require.Equal(t, 4, countRecords(t, db.Pool, "pgidem_record"))
	})

	t.Run("Deletes", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t)
		insert(t, db.Pool, "pgidem_record", standardFixtures()...)

		out := requireOK(t, cli(t, db.URL, "records", "forget", "invoices", "order-9.invoice"))
		require.Contains(t, out, "deleted:\n")
		require.Contains(t, out, `result         {"invoice_id": "inv_1001", "amount_cents": 4200}`)

		// A dead holder (lease expired) needs no --force.
		var res struct {
			Deleted struct {
				Key          string `json:"key"`
				Status       string `json:"status"`
				LeaseExpired bool   `json:"lease_expired"`
			} `json:"deleted"`
		}
		require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "forget", "invoices", "order-7.invoice", "--json"))), &res))
		require.Equal(t, "order-7.invoice", res.Deleted.Key)
		require.True(t, res.Deleted.LeaseExpired)
		require.Equal(t, 3, countRecords(t, db.Pool, "pgidem_record"))

		line := requireFail(t, cli(t, db.URL, "records", "forget", "invoices", "order-9.invoice"), 1)
		require.Equal(t, `pgidem: no record for namespace "invoices" key "order-9.invoice"; nothing deleted`, line)
	})

	t.Run("LiveCoordinatorHolder", func(t *testing.T) {
		t.Parallel()
		db := testdb.New(t)
		coord, err := pgidem.NewCoordinator(db.Pool, nil)
		require.NoError(t, err)

		entered, release := make(chan struct{}), make(chan struct{})
		done := make(chan error, 1)
		go func() {
			_, err := pgidem.Do(context.Background(), coord, "mail", "order-9.receipt", time.Hour, nil,
				func(context.Context) (string, error) {
					close(entered)
					<-release
					return "sent", nil
				})
			done <- err
		}()
		<-entered

		line := requireFail(t, cli(t, db.URL, "records", "forget", "mail", "order-9.receipt"), 1)
		require.Contains(t, line, "in progress under a live lease")
		close(release)
		require.NoError(t, <-done)

		out := requireOK(t, cli(t, db.URL, "records", "forget", "mail", "order-9.receipt"))
		require.Contains(t, out, `result         "sent"`)
		_, err = coord.Lookup(context.Background(), "mail", "order-9.receipt")
		require.ErrorIs(t, err, pgidem.ErrNotFound)
	})
}

// lockToast holds, in a transaction of its own until the returned function ends it, an
// ACCESS EXCLUSIVE lock on the index of pgidem_record's TOAST table (REINDEX takes it and
// keeps it to the end of the transaction). Reading any value stored out of line looks it
// up in that index, so every such read waits for the lock; values stored in the row are
// read as usual.
func lockToast(t *testing.T, db *testdb.DB) (release func()) {
	t.Helper()
	ctx := context.Background()
	var index string
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT i.indexrelid::regclass::text
		FROM pg_catalog.pg_index i JOIN pg_catalog.pg_class c ON c.reltoastrelid = i.indrelid
		WHERE c.oid = 'pgidem_record'::regclass`).Scan(&index))
	tx, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "REINDEX INDEX "+index)
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { require.NoError(t, tx.Rollback(ctx)) }) }
	t.Cleanup(release)
	return release
}

// withLockTimeout returns rawURL with a lock_timeout for the sessions it opens: a
// statement that waits for a lock longer fails with lock_not_available.
func withLockTimeout(t *testing.T, rawURL, timeout string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	q := u.Query()
	q.Set("lock_timeout", timeout)
	u.RawQuery = q.Encode()
	return u.String()
}

// records list reads no record's result or error for its table output, and --json reads
// those of the records it prints only, whatever else matches. The values of the records
// beyond the printed page are stored out of line, and lockToast blocks every read of
// them while the commands run with a lock_timeout: a read would fail the command, so a
// command that succeeds read none of them. No statistics and no timing are involved.
// parkRecord makes the record of (namespace, key) parked the way the library does: a
// holder died with the key at the attempts cap, and the next call parks it.
func parkRecord(t *testing.T, db *testdb.DB, namespace, key string, attempts int) {
	t.Helper()
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, attempts, lease_expires_at, expires_at, updated_at)
		VALUES ($1, $2, 'in_progress', gen_random_uuid(), $3, now() - interval '1 second', now() + interval '1 hour', now() - interval '1 minute')`,
		namespace, key, attempts)
	require.NoError(t, err)
	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{MaxAttempts: attempts})
	require.NoError(t, err)
	_, err = pgidem.Do(ctx, coord, namespace, key, time.Hour, nil, func(context.Context) (int, error) { return 1, nil })
	require.ErrorIs(t, err, pgidem.ErrParked)
}

// A parked record is listed by --status parked and forgotten without --force; the next
// call with its key runs the effect again.
func TestRecordsParked(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", standardFixtures()...)
	parkRecord(t, db, "mail", "order-11.receipt", 3)

	out := requireOK(t, cli(t, db.URL, "records", "list", "--status", "parked"))
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, out)
	require.Equal(t, []string{"mail", "order-11.receipt", "parked", "3"}, strings.Fields(lines[1])[:4])
	require.Equal(t, "-", strings.Fields(lines[1])[5], "a parked record has no lease")

	var listed []struct {
		Key    string          `json:"key"`
		Status string          `json:"status"`
		Error  json.RawMessage `json:"error"`
	}
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "list", "--status", "parked", "--json"))), &listed))
	require.Len(t, listed, 1)
	require.Equal(t, "parked", listed[0].Status)
	require.Contains(t, string(listed[0].Error), "parked after 3 attempts")

	out = requireOK(t, cli(t, db.URL, "records", "forget", "mail", "order-11.receipt"))
	require.Contains(t, out, "deleted:\n")
	require.Contains(t, out, "status         parked\n")
	require.Equal(t, "no records match\n", requireOK(t, cli(t, db.URL, "records", "list", "--status", "parked")))

	coord, err := pgidem.NewCoordinator(db.Pool, &pgidem.Config{MaxAttempts: 3})
	require.NoError(t, err)
	res, err := pgidem.DoResult(context.Background(), coord, "mail", "order-11.receipt", time.Hour, nil,
		func(context.Context) (int, error) { return 7, nil })
	require.NoError(t, err)
	require.Equal(t, pgidem.OutcomeExecuted, res.Outcome)
	require.Equal(t, 7, res.Value)
}

func TestRecordsListLargeValues(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testdb.New(t)
	// 20 records with a result of 192 kB each. The two newest (k1, k2) hold one repeated
	// letter, which compresses to about 2 kB: with the column's storage MAIN it stays in
	// the row. The others hold hex text that does not compress, stored out of line in the
	// TOAST table.
	_, err := db.Pool.Exec(ctx, `ALTER TABLE pgidem_record ALTER COLUMN result SET STORAGE MAIN`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, `INSERT INTO pgidem_record (namespace, key, status, owner, result, expires_at, created_at)
		SELECT 'big', 'k' || i, 'completed', gen_random_uuid(),
			CASE WHEN i <= 2 THEN to_jsonb(repeat(chr(96 + i), 192000))
				ELSE to_jsonb((SELECT string_agg(md5(i::text || '/' || j::text), '') FROM generate_series(1, 6000) j)) END,
			now() + interval '1 day', now() - make_interval(secs => i)
		FROM generate_series(1, 20) i`)
	require.NoError(t, err)

	release := lockToast(t, db)
	// One second is how long a read of a value stored out of line waits before it fails;
	// the commands that read none never wait.
	locked := withLockTimeout(t, db.URL, "1s")
	line := requireFail(t, cli(t, locked, "records", "show", "big", "k3"), 1)
	require.Contains(t, line, "lock timeout", "the test needs results stored out of line, and the lock to block reading them")
	require.Contains(t, requireOK(t, cli(t, locked, "records", "show", "big", "k1")), "result ", "k1's result is stored in the row")

	out := requireOK(t, cli(t, locked, "records", "list"))
	require.Len(t, strings.Split(strings.TrimSpace(out), "\n"), 1+20, "the table output reads no result")

	var records []struct {
		Key    string          `json:"key"`
		Result json.RawMessage `json:"result"`
	}
	out = requireOK(t, cli(t, locked, "records", "list", "--json", "--limit", "2"))
	require.NoError(t, json.Unmarshal([]byte(out), &records), "--json reads the results of the records it prints only")
	require.Len(t, records, 2)
	require.Equal(t, []string{"k1", "k2"}, []string{records[0].Key, records[1].Key}, "newest first")
	require.Len(t, records[0].Result, 2+192000)
	require.Equal(t, `"`+strings.Repeat("b", 192000)+`"`, string(records[1].Result))

	// Without a limit every result is printed, newest first.
	release()
	require.NoError(t, json.Unmarshal([]byte(requireOK(t, cli(t, db.URL, "records", "list", "--json", "--limit", "0"))), &records))
	require.Len(t, records, 20)
	require.Equal(t, "k20", records[19].Key)
	require.Len(t, records[19].Result, 2+192000)
}

// The sample refusal of records forget in docs/inspect.md is the message the command
// prints.
func TestInspectDocForgetRefusal(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/inspect.md")
	require.NoError(t, err)
	var sample string
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "pgidem: refusing to forget ") {
			sample = line
		}
	}
	require.NotEmpty(t, sample, "docs/inspect.md shows no refusal")

	db := testdb.New(t)
	insert(t, db.Pool, "pgidem_record", fixture{namespace: "invoices", key: "order-12.invoice", status: "in_progress",
		leaseIn: time.Hour, expiresIn: 24 * time.Hour, age: 2 * time.Minute})
	line := requireFail(t, cli(t, db.URL, "records", "forget", "invoices", "order-12.invoice"), 1)
	variable := regexp.MustCompile(`\(expires in [^,]+, owner [0-9a-f-]+\)`)
	require.Equal(t, variable.ReplaceAllString(line, "(LEASE, OWNER)"), variable.ReplaceAllString(sample, "(LEASE, OWNER)"))
}
