package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// recordTable is the name of pgidem's record table (migrations/sql/00001).
const recordTable = "pgidem_record"

// inboxTable is the name of pgidem's inbox table (migrations/sql/00002).
const inboxTable = "pgidem_inbox"

// store runs the CLI's read and forget queries. Every identifier is quoted with
// pgx.Identifier and every user-supplied value is a query parameter.
type store struct {
	pool   *pgxpool.Pool
	schema string
	// table is the quoted, optionally schema-qualified record table.
	table string
	// display is the record table's name for people: schema.pgidem_record.
	display string
	// inbox and inboxDisplay are the same for the inbox table.
	inbox, inboxDisplay string
}

func newStore(pool *pgxpool.Pool, schema string) *store {
	name := func(table string) (quoted, display string) {
		if schema == "" {
			return pgx.Identifier{table}.Sanitize(), table
		}
		return pgx.Identifier{schema, table}.Sanitize(), schema + "." + table
	}
	s := &store{pool: pool, schema: schema}
	s.table, s.display = name(recordTable)
	s.inbox, s.inboxDisplay = name(inboxTable)
	return s
}

// withStore connects and runs fn with a store.
func (a *app) withStore(ctx context.Context, fn func(*store) error) error {
	pool, err := a.connectPool(ctx)
	if err != nil {
		return err
	}
	defer closePool(ctx, pool)
	return fn(newStore(pool, a.schema))
}

// withStoreDeleting is [app.withStore] for a command that deletes: interrupted while
// connecting, it adds that nothing was deleted.
func (a *app) withStoreDeleting(ctx context.Context, fn func(*store) error) error {
	connected := false
	err := a.withStore(ctx, func(s *store) error {
		connected = true
		return fn(s)
	})
	var ie *interruptedError
	if !connected && errors.As(err, &ie) {
		return interruptedf("%s; nothing was deleted", ie.msg)
	}
	return err
}

// translate turns a database error into an actionable message; an error after an
// interrupt says "interrupted".
func (s *store) translate(ctx context.Context, op string, err error) error {
	if ctx.Err() != nil {
		return interruptedf("pgidem: %s: interrupted", op)
	}
	if missing := s.missingTable(ctx, op, err); missing != nil {
		return missing
	}
	return fmt.Errorf("pgidem: %s: %w", op, err)
}

// missingTable returns an actionable error when err says a table does not exist, and nil
// otherwise. Postgres does not name the missing relation in a field of the error, so it
// asks which of pgidem's tables is missing; if neither is (or it cannot tell), it quotes
// the server's message.
func (s *store) missingTable(ctx context.Context, op string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || (pgErr.Code != pgerrcode.UndefinedTable && pgErr.Code != pgerrcode.InvalidSchemaName) {
		return nil
	}
	// A mistyped --schema (IDEM for idem): the schema is missing, not a table.
	if missing := s.missingSchema(ctx, op); missing != nil {
		return missing
	}
	where := "the connection's search_path"
	if s.schema != "" {
		where = fmt.Sprintf("schema %q", s.schema)
	}
	what := pgErr.Message
	var elsewhere []string
	if record, inbox, err := s.tablesExist(ctx); err == nil {
		switch {
		case !record:
			what = "table " + recordTable + " not found"
			if s.schema == "" { // with --schema, the operator chose where to look
				elsewhere, _ = otherInstalls(ctx, s.pool)
			}
		case !inbox:
			what = "table " + inboxTable + " not found"
		}
	}
	msg := fmt.Sprintf("pgidem: %s: %s in %s of %s", op, what, where, s.database())
	if len(elsewhere) > 0 {
		return fmt.Errorf("%s; pgidem is installed in %s of this database: pass --schema to point at it", msg, schemaList(elsewhere))
	}
	return fmt.Errorf("%s; if that is not the database you meant, pass --database-url (or --schema); if it is, run 'pgidem migrate up' (or, where your own migration tool applies pgidem's files, apply the missing ones with it)", msg)
}

// otherInstallsSQL lists the schemas other than the current one that hold pgidem's record
// table, whether or not they are on the search_path.
const otherInstallsSQL = `
SELECT coalesce(array_agg(n.nspname ORDER BY n.nspname), '{}')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'pgidem_record' AND c.relkind IN ('r', 'p')
	AND n.nspname IS DISTINCT FROM current_schema()`

