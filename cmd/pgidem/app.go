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

	// changed says what a command that changes data did, once it has done it ("records
	// forget deleted the record"), for the message when its output is lost.
	changed string

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

// interruptedError reports a command cut short because its context ended: main cancels
// it on SIGINT (Ctrl-C) or SIGTERM. Its message says "interrupted", names the operation and,
// where the command changes data, what is known of the change.
type interruptedError struct{ msg string }

func (e *interruptedError) Error() string { return e.msg }

// interruptedf returns an [*interruptedError] with the message fmt.Sprintf(format, args...).
func interruptedf(format string, args ...any) *interruptedError {
	return &interruptedError{msg: fmt.Sprintf(format, args...)}
}

// outWriter is standard output as the commands see it. It remembers the first failed write
// and refuses every later one, so a command cannot lose its output without a word. run
// reports the failure ("write output: …", exit 1) once the command is done, whichever
// command wrote (cobra's help included). It also says whether the command itself
// succeeded. A
// closed pipe never gets here: the Go runtime ends the process with SIGPIPE on a write to
// a broken pipe on standard output, as other Unix commands end.
type outWriter struct {
	w   io.Writer
	err error
}

// Write implements io.Writer.
func (o *outWriter) Write(p []byte) (int, error) {
	if o.err != nil {
		return 0, o.err
	}
	n, err := o.w.Write(p)
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	if err != nil {
		o.err = err
	}
	return n, err
}

// writeError reports a failed write on standard output.
func writeError(err error) error {
	return fmt.Errorf("pgidem: write output: %w", err)
}

// run executes the CLI with args and returns the process exit code.
func run(ctx context.Context, args []string, e *env) int {
	out := &outWriter{w: e.stdout}
	a := &app{env: *e}
	a.stdout = out
	root := a.rootCommand()
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	switch {
	case err == nil && out.err == nil:
		return exitOK
	case out.err != nil && (err == nil || errors.Is(err, out.err)):
		// The command (or cobra's help) succeeded, but its output was lost (a command
		// writes its result last, and returns the write error it gets, if any). Say that
		// it succeeded, lest a forget, a sweep or a migration be taken for not done.
		msg := writeError(out.err).Error() + "; the command itself succeeded"
		if a.changed != "" {
			msg += " (" + a.changed + ")"
		}
		fmt.Fprintln(a.stderr, oneLine(msg))
		return exitFailure
	case out.err != nil:
		// The command failed, and writing its output failed too: say both.
		err = fmt.Errorf("%w (and write output: %w)", err, out.err)
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
	msg := strings.TrimPrefix(err.Error(), "pgidem: ")
	var ie *interruptedError
	if ctx.Err() != nil && !errors.As(err, &ie) && cmd != nil {
		// An interrupt the command did not describe itself (a migration, say): name it.
		msg = strings.TrimPrefix(cmd.CommandPath(), "pgidem ") + " interrupted: " + msg
	}
	fmt.Fprintln(a.stderr, oneLine("pgidem: "+msg))
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
		// An explicitly empty value (a misspelled or unset shell variable) must not fall back
		// to the default. For --database-url that is another database (DATABASE_URL, PG*);
		// for --schema it is the search_path's schema. Forget, sweep and migrate down would
		// then change the wrong data.
		if err := checkNotEmptyFlag(cmd, "database-url", strings.TrimSpace(a.databaseURL), "to use DATABASE_URL, else libpq's PG* variables"); err != nil {
			return err
		}
		if err := checkNotEmptyFlag(cmd, "schema", a.schema, "to use the connection's search_path"); err != nil {
			return err
		}
		if err := checkSchemaFlag("--schema", a.schema); err != nil {
			return err
		}
		a.started = true
		return fn(cmd, args)
	}
}

// checkNotEmptyFlag returns a usage error when the flag called name was given with an empty
// value; omitting, the message says, does what the empty value would have done.
func checkNotEmptyFlag(cmd *cobra.Command, name, value, omitted string) error {
	if cmd.Flags().Changed(name) && value == "" {
		return usagef("--%s must not be empty (omit it %s)", name, omitted)
	}
	return nil
}

// checkSchemaFlag returns a usage error when schema, the value of the flag called name,
// cannot be pgidem's schema (migrations.CheckSchemaName: the rules of
// pgidem.Config.Schema, and not "$user"). "" (the search_path) is valid.
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

// checkKeyPart returns a usage error when value cannot be in a row. value is the namespace,
// key, consumer or message id called name. It cannot be in a row when it is empty (the
// columns refuse it), or has a NUL byte or invalid UTF-8, which Postgres text cannot hold
// (see checkText). A control character
// (tab, newline, …) is accepted: the library never stores one (pgidem.ErrInvalidKey), but
// rows inserted with SQL can have one, and the tables show it quoted ("order\t9") so that
// show and forget can be given it. The library's length limits are not checked either: they
// are the application's configuration (pgidem.Config.MaxKeyBytes, MaxNamespaceBytes), which
// the CLI does not know.
func checkKeyPart(name, value string) error {
	if value == "" {
		return usagef("%s must not be empty", name)
	}
	return checkFilter(name, value)
}

// checkFilter is [checkKeyPart] for a filter flag, whose empty value the caller handles.
func checkFilter(name, value string) error {
	return checkText(name, value)
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
