package store

// Catalog statements: where pgidem is installed, what exists, and who holds the
// migration lock. None names a pgidem table in its text; the ones that look a table up
// take its quoted name as a parameter, resolved by to_regclass or regclass.
const (
	// otherInstallsSQL lists the schemas other than the current one that hold pgidem's
	// record table, whether or not they are on the search_path.
	otherInstallsSQL = `
SELECT coalesce(array_agg(n.nspname ORDER BY n.nspname), '{}')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = 'pgidem_record' AND c.relkind IN ('r', 'p')
	AND n.nspname IS DISTINCT FROM current_schema()`

	// schemaExistsSQL reports whether $1 names a schema, compared exactly.
	schemaExistsSQL = `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)`

	// tablesExistSQL reports whether the tables $1 and $2 (quoted names) exist.
	tablesExistSQL = `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL`

	// currentSchemaSQL reads the first existing schema of the search_path (NULL: none).
	currentSchemaSQL = `SELECT current_schema()`

	// tableSizeSQL reads the total size of table $1 (a quoted name), with its indexes and
	// TOAST, in bytes and for people.
	tableSizeSQL = `SELECT pg_total_relation_size($1::text::regclass), pg_size_pretty(pg_total_relation_size($1::text::regclass))`

	// migrationLockHolderSQL finds a session of this database holding the session-level
	// advisory lock $1 (a bigint key: classid the high 32 bits, objid the low).
	migrationLockHolderSQL = `
SELECT pid FROM pg_catalog.pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
	AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())
	AND (classid::bigint << 32) | objid::bigint = $1
LIMIT 1`
)