// otherInstalls returns the schemas, other than the connection's current one, where pgidem
// is installed. Its callers ask only without --schema: with it, the operator chose.
func otherInstalls(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	var schemas []string
	err := pool.QueryRow(ctx, otherInstallsSQL).Scan(&schemas)
	return schemas, err
}

// schemaList names schemas for a message: schema "a", or schemas "a" and "b".
func schemaList(schemas []string) string {
	quoted := make([]string, len(schemas))
	for i, s := range schemas {
		quoted[i] = strconv.Quote(s)
	}
	if len(quoted) == 1 {
		return "schema " + quoted[0]
	}
	return "schemas " + strings.Join(quoted[:len(quoted)-1], ", ") + " and " + quoted[len(quoted)-1]
}

// database describes the database the store is connected to, for messages.
func (s *store) database() string { return describeDatabase(&s.pool.Config().ConnConfig.Config) }

// describeDatabase names the database cc connects to, its user and its first address.
func describeDatabase(cc *pgconn.Config) string {
	// An empty database name in the configuration means the server's default, the user
	// name (libpq's rule); name it.
	return fmt.Sprintf("database %q (user %q on %s)", cmp.Or(cc.Database, cc.User), cc.User, hostPort(cc.Host, cc.Port))
}

// missingSchema returns an actionable error when --schema names a schema that does not
// exist (schema names are case-sensitive: IDEM is not idem), naming the schemas where
// pgidem is installed, and nil when it exists, when no --schema was given, or when it
// cannot tell.
func (s *store) missingSchema(ctx context.Context, op string) error {
	if s.schema == "" {
		return nil
	}
	if exists, err := s.schemaExists(ctx); err != nil || exists {
		return nil
	}
	msg := fmt.Sprintf("pgidem: %s: schema %q does not exist in %s, so pgidem is not installed there (schema names are case-sensitive)",
		op, s.schema, s.database())
	// The search_path names only the missing schema, so current_schema() is null and
	// every installation is listed.
	if elsewhere, _ := otherInstalls(ctx, s.pool); len(elsewhere) > 0 {
		return fmt.Errorf("%s; pgidem is installed in %s of this database: pass --schema to point at it", msg, schemaList(elsewhere))
	}
	return fmt.Errorf("%s; if that is not the database you meant, pass --database-url; if it is, check the name, or run 'pgidem migrate up' with it (which creates the schema)", msg)
}

// schemaExists reports whether --schema names an existing schema (compared exactly, as
// Postgres compares quoted identifiers).
func (s *store) schemaExists(ctx context.Context) (bool, error) {
	var exists bool
	err := s.pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)", s.schema).Scan(&exists)
	return exists, err
}

// tablesExist reports whether the record table and the inbox table exist.
func (s *store) tablesExist(ctx context.Context) (record, inbox bool, err error) {
	err = s.pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL", s.table, s.inbox).
		Scan(&record, &inbox)
	return record, inbox, err
}

// qualifiedInbox names the inbox table with its schema, for messages: --schema's, else the
// connection's current schema (the bare name when that cannot be read).
func (s *store) qualifiedInbox(ctx context.Context) string {
	if s.schema != "" {
		return s.inboxDisplay
	}
	var current *string
	if err := s.pool.QueryRow(ctx, "SELECT current_schema()").Scan(&current); err != nil || current == nil {
		return inboxTable
	}
	return *current + "." + inboxTable
}

// inboxMissing reports whether err says a table is missing because the database has the
// record table but no inbox table.
func (s *store) inboxMissing(ctx context.Context, err error) (bool, error) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != pgerrcode.UndefinedTable {
		return false, nil
	}
	record, inbox, err := s.tablesExist(ctx)
	return record && !inbox, err
}

