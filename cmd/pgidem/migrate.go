package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"
	"github.com/spf13/cobra"

	pgstore "github.com/pgidem/pgidem/internal/store"
	"github.com/pgidem/pgidem/migrations"
	pgidemriver "github.com/pgidem/pgidem/river"
)

func (a *app) migrateCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply, roll back or report pgidem's migrations",
		Long: `Runs pgidem's embedded goose migrations under pgidem's own version table
(` + migrations.VersionTable + `) and migration lock, so they never mix with the application's
own goose history and concurrent deploys apply each migration once. With --schema the
tables live in that schema: migrate up creates it if missing (with a note on stderr when
it installs pgidem there while pgidem is installed in another schema of the database:
schema names are case-sensitive, so IDEM is not idem); down, status and version fail for a
schema that does not exist instead of creating it.

Without --schema, every migrate command refuses to run when pgidem is installed in a
schema of the search_path other than the connection's current schema (for example in
public, after a schema named after the user appeared in front of it), instead of
installing pgidem a second time; pass --schema to point at the installation.`,
		Args: cobra.NoArgs,
		RunE: group,
	}
	cmd.AddCommand(a.migrateUpCommand(), a.migrateDownCommand(), a.migrateStatusCommand(), a.migrateVersionCommand())
	return cmd
}

// migrationJSON is one migration in --json output.
type migrationJSON struct {
	Version    int64   `json:"version"`
	Source     string  `json:"source"`
	DurationMS float64 `json:"duration_ms"`
}

// migrateResultJSON is the --json output of migrate up and migrate down.
type migrateResultJSON struct {
	Applied    []migrationJSON `json:"applied"`
	RolledBack []migrationJSON `json:"rolled_back"`
	Version    int64           `json:"version"`
	// River lists the River migrations migrate up --river applied; absent without --river.
	River *[]riverMigrationJSON `json:"river,omitempty"`
}

// riverMigrationJSON is one River migration in --json output.
type riverMigrationJSON struct {
	Version    int     `json:"version"`
	Name       string  `json:"name"`
	DurationMS float64 `json:"duration_ms"`
}

func (a *app) withProviderDB(ctx context.Context, db *sql.DB, fn func(*goose.Provider) error) error {
	provider, err := migrations.NewProvider(ctx, db, &migrations.Opts{Schema: a.schema})
	if err != nil {
		return err
	}
	return fn(provider)
}

func (a *app) migrateUpCommand() *cobra.Command {
	var (
		withRiver   bool
		riverSchema string
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Apply every pending pgidem migration (and River's, with --river)",
		Long: `Applies every pending pgidem migration under pgidem's version table and migration lock.

With --river it then applies River's pending migrations too (pgidemriver.MigrateRiver),
holding the advisory lock pgidemriver.MigrateLockID: River's own migrator takes no lock, so
two deploys migrating River at once would otherwise race. River's tables go to
--river-schema (created if missing), by default the --schema of pgidem's (or the search_path).`,
		Example: "  pgidem migrate up --database-url postgres://app@db:5432/app\n  pgidem migrate up --river",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if err := checkRiverFlags(cmd, withRiver, riverSchema); err != nil {
				return err
			}
			ctx := cmd.Context()
			db, err := a.connectDB(ctx)
			if err != nil {
				return err
			}
			defer db.Close()
			out, err := a.migrateUp(ctx, db)
			if err != nil {
				return err
			}
			if withRiver {
				applied, err := a.migrateRiver(ctx, cmp.Or(riverSchema, a.schema))
				if err != nil {
					return err
				}
				out.River = &applied
			}
			if a.json {
				return printJSON(a.stdout, out)
			}
			return nil
		}),
	}
	cmd.Flags().BoolVar(&withRiver, "river", false, "also apply River's migrations, under an advisory lock")
	cmd.Flags().StringVar(&riverSchema, "river-schema", "", "schema of River's tables, with --river (default: --schema, else the search_path)")
	return cmd
}

// checkRiverFlags checks the River flags of migrate up.
func checkRiverFlags(cmd *cobra.Command, withRiver bool, riverSchema string) error {
	if cmd.Flags().Changed("river-schema") && !withRiver {
		return usagef("--river-schema needs --river")
	}
	if err := checkNotEmptyFlag(cmd, "river-schema", riverSchema, "to use --schema, else the search_path"); err != nil {
		return err
	}
	return checkSchemaFlag("--river-schema", riverSchema)
}

