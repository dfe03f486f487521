package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/spf13/cobra"

	"github.com/pgidem/pgidem/migrations"
	pgidemriver "github.com/pgidem/pgidem/river"
)

func (a *app) migrateCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply, roll back or report pgidem's migrations",
		Long: `Runs pgidem's embedded goose migrations under pgidem's own version table
(` + migrations.VersionTable + `) and advisory lock, so they never mix with the application's
own goose history and concurrent deploys apply each migration once. With --schema the
tables live in that schema: migrate up creates it if missing; down, status and version
fail for a schema that does not exist instead of creating it.

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

// withProvider connects and runs fn with a goose provider for pgidem's migrations, and
// whether pgidem is installed where it points (migrations.Installed): where it is not, the
// read-only commands answer without the provider, which would create the version table.
func (a *app) withProvider(ctx context.Context, fn func(p *goose.Provider, installed bool) error) error {
	db, err := a.connectDB(ctx)
	if err != nil {
		return err
	}
	defer db.Close()
	installed, err := migrations.Installed(ctx, db, &migrations.Opts{Schema: a.schema})
	if err != nil {
		return err
	}
	return a.withProviderDB(ctx, db, func(p *goose.Provider) error { return fn(p, installed) })
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
		Long: `Applies every pending pgidem migration under pgidem's version table and advisory lock.

With --river it then applies River's pending migrations too (pgidemriver.MigrateRiver),
holding the advisory lock pgidemriver.MigrateLockID: River's own migrator takes no lock, so
two deploys migrating River at once would otherwise race. River's tables go to
--river-schema, by default the --schema of pgidem's (or the search_path).`,
		Example: "  pgidem migrate up --database-url postgres://app@db:5432/app\n  pgidem migrate up --river",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("river-schema") && !withRiver {
				return usagef("--river-schema needs --river")
			}
			if err := checkSchemaFlag("--river-schema", riverSchema); err != nil {
				return err
			}
			ctx := cmd.Context()
			out := migrateResultJSON{RolledBack: []migrationJSON{}}
			db, err := a.connectDB(ctx)
			if err != nil {
				return err
			}
			defer db.Close()
			// migrations.Up, not the provider's: it creates --schema first, safely when
			// deploys run at once.
			results, err := migrations.Up(ctx, db, &migrations.Opts{Schema: a.schema})
			out.Applied = resultsJSON(results)
			a.printMigrations("applied", results)
			if err != nil {
				return err
			}
			err = a.withProviderDB(ctx, db, func(p *goose.Provider) error {
				version, err := p.GetDBVersion(ctx)
				if err != nil {
					return fmt.Errorf("pgidem: migrate up: read version: %w", err)
				}
				out.Version = version
				if a.json {
					return nil
				}
				if len(results) == 0 {
					fmt.Fprintf(a.stdout, "pgidem schema is up to date at version %d\n", out.Version)
				} else {
					fmt.Fprintf(a.stdout, "pgidem schema is now at version %d\n", out.Version)
				}
				return nil
			})
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

// migrateRiver applies River's pending migrations under pgidemriver's advisory lock.
func (a *app) migrateRiver(ctx context.Context, schema string) ([]riverMigrationJSON, error) {
	pool, err := a.connectPool(ctx)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
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
	var to int64
	cmd := &cobra.Command{
		Use:   "down",
		Short: "Roll back the most recent pgidem migration (or down to --to VERSION)",
		Long: `Rolls back the most recently applied pgidem migration, like goose's down. With --to
VERSION it rolls back every migration above VERSION; --to 0 removes every pgidem object
(records included) but the version table, which keeps goose's initial version-0 row.`,
		Example: "  pgidem migrate down\n  pgidem migrate down --to 0",
		Args:    cobra.NoArgs,
		RunE: a.action(func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if cmd.Flags().Changed("to") && to < 0 {
				return usagef("--to must be a version >= 0, got %d", to)
			}
			return a.withProvider(ctx, func(p *goose.Provider, installed bool) error {
				if !installed {
					if a.json {
						return printJSON(a.stdout, migrateResultJSON{Applied: []migrationJSON{}, RolledBack: []migrationJSON{}})
					}
					fmt.Fprintln(a.stdout, "nothing to roll back; pgidem is not installed here")
					return nil
				}
				var results []*goose.MigrationResult
				var err error
				if cmd.Flags().Changed("to") {
					results, err = p.DownTo(ctx, to)
				} else {
					var res *goose.MigrationResult
					res, err = p.Down(ctx)
					if res != nil {
						results = append(results, res)
					}
					if errors.Is(err, goose.ErrNoNextVersion) {
						err = nil
					}
				}
				if err != nil {
					a.printMigrations("rolled back", results)
					return fmt.Errorf("pgidem: migrate down: %w", err)
				}
				out := migrateResultJSON{Applied: []migrationJSON{}, RolledBack: resultsJSON(results)}
				if out.Version, err = p.GetDBVersion(ctx); err != nil {
					return fmt.Errorf("pgidem: migrate down: read version: %w", err)
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
			})
		}),
	}
	cmd.Flags().Int64Var(&to, "to", 0, "roll back every migration above this version (0: all)")
	return cmd
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
		Long: `Lists pgidem's migrations, whether each is applied, and when (APPLIED AT, in UTC).

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
			t := newTable(a.stdout, "VERSION", "MIGRATION", "STATE", "APPLIED AT")
			for _, r := range rows {
				applied := "-"
				if r.AppliedAt != nil {
					applied = timestamp(*r.AppliedAt)
				}
				t.row(fmt.Sprint(r.Version), r.Source, r.State, applied)
			}
			return t.flush()
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
			return a.withProvider(ctx, func(p *goose.Provider, installed bool) error {
				var current, target int64
				if sources := p.ListSources(); len(sources) > 0 {
					target = sources[len(sources)-1].Version
				}
				if installed {
					var err error
					if current, target, err = p.GetVersions(ctx); err != nil {
						return fmt.Errorf("pgidem: migrate version: %w", err)
					}
				}
				if a.json {
					return printJSON(a.stdout, map[string]int64{"version": current, "latest": target})
				}
				if current < target {
					fmt.Fprintf(a.stdout, "%d (latest is %d; run pgidem migrate up)\n", current, target)
				} else {
					fmt.Fprintf(a.stdout, "%d\n", current)
				}
				return nil
			})
		}),
	}
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