// record is one row of pgidem_record with times derived from the database clock. It is
// also the --json form of a record.
type record struct {
	Namespace   string  `json:"namespace"`
	Key         string  `json:"key"`
	Status      string  `json:"status"`
	Attempts    int     `json:"attempts"`
	TookOver    bool    `json:"took_over"`
	Owner       string  `json:"owner"`
	Fingerprint *string `json:"fingerprint"`
	// Result and Error are the stored JSON documents (null when absent).
	Result         rawJSON    `json:"result"`
	Error          rawJSON    `json:"error"`
	CreatedAt      time.Time  `json:"created_at"`
	UpdatedAt      time.Time  `json:"updated_at"`
	CompletedAt    *time.Time `json:"completed_at"`
	LeaseExpiresAt *time.Time `json:"lease_expires_at"`
	ExpiresAt      time.Time  `json:"expires_at"`
	// AgeSeconds, LeaseRemainingSeconds and TTLRemainingSeconds are measured against the
	// database's now(); the remaining times are negative once passed.
	AgeSeconds            float64  `json:"age_seconds"`
	LeaseRemainingSeconds *float64 `json:"lease_remaining_seconds"`
	TTLRemainingSeconds   float64  `json:"ttl_remaining_seconds"`
	Expired               bool     `json:"expired"`
	LeaseExpired          bool     `json:"lease_expired"`
}

// live reports whether the record is in progress under a live lease: its holder may be
// running the effect right now.
func (r *record) live() bool {
	return r.Status == "in_progress" && !r.LeaseExpired && !r.Expired
}

// rawJSON is stored JSON text, emitted verbatim in --json output.
type rawJSON struct{ text *string }

// MarshalJSON implements json.Marshaler.
func (j rawJSON) MarshalJSON() ([]byte, error) {
	if j.text == nil {
		return []byte("null"), nil
	}
	return []byte(*j.text), nil
}

// String returns the JSON text, or "-" when absent.
func (j rawJSON) String() string {
	if j.text == nil {
		return "-"
	}
	return *j.text
}

// recordColumns selects a [record] from a relation aliased r.
const recordColumns = recordColumnsHead + `, r.result::text, r.error::text, ` + recordColumnsTail

// recordColumnsHead and recordColumnsTail select a [record] but its result and error (which
// [scanRecord] expects between them) from a relation aliased r.
const (
	recordColumnsHead = `r.namespace, r.key, r.status, r.attempts, r.owner::text,
	encode(r.fingerprint, 'hex')`
	recordColumnsTail = `r.created_at, r.updated_at, r.completed_at, r.lease_expires_at, r.expires_at,
	extract(epoch FROM now() - r.created_at)::float8,
	extract(epoch FROM r.lease_expires_at - now())::float8,
	extract(epoch FROM r.expires_at - now())::float8`
)

// scanRecord scans [recordColumns], after any leading destinations.
func scanRecord(row pgx.Row, lead ...any) (*record, error) {
	var r record
	dest := append(lead,
		&r.Namespace, &r.Key, &r.Status, &r.Attempts, &r.Owner,
		&r.Fingerprint, &r.Result.text, &r.Error.text,
		&r.CreatedAt, &r.UpdatedAt, &r.CompletedAt, &r.LeaseExpiresAt, &r.ExpiresAt,
		&r.AgeSeconds, &r.LeaseRemainingSeconds, &r.TTLRemainingSeconds,
	)
	if err := row.Scan(dest...); err != nil {
		return nil, err
	}
	r.TookOver = r.Attempts > 1
	r.Expired = r.TTLRemainingSeconds <= 0
	r.LeaseExpired = r.Status == "in_progress" && r.LeaseRemainingSeconds != nil && *r.LeaseRemainingSeconds <= 0
	return &r, nil
}

// listParams are the filters of records list.
type listParams struct {
	namespace   string
	status      string
	minAttempts int
	expired     bool
	limit       int
	// values asks for each record's result and error, which can be large (megabytes); the
	// table output shows neither, and without values the records come back without them.
	values bool
}

// sweepableCondition is true for a record (alias r) that pgidem's sweep deletes: past its
// TTL and not in progress under a live lease. It is the condition of the sweep statement
// in pgidem/store.go.
const sweepableCondition = `(r.expires_at <= now() AND (r.status <> 'in_progress' OR r.lease_expires_at <= now()))`