// migrateUp applies pgidem's pending migrations, printing them (but with --json) and the
// version reached, and returns what --json reports of them.
func (a *app) migrateUp(ctx context.Context, db *sql.DB) (*migrateResultJSON, error) {
	// A first install while pgidem's tables are in another schema is often a forgotten
	// --schema (without one) or a mistyped one (IDEM for idem, which Up creates): say so
	// (it still installs; schema-per-tenant set-ups do this on purpose).
	var (
		elsewhere     []string
		schemaExisted = true
		err           error
	)
	if a.schema == "" {
		elsewhere, err = a.otherInstalls(ctx, db)
	} else {
		schemaExisted, elsewhere, err = a.schemaAndOtherInstalls(ctx)
	}
	if err != nil {
		return nil, err
	}
	stopNote := a.noteLockWait(ctx, db)
	// migrations.Up, not the provider's: it creates --schema first, safely when deploys
	// run at once.
	results, err := migrations.Up(ctx, db, &migrations.Opts{Schema: a.schema})
	stopNote()
	if installedAnew(results) && len(elsewhere) > 0 {
		a.noteInstalledElsewhere(elsewhere, schemaExisted)
	}
	out := &migrateResultJSON{Applied: resultsJSON(results), RolledBack: []migrationJSON{}}
	a.printMigrations("applied", results)
	if err != nil {
		return nil, err
	}
	if len(results) > 0 {
		a.changed = "migrate up applied " + count(len(results), "migration", "migrations")
	}
	err = a.withProviderDB(ctx, db, func(p *goose.Provider) error {
		version, _, err := p.GetVersions(ctx) // no lock: a deploy may be migrating
		if err != nil {
			return fmt.Errorf("pgidem: migrate up: read version: %w", err)
		}
		out.Version = version
		if a.json {
			return nil
		}
		sources := p.ListSources()
		latest := sources[len(sources)-1].Version
		switch {
		case len(results) == 0 && version > latest:
			fmt.Fprintf(a.stdout, "nothing to apply; pgidem schema is at version %d, %s\n", version, newerNote(latest))
		case len(results) == 0:
			fmt.Fprintf(a.stdout, "pgidem schema is up to date at version %d\n", out.Version)
		default:
			fmt.Fprintf(a.stdout, "pgidem schema is now at version %d\n", out.Version)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// noteInstalledElsewhere notes on stderr that migrate up installed pgidem anew although
// it is installed in the elsewhere schemas of the database.
func (a *app) noteInstalledElsewhere(elsewhere []string, schemaExisted bool) {
	if a.schema == "" {
		fmt.Fprintf(a.stderr, "pgidem: note: installed pgidem anew here, although it is installed in %s of this database; "+
			"if you meant that installation, roll this one back (pgidem migrate down --to 0) and pass --schema\n", schemaList(elsewhere))
		return
	}
	created := ""
	if !schemaExisted {
		created = ", which this run created"
	}
	fmt.Fprintf(a.stderr, "pgidem: note: installed pgidem anew in schema %q%s, although it is installed in %s of this database "+
		"(schema names are case-sensitive); if you meant that installation, roll this one back (%s) "+
		"and pass that --schema instead\n", a.schema, created, schemaList(elsewhere),
		commandLine([]string{"--schema", a.schema, "migrate", "down", "--to", "0"}))
}

// migrateRiver applies River's pending migrations under pgidemriver's advisory lock.
func (a *app) migrateRiver(ctx context.Context, schema string) ([]riverMigrationJSON, error) {
	pool, err := a.connectPool(ctx)
	if err != nil {
		return nil, err
	}
	defer closePool(ctx, pool)
	res, err := pgidemriver.MigrateRiver(ctx, pool, &pgidemriver.MigrateOpts{Schema: schema})
	applied := []riverMigrationJSON{}
	if res != nil {
		for _, v := range res.Versions {
			applied = append(applied, riverMigrationJSON{
				Version: v.Version, Name: v.Name, DurationMS: float64(v.Duration.Microseconds()) / 1000,
			})
			if !a.json {
				fmt.Fprintf(a.stdout, "applied River migration %03d %s (%s)\n", v.Version, v.Name, v.Duration.Round(time.Millisecond))
			}
		}
	}
	if err != nil {
		return applied, fmt.Errorf("pgidem: migrate up --river: %w", err)
	}
	if !a.json && len(applied) == 0 {
		fmt.Fprintln(a.stdout, "River schema is up to date")
	} else if !a.json {
		fmt.Fprintln(a.stdout, "River schema is now up to date")
	}
	return applied, nil
}

func (a *app) migrateDownCommand() *cobra.Command {
	var (
		to    int64
		force bool
	)
	cmd := &cobra.Command{
		Use:   "down",
		Short: "Roll back the most recent pgidem migration (or down to --to VERSION)",
		Long: `Rolls back the most recently applied pgidem migration, like goose's down. With --to
VERSION it rolls back every migration above VERSION; --to 0 removes every pgidem object
(records included) but the version table, which keeps goose's initial version-0 row.

A rollback that would drop a table holding rows (pgidem_record: every completed key would
run its effect again; pgidem_inbox: every recorded message would be handled again) is
refused, naming the tables and their row counts, unless --force is given.`,
		Example: "  pgidem migrate down\n  pgidem migrate down --to 0 --force",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			toSet := cmd.Flags().Changed("to")
			if toSet && to < 0 {
				return usagef("--to must be a version >= 0, got %d", to)
			}
			db, err := a.connectDB(ctx)
			if err != nil {
				return err
			}
			defer db.Close()
			if err := a.requireSchema(ctx, "migrate down"); err != nil {
				return err
			}
			opts := &migrations.Opts{Schema: a.schema, RefuseDataLoss: !force}
			installed, err := migrations.Installed(ctx, db, opts)
			if err != nil {
				return err
			}
			if !installed {
				if a.json {
					return printJSON(a.stdout, migrateResultJSON{Applied: []migrationJSON{}, RolledBack: []migrationJSON{}})
				}
				fmt.Fprintln(a.stdout, "nothing to roll back; pgidem is not installed here")
				return nil
			}
			return a.migrateDown(ctx, db, opts, toSet, to)
		}),
	}
	cmd.Flags().Int64Var(&to, "to", 0, "roll back every migration above this version (0: all)")
	cmd.Flags().BoolVar(&force, "force", false, "roll back even when that drops tables holding records or inbox rows")
	return cmd
}

// migrateDown rolls back the most recent migration, or those above to when toSet, and
// reports what it rolled back and the version reached.
func (a *app) migrateDown(ctx context.Context, db *sql.DB, opts *migrations.Opts, toSet bool, to int64) error {
	stopNote := a.noteLockWait(ctx, db)
	var (
		results []*goose.MigrationResult
		err     error
	)
	if toSet {
		results, err = migrations.DownTo(ctx, db, opts, to)
	} else {
		results, err = migrations.Down(ctx, db, opts)
	}
	stopNote()
	if errors.Is(err, migrations.ErrDataLoss) {
		return fmt.Errorf("%w; pass --force to roll back anyway", err)
	}
	out := migrateResultJSON{Applied: []migrationJSON{}, RolledBack: resultsJSON(results)}
	verr := a.withProviderDB(ctx, db, func(p *goose.Provider) error {
		var err error
		out.Version, _, err = p.GetVersions(ctx) // no lock: a deploy may be migrating
		return err
	})
	if err != nil {
		// What was rolled back before the failure, then the error.
		if a.json && verr == nil && len(results) > 0 {
			_ = printJSON(a.stdout, out)
		}
		a.printMigrations("rolled back", results)
		return err
	}
	if len(results) > 0 {
		a.changed = "migrate down rolled back " + count(len(results), "migration", "migrations")
	}
	if verr != nil {
		return fmt.Errorf("pgidem: migrate down: read version: %w", verr)
	}
	if a.json {
		return printJSON(a.stdout, out)
	}
	a.printMigrations("rolled back", results)
	if len(results) == 0 {
		fmt.Fprintf(a.stdout, "nothing to roll back; pgidem schema is at version %d\n", out.Version)
	} else {
		fmt.Fprintf(a.stdout, "pgidem schema is now at version %d\n", out.Version)
	}
	return nil
}

// statusJSON is one row of migrate status --json.
type statusJSON struct {
	Version   int64      `json:"version"`
	Source    string     `json:"source"`
	State     string     `json:"state"`
	AppliedAt *time.Time `json:"applied_at"`
}

func (a *app) migrateStatusCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "List pgidem's migrations and whether each is applied",
		Long: `Lists pgidem's migrations, whether each is applied, and when (APPLIED AT, in UTC),
under a line naming the database, user, server and schema it read.

goose records the time as a timestamp without time zone, written in the time zone of
the session that applied the migration. The pgidem command and migrations.OpenDB use UTC
sessions, so their times are exact; a migration applied by another tool through a session
in another time zone shows shifted by that zone's offset.`,
		Args: cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			db, err := a.connectDB(ctx)
			if err != nil {
				return err
			}
			defer db.Close()
			if err := a.requireSchema(ctx, "migrate status"); err != nil {
				return err
			}
			// migrations.Status creates nothing where pgidem is not installed.
			status, err := migrations.Status(ctx, db, &migrations.Opts{Schema: a.schema})
			if err != nil {
				return err
			}
			rows := make([]statusJSON, 0, len(status))
			for _, s := range status {
				row := statusJSON{Version: s.Source.Version, Source: s.Source.Path, State: string(s.State)}
				if !s.AppliedAt.IsZero() {
					at := s.AppliedAt.UTC()
					row.AppliedAt = &at
				}
				rows = append(rows, row)
			}
			if a.json {
				return printJSON(a.stdout, rows)
			}
			// Say where: the same command run against the wrong database or schema would
			// print a table just as plausible.
			cfg, _, err := a.poolConfig()
			if err != nil {
				return err
			}
			schemaName := a.schema
			if schemaName == "" {
				// Without --schema, the first schema of the search_path that exists.
				if schemaName, _, err = pgstore.CurrentSchema(ctx, queryRow(db)); err != nil {
					return err
				}
			}
			fmt.Fprintf(a.stdout, "pgidem migrations in %s, schema %q\n", describeDatabase(&cfg.ConnConfig.Config), schemaName)
			t := newTable(a.stdout, "VERSION", "MIGRATION", "STATE", "APPLIED AT")
			for _, r := range rows {
				applied := "-"
				if r.AppliedAt != nil {
					applied = timestamp(*r.AppliedAt)
				}
				t.row(fmt.Sprint(r.Version), r.Source, r.State, applied)
			}
			if err := t.flush(); err != nil {
				return err
			}
			current, latest, err := a.versions(ctx, db)
			if err != nil {
				return err
			}
			if current > latest {
				fmt.Fprintf(a.stdout, "the database is at version %d, %s\n", current, newerNote(latest))
			}
			return nil
		}),
	}
}

