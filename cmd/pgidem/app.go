package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/pgidem/pgidem/migrations"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// env is what the process gives the CLI: its output streams and its environment.
type env struct {
	stdout io.Writer
	stderr io.Writer
	getenv func(string) string
}

// app holds one invocation's flags and state. A new app is built for every run, so nothing
// is shared between invocations.
type app struct {
	env

	databaseURL string
	schema      string
	json        bool

	// started is set when a command's action begins. Errors returned before that come from
	// cobra's parsing (unknown command or flag, bad value, wrong arguments): usage errors.
	started bool
}

// usageError is an error in how the command was invoked; it exits with [exitUsage].
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

// usagef returns a [*usageError].
func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// run executes the CLI with args and returns the process exit code.
func run(ctx context.Context, args []string, e *env) int {
	a := &app{env: *e}
	root := a.rootCommand()
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return exitOK
	}
	var ue *usageError
	if !a.started || errors.As(err, &ue) {
		msg := strings.TrimPrefix(err.Error(), "pgidem: ")
		path := "pgidem"
		if cmd != nil {
			path = cmd.CommandPath()
		}
		fmt.Fprintf(a.stderr, "pgidem: %s (see '%s --help')\n", oneLine(msg), path)
		return exitUsage
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "pgidem: ") {
		msg = "pgidem: " + msg
	}
	fmt.Fprintln(a.stderr, oneLine(msg))
	return exitFailure
}

// oneLine folds a multi-line message onto one line.
func oneLine(s string) string {
	fields := strings.FieldsFunc(strings.TrimSpace(s), func(r rune) bool { return r == '\n' || r == '\r' })
	for i := range fields {
		fields[i] = strings.TrimSpace(fields[i])
	}
	return strings.Join(fields, "; ")
}

// action wraps a command's body so that its errors count as failures, not usage errors. It
// first checks the root's flags: an invalid one is a usage error.
func (a *app) action(fn func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		if err := checkSchemaFlag("--schema", a.schema); err != nil {
			return err
		}
		a.started = true
		return fn(cmd, args)
	}
}

// checkSchemaFlag returns a usage error when schema, the value of the flag called name,
// cannot be pgidem's schema (migrations.CheckSchemaName: the rules of
// pgidem.Config.Schema). "" (the search_path) is valid.
func checkSchemaFlag(name, schema string) error {
	if err := migrations.CheckSchemaName(schema); err != nil {
		return usagef("%s %v", name, err)
	}
	return nil
}

// checkText returns a usage error when value, the argument or flag called name, cannot be
// sent to Postgres as text: a NUL byte or invalid UTF-8 (the server rejects both).
func checkText(name, value string) error {
	switch {
	case strings.ContainsRune(value, 0):
		return usagef("%s %q contains a NUL byte", name, value)
	case !utf8.ValidString(value):
		return usagef("%s %q is not valid UTF-8", name, value)
	}
	return nil
}

// group returns the RunE of a command that only holds subcommands: run without one, it is
// a usage error naming them.
func group(cmd *cobra.Command, args []string) error {
	names := make([]string, 0, len(cmd.Commands()))
	for _, sub := range cmd.Commands() {
		if sub.IsAvailableCommand() {
			names = append(names, sub.Name())
		}
	}
	return usagef("missing command: one of %s", strings.Join(names, ", "))
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "pgidem",
		Short: "Inspect and maintain pgidem's idempotency records in Postgres",
		Long: `pgidem runs pgidem's migrations, inspects and forgets idempotency records and inbox
rows, sweeps expired rows and prints per-namespace statistics.

The database comes from --database-url, else DATABASE_URL, else libpq's PG* variables.
Exit codes: 0 success, 1 failure, 2 usage error.`,
		Args:          cobra.NoArgs,
		RunE:          group,
		SilenceErrors: true,
		SilenceUsage:  true,
	}
	root.CompletionOptions.DisableDefaultCmd = true
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{msg: err.Error()} })

	flags := root.PersistentFlags()
	flags.StringVar(&a.databaseURL, "database-url", "",
		"Postgres connection URL or keyword/value string (default: $DATABASE_URL, else libpq PG* variables)")
	flags.StringVar(&a.schema, "schema", "",
		"schema holding pgidem's tables (default: the connection's search_path)")
	flags.BoolVar(&a.json, "json", false, "print JSON instead of tables")

	root.AddCommand(a.migrateCommand(), a.recordsCommand(), a.inboxCommand(), a.sweepCommand(), a.statsCommand())
	return root
}