// list returns the records matching p, newest first, at most p.limit of them (0: all).
// more reports whether further records match beyond the limit; with p.values it is always
// false (the --json output has no such note, so no extra record is read to tell).
//
// A record's result and error can be megabytes. Without p.values they are not read at
// all. With it they are read by scalar subqueries (by primary key, in the statement's
// snapshot: the same row) that Postgres, as for any expensive output expression under a
// LIMIT, evaluates after the ORDER BY and the LIMIT: only for the records returned, and
// never sorted. r.result::text in the select list would instead be read, converted and
// sorted for every matching record. So with p.values there is always a LIMIT, the largest
// bigint for no limit.
func (s *store) list(ctx context.Context, p listParams) (records []*record, more bool, err error) {
	var (
		where []string
		args  []any
	)
	add := func(cond string, arg any) {
		args = append(args, arg)
		where = append(where, fmt.Sprintf(cond, len(args)))
	}
	if p.namespace != "" {
		add("r.namespace = $%d", p.namespace)
	}
	if p.status != "" {
		add("r.status = $%d", p.status)
	}
	if p.minAttempts > 0 {
		add("r.attempts >= $%d", p.minAttempts)
	}
	if p.expired {
		where = append(where, sweepableCondition)
	}
	values := "NULL::text, NULL::text"
	if p.values {
		values = fmt.Sprintf(`(SELECT v.result::text FROM %[1]s v WHERE v.namespace = r.namespace AND v.key = r.key),
			(SELECT v.error::text FROM %[1]s v WHERE v.namespace = r.namespace AND v.key = r.key)`, s.table)
	}
	query := "SELECT " + recordColumnsHead + ", " + values + ", " + recordColumnsTail + " FROM " + s.table + " r"
	for i, cond := range where {
		if i == 0 {
			query += " WHERE " + cond
		} else {
			query += " AND " + cond
		}
	}
	query += " ORDER BY r.created_at DESC, r.namespace, r.key"
	switch {
	case p.values && p.limit == 0:
		args = append(args, int64(math.MaxInt64))
		query += fmt.Sprintf(" LIMIT $%d", len(args))
	case p.values:
		args = append(args, p.limit)
		query += fmt.Sprintf(" LIMIT $%d", len(args))
	case p.limit > 0:
		// One more than asked for: whether it comes back says if more records match.
		args = append(args, p.limit+1)
		query += fmt.Sprintf(" LIMIT $%d", len(args))
	}
	rows, err := s.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, false, s.translate(ctx, "list records", err)
	}
	defer rows.Close()
	for rows.Next() {
		r, err := scanRecord(rows)
		if err != nil {
			return nil, false, s.translate(ctx, "list records", err)
		}
		records = append(records, r)
	}
	if err := rows.Err(); err != nil {
		return nil, false, s.translate(ctx, "list records", err)
	}
	if p.limit > 0 && len(records) > p.limit {
		return records[:p.limit], true, nil
	}
	return records, false, nil
}

// errNoRecord reports a (namespace, key) with no record.
func errNoRecord(namespace, key string) error {
	return fmt.Errorf("pgidem: no record for namespace %q key %q", namespace, key)
}

func (s *store) show(ctx context.Context, namespace, key string) (*record, error) {
	query := "SELECT " + recordColumns + " FROM " + s.table + " r WHERE r.namespace = $1 AND r.key = $2"
	r, err := scanRecord(s.pool.QueryRow(ctx, query, namespace, key))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, errNoRecord(namespace, key)
	}
	if err != nil {
		return nil, s.translate(ctx, "show record", err)
	}
	return r, nil
}

// forgetSQL deletes one record in a single conditional statement: unless $3 (force) is
// true, a record in progress under a live lease is not deleted. The DELETE re-checks its
// condition on the newest row version (READ COMMITTED), so a holder renewing or taking the
// record over concurrently is never deleted by mistake. When nothing is deleted, the
// record as the statement saw it is returned instead, to explain why.
const forgetSQL = `WITH target AS (
	SELECT * FROM %[1]s WHERE namespace = $1 AND key = $2
), deleted AS (
	DELETE FROM %[1]s d
	WHERE d.namespace = $1 AND d.key = $2
	  AND ($3 OR d.status <> 'in_progress' OR d.lease_expires_at <= now() OR d.expires_at <= now())
	RETURNING d.*
)
SELECT true, ` + recordColumns + ` FROM deleted r
UNION ALL
SELECT false, ` + recordColumns + ` FROM target r WHERE NOT EXISTS (SELECT 1 FROM deleted)`