func (a *app) migrateVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version of the most recently applied pgidem migration (0: none)",
		Args:  cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			db, err := a.connectDB(ctx)
			if err != nil {
				return err
			}
			defer db.Close()
			if err := a.requireSchema(ctx, "migrate version"); err != nil {
				return err
			}
			current, latest, err := a.versions(ctx, db)
			if err != nil {
				return err
			}
			if a.json {
				return printJSON(a.stdout, map[string]int64{"version": current, "latest": latest})
			}
			elsewhere, err := a.otherInstalls(ctx, db)
			if err != nil {
				return err
			}
			switch {
			case len(elsewhere) > 0:
				fmt.Fprintf(a.stdout, "0 (pgidem is not installed here but in %s of this database: pass --schema)\n", schemaList(elsewhere))
			case current < latest:
				fmt.Fprintf(a.stdout, "%d (latest is %d; run pgidem migrate up)\n", current, latest)
			case current > latest:
				fmt.Fprintf(a.stdout, "%d (%s)\n", current, newerNote(latest))
			default:
				fmt.Fprintf(a.stdout, "%d\n", current)
			}
			return nil
		}),
	}
}

// versions returns the version of pgidem's schema where the connection points (0 where
// pgidem is not installed: nothing is created) and the latest migration this build has.
func (a *app) versions(ctx context.Context, db *sql.DB) (current, latest int64, err error) {
	opts := &migrations.Opts{Schema: a.schema}
	installed, err := migrations.Installed(ctx, db, opts)
	if err != nil {
		return 0, 0, err
	}
	err = a.withProviderDB(ctx, db, func(p *goose.Provider) error {
		if sources := p.ListSources(); len(sources) > 0 {
			latest = sources[len(sources)-1].Version
		}
		if installed {
			current, latest, err = p.GetVersions(ctx)
		}
		return err
	})
	if err != nil {
		return 0, 0, fmt.Errorf("pgidem: read the migration version: %w", err)
	}
	return current, latest, nil
}

