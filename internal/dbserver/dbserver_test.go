package dbserver

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestDropStale: DropStale drops the databases CreateDatabase made long enough ago that
// nobody uses, and keeps recent ones, ones still in use, and databases it did not create.
func TestDropStale(t *testing.T) {
	ctx := context.Background()
	server, err := Find(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = server.Close(ctx) })
	admin, err := pgx.Connect(ctx, server.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(ctx) })

	create := func(age time.Duration) *Database {
		t.Helper()
		db, err := server.CreateDatabase(ctx, "pgidem_test_stale_", "")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Drop(ctx) })
		if age > 0 {
			_, err := admin.Exec(ctx, fmt.Sprintf("COMMENT ON DATABASE %s IS '%s%s'", pgx.Identifier{db.Name}.Sanitize(),
				scratchComment, time.Now().Add(-age).UTC().Format(time.RFC3339)))
			if err != nil {
				t.Fatal(err)
			}
		}
		return db
	}
	stale := create(3 * time.Hour)
	recent := create(0)
	inUse := create(3 * time.Hour)
	conn, err := pgx.Connect(ctx, inUse.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	// Named alike, but without the comment: not one of ours.
	foreign := create(0).Name
	if _, err := admin.Exec(ctx, "COMMENT ON DATABASE "+pgx.Identifier{foreign}.Sanitize()+" IS NULL"); err != nil {
		t.Fatal(err)
	}

	dropped, err := server.DropStale(ctx, 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	exists := func(name string) bool {
		var ok bool
		if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// Other runs' stale databases may be dropped too; ours must be among them.
	found := false
	for _, name := range dropped {
		found = found || name == stale.Name
		if name == recent.Name || name == inUse.Name || name == foreign {
			t.Errorf("DropStale dropped %s", name)
		}
	}
	if !found || exists(stale.Name) {
		t.Errorf("the stale database %s is still there (dropped: %v)", stale.Name, dropped)
	}
	for _, name := range []string{recent.Name, inUse.Name, foreign} {
		if !exists(name) {
			t.Errorf("%s was dropped", name)
		}
	}
}