// forget deletes the record for (namespace, key) and returns it. It refuses a record in
// progress under a live lease unless force is true.
func (s *store) forget(ctx context.Context, namespace, key string, force bool) (*record, error) {
	conn, err := s.acquireToDelete(ctx, "forget record")
	if err != nil {
		return nil, err
	}
	defer conn.Release()
	var deleted bool
	r, err := scanRecord(conn.QueryRow(ctx, fmt.Sprintf(forgetSQL, s.table), namespace, key, force), &deleted)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%w; nothing deleted", errNoRecord(namespace, key))
	}
	if err != nil {
		if ie := interruptedDelete(ctx, "forget record", err, commandLine([]string{"records", "show"}, namespace, key)); ie != nil {
			return nil, ie
		}
		return nil, s.translate(ctx, "forget record", err)
	}
	if deleted {
		return r, nil
	}
	if r.live() {
		return nil, fmt.Errorf("pgidem: refusing to forget namespace %q key %q: it is in progress under a live lease (%s, owner %s), so its holder may be running the effect right now (a live holder keeps renewing its lease; the lease ends only once the holder is gone); try again after that, or pass --force if you know the holder is gone",
			namespace, key, "expires "+remaining(*r.LeaseRemainingSeconds), r.Owner)
	}
	return nil, fmt.Errorf("pgidem: namespace %q key %q changed while it was being forgotten (its holder renewed or took over the lease); nothing deleted; run the command again", namespace, key)
}

// acquireToDelete takes a connection from the pool for a delete (op). It fails before the
// delete is sent, so an interrupt here (a bare context.Canceled from the pool, which
// [interruptedDelete] could not tell from a statement the server did not answer) is
// reported as having deleted nothing.
func (s *store) acquireToDelete(ctx context.Context, op string) (*pgxpool.Conn, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, interruptedf("pgidem: %s: interrupted; nothing was deleted", op)
		}
		return nil, s.translate(ctx, op, err)
	}
	return conn, nil
}

// interruptedDelete returns the error of a delete (op, one statement) that failed after an
// interrupt, saying what is known of it, or nil when ctx has not ended. The CLI's
// connections ask the server to cancel the statement and wait for its answer (see
// interruptGrace): a cancelled statement, like one never sent, deleted nothing; without an
// answer the outcome is unknown, and check says how to find it out. pgconn reports a
// statement the server did not answer in time as a bare context.Canceled, as the pool
// reports an interrupted Acquire: the delete's connection is therefore acquired apart
// ([store.acquireToDelete]), so that err comes from the statement.
func interruptedDelete(ctx context.Context, op string, err error, check string) error {
	if ctx.Err() == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if pgconn.SafeToRetry(err) || (errors.As(err, &pgErr) && pgErr.Code == pgerrcode.QueryCanceled) {
		return interruptedf("pgidem: %s: interrupted; nothing was deleted", op)
	}
	return interruptedf("pgidem: %s: interrupted before the server answered, so the delete may or may not have been applied "+
		"(it is one statement, which commits on its own once it has run); check with: %s", op, check)
}

// namespaceStats is one row of stats.
type namespaceStats struct {
	Namespace  string `json:"namespace"`
	InProgress int64  `json:"in_progress"`
	Completed  int64  `json:"completed"`
	Failed     int64  `json:"failed"`
	// LeaseExpired counts in-progress records whose holder stopped renewing the lease.
	LeaseExpired int64 `json:"lease_expired"`
	// TookOver counts records with attempts > 1: the effect may have run more than once.
	TookOver int64 `json:"took_over"`
	// Expired counts the records the next sweep deletes: past their TTL and not in
	// progress under a live lease.
	Expired          int64             `json:"expired"`
	OldestInProgress *oldestInProgress `json:"oldest_in_progress"`
}

// oldestInProgress is the longest-running in-progress record of a namespace.
type oldestInProgress struct {
	Key                   string    `json:"key"`
	CreatedAt             time.Time `json:"created_at"`
	AgeSeconds            float64   `json:"age_seconds"`
	LeaseExpiresAt        time.Time `json:"lease_expires_at"`
	LeaseRemainingSeconds float64   `json:"lease_remaining_seconds"`
}

// tableStats describes a table as a whole.
type tableStats struct {
	Table string `json:"table"`
	Rows  int64  `json:"rows"`
	// Expired counts the rows the next sweep deletes: past their expiry (and, for records,
	// not in progress under a live lease).
	Expired    int64  `json:"expired"`
	SizeBytes  int64  `json:"size_bytes"`
	SizePretty string `json:"size_pretty"`
}