// otherInstalls returns the other schemas of the database where pgidem is installed, when
// no --schema was given and pgidem is not installed where the connection points. Else it
// returns none: with --schema the operator chose the schema, and a fresh one is not a
// mistake.
func (a *app) otherInstalls(ctx context.Context, db *sql.DB) ([]string, error) {
	if a.schema != "" {
		return nil, nil
	}
	if installed, err := migrations.Installed(ctx, db, nil); err != nil || installed {
		return nil, err
	}
	pool, err := a.connectPool(ctx)
	if err != nil {
		return nil, err
	}
	defer closePool(ctx, pool)
	schemas, err := otherInstalls(ctx, pool)
	if err != nil {
		return nil, fmt.Errorf("pgidem: look for pgidem in other schemas: %w", err)
	}
	return schemas, nil
}

// newerNote explains a schema version above latest, the newest migration this build has.
func newerNote(latest int64) string {
	return fmt.Sprintf("newer than this pgidem's latest migration, %d: a newer release migrated the database", latest)
}

// lockNoteDelay is how long a migration run waits for pgidem's migration lock before it
// says whom it waits for. It is longer than goose's retry period (one second), so a lock
// freed at once (another run with nothing to do, say) goes unmentioned.
const lockNoteDelay = 2 * time.Second

