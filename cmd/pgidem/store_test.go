package main_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/pgidem/pgidem/internal/testdb"
)

// --schema naming a schema that does not exist (a typo, or the wrong case: names are
// case-sensitive) is reported as such, with where pgidem is installed, not as a missing
// table with the advice to run migrate up.
func TestMissingSchema(t *testing.T) {
	t.Parallel()
	db := testdb.New(t) // pgidem in public

	for _, args := range [][]string{
		{"stats"}, {"records", "list"}, {"records", "show", "a", "b"}, {"records", "forget", "a", "b"},
		{"inbox", "list"}, {"inbox", "show", "a", "b"}, {"inbox", "forget", "a", "b"}, {"sweep"},
		{"migrate", "status"}, {"migrate", "version"}, {"migrate", "down", "--to", "0", "--force"},
	} {
		line := requireFail(t, cli(t, db.URL, append([]string{"--schema", "PUBLIC"}, args...)...), 1)
		require.Contains(t, line, `: schema "PUBLIC" does not exist in database "`+db.Name+`"`, args)
		require.Contains(t, line, "(schema names are case-sensitive)", args)
		require.Contains(t, line, `pgidem is installed in schema "public" of this database: pass --schema`, args)
		require.NotContains(t, line, "pgidem_record not found", args)
	}

	empty := testdb.NewUnmigrated(t)
	line := requireFail(t, cli(t, empty.URL, "--schema", "idem", "stats"), 1)
	require.Contains(t, line, `pgidem: stats: schema "idem" does not exist in database "`+empty.Name+`"`)
	require.Contains(t, line, "run 'pgidem migrate up' with it (which creates the schema)")
}