const statsSQL = `WITH counts AS (
	SELECT namespace,
	       count(*) FILTER (WHERE status = 'in_progress'),
	       count(*) FILTER (WHERE status = 'completed'),
	       count(*) FILTER (WHERE status = 'failed'),
	       count(*) FILTER (WHERE status = 'in_progress' AND lease_expires_at <= now()),
	       count(*) FILTER (WHERE attempts > 1),
	       count(*) FILTER (WHERE %[2]s)
	FROM %[1]s r
	GROUP BY namespace
), oldest AS (
	SELECT DISTINCT ON (namespace) namespace, key, created_at,
	       extract(epoch FROM now() - created_at)::float8 AS age,
	       lease_expires_at,
	       extract(epoch FROM lease_expires_at - now())::float8 AS lease_remaining
	FROM %[1]s
	WHERE status = 'in_progress'
	ORDER BY namespace, created_at, key
)
SELECT c.*, o.key, o.created_at, o.age, o.lease_expires_at, o.lease_remaining
FROM counts c LEFT JOIN oldest o USING (namespace)
ORDER BY c.namespace`

func (s *store) stats(ctx context.Context) ([]namespaceStats, *tableStats, error) {
	rows, err := s.pool.Query(ctx, fmt.Sprintf(statsSQL, s.table, sweepableCondition))
	if err != nil {
		return nil, nil, s.translate(ctx, "stats", err)
	}
	defer rows.Close()
	out := []namespaceStats{}
	total := &tableStats{Table: s.display}
	for rows.Next() {
		var (
			ns             namespaceStats
			key            *string
			createdAt      *time.Time
			age            *float64
			leaseExpiresAt *time.Time
			leaseRemaining *float64
		)
		if err := rows.Scan(&ns.Namespace, &ns.InProgress, &ns.Completed, &ns.Failed, &ns.LeaseExpired,
			&ns.TookOver, &ns.Expired, &key, &createdAt, &age, &leaseExpiresAt, &leaseRemaining); err != nil {
			return nil, nil, s.translate(ctx, "stats", err)
		}
		if key != nil {
			ns.OldestInProgress = &oldestInProgress{
				Key: *key, CreatedAt: *createdAt, AgeSeconds: *age,
				LeaseExpiresAt: *leaseExpiresAt, LeaseRemainingSeconds: *leaseRemaining,
			}
		}
		total.Rows += ns.InProgress + ns.Completed + ns.Failed
		total.Expired += ns.Expired
		out = append(out, ns)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, s.translate(ctx, "stats", err)
	}
	if err := s.size(ctx, total, s.table); err != nil {
		return nil, nil, err
	}
	return out, total, nil
}

// size fills in a table's total size (with indexes and TOAST). The quoted table name is a
// parameter resolved by regclass: nothing is spliced.
func (s *store) size(ctx context.Context, t *tableStats, quoted string) error {
	err := s.pool.QueryRow(ctx,
		"SELECT pg_total_relation_size($1::text::regclass), pg_size_pretty(pg_total_relation_size($1::text::regclass))",
		quoted).Scan(&t.SizeBytes, &t.SizePretty)
	if err != nil {
		return s.translate(ctx, "stats: table size", err)
	}
	return nil
}

// inboxStats describes the inbox table, or returns nil when the database has none (its
// migration was not applied, for example when the files were vendored selectively).
func (s *store) inboxStats(ctx context.Context) (*tableStats, error) {
	var exists bool
	if err := s.pool.QueryRow(ctx, "SELECT to_regclass($1) IS NOT NULL", s.inbox).Scan(&exists); err != nil {
		return nil, s.translate(ctx, "stats: inbox", err)
	}
	if !exists {
		return nil, nil
	}
	t := &tableStats{Table: s.inboxDisplay}
	err := s.pool.QueryRow(ctx,
		"SELECT count(*), count(*) FILTER (WHERE expires_at <= now()) FROM "+s.inbox).Scan(&t.Rows, &t.Expired)
	if err != nil {
		return nil, s.translate(ctx, "stats: inbox", err)
	}
	if err := s.size(ctx, t, s.inbox); err != nil {
		return nil, err
	}
	return t, nil
}