// noteLockWait watches a migration about to run for a wait on pgidem's migration lock,
// which it would otherwise wait for (up to about five minutes) without a word. When
// another run holds the lock now and still holds it lockNoteDelay later, the migration
// is waiting for it, and a note on stderr names the holder. Call the returned
// function once the migration has returned: it stops the watch.
func (a *app) noteLockWait(ctx context.Context, db *sql.DB) (stop func()) {
	holder, held := lockHolder(ctx, db)
	if !held {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		timer := time.NewTimer(lockNoteDelay)
		defer timer.Stop()
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		// The same holder as before the migration started, so not this run.
		if now, held := lockHolder(ctx, db); held && now == holder {
			fmt.Fprintf(a.stderr, "pgidem: waiting for pgidem's migration lock, held by %s (another migration run); "+
				"giving up after about %d s\n", holder, migrations.LockRetryAttempts*migrations.LockRetryPeriodSeconds)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// lockHolder names the run holding pgidem's migration lock (migrations.LockHolder); held
// is false when none does (or the check failed: the migration reports what matters).
func lockHolder(ctx context.Context, db *sql.DB) (holder string, held bool) {
	holder, _, held, err := migrations.LockHolder(ctx, db)
	return holder, held && err == nil
}

// queryRow adapts db to the catalog reads of internal/store.
func queryRow(db *sql.DB) pgstore.QueryRowFunc {
	return func(ctx context.Context, query string, args ...any) pgx.Row {
		return db.QueryRowContext(ctx, query, args...)
	}
}

// installedAnew reports whether results include pgidem's first migration, which creates
// the record table: pgidem was installed (again) where the migrations ran.
func installedAnew(results []*goose.MigrationResult) bool {
	for _, r := range results {
		if r.Source != nil && r.Source.Version == 1 {
			return true
		}
	}
	return false
}

// requireSchema returns, for a migrate command other than up (op), an error when --schema
// names a schema that does not exist. The error says where pgidem is installed, as the
// other commands do; the migrations package, which would refuse it too, cannot look.
func (a *app) requireSchema(ctx context.Context, op string) error {
	if a.schema == "" {
		return nil
	}
	pool, err := a.connectPool(ctx)
	if err != nil {
		return err
	}
	defer closePool(ctx, pool)
	return newStore(pool, a.schema).missingSchema(ctx, op)
}

// schemaAndOtherInstalls reports, for --schema, whether the schema exists and the other
// schemas of the database where pgidem is installed.
func (a *app) schemaAndOtherInstalls(ctx context.Context) (exists bool, elsewhere []string, err error) {
	pool, err := a.connectPool(ctx)
	if err != nil {
		return false, nil, err
	}
	defer closePool(ctx, pool)
	s := newStore(pool, a.schema)
	if exists, err = s.schemaExists(ctx); err != nil {
		return false, nil, fmt.Errorf("pgidem: look for schema %q: %w", a.schema, err)
	}
	// The search_path is --schema alone: current_schema() is it, or null when it does not
	// exist, so every other installation is listed.
	if elsewhere, err = otherInstalls(ctx, pool); err != nil {
		return false, nil, fmt.Errorf("pgidem: look for pgidem in other schemas: %w", err)
	}
	return exists, elsewhere, nil
}

// printMigrations lists migration results in human form (nothing with --json).
func (a *app) printMigrations(verb string, results []*goose.MigrationResult) {
	if a.json {
		return
	}
	for _, r := range results {
		fmt.Fprintf(a.stdout, "%s %s (%s)\n", verb, r.Source.Path, r.Duration.Round(time.Millisecond))
	}
}

func resultsJSON(results []*goose.MigrationResult) []migrationJSON {
	out := make([]migrationJSON, 0, len(results))
	for _, r := range results {
		out = append(out, migrationJSON{
			Version:    r.Source.Version,
			Source:     r.Source.Path,
			DurationMS: float64(r.Duration.Microseconds()) / 1000,
		})
	}
	return out
}
