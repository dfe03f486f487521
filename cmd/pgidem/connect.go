package main

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// connectTimeoutDefault bounds connecting when the connection string sets no positive
// connect_timeout, so that an unreachable address fails instead of hanging.
const connectTimeoutDefault = 10 * time.Second

// interruptGrace is how long, after an interrupt (SIGINT, SIGTERM), a statement in flight
// waits for the server's answer to the cancel request the CLI sends. The answer says
// whether the statement was cancelled (nothing changed) or had completed, so forget and
// sweep can tell what they did. Past it the connection is dropped, and the outcome is
// unknown.
const interruptGrace = 3 * time.Second

// interruptCloseWait bounds how long, after an interrupt, closing a pool waits for its
// connections to close (see closePool).
const interruptCloseWait = time.Second

// closePool closes pool. Once ctx has ended (an interrupt) it waits at most
// interruptCloseWait for that. pgconn closes a connection whose server did not answer the
// cancel request within interruptGrace in the background, waiting up to 15 s for the
// server. pool.Close waits for it, so the message and the exit would come that much
// later. The process exits soon after closePool returns, and the kernel then closes what
// is left of the connections.
func closePool(ctx context.Context, pool *pgxpool.Pool) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		pool.Close()
	}()
	select {
	case <-closed:
		return
	case <-ctx.Done():
	}
	timer := time.NewTimer(interruptCloseWait)
	defer timer.Stop()
	select {
	case <-closed:
	case <-timer.C:
	}
}

// applicationName is reported to Postgres (pg_stat_activity) unless the connection string
// sets application_name.
const applicationName = "pgidem-cli"

// source says where the connection string came from, for error messages.
func (a *app) connString() (connString, source string) {
	switch {
	case a.databaseURL != "":
		return a.databaseURL, "--database-url"
	case a.getenv("DATABASE_URL") != "":
		return a.getenv("DATABASE_URL"), "DATABASE_URL"
	default:
		return "", "libpq PG* variables"
	}
}

// poolConfig parses the connection string into a pool configuration with the CLI's
// defaults: a connect timeout, an application name, search_path set to --schema, and the
// session time zone set to UTC.
func (a *app) poolConfig() (*pgxpool.Config, string, error) {
	connString, source := a.connString()
	if lower := strings.ToLower(strings.TrimSpace(connString)); (strings.HasPrefix(lower, "postgres://") || strings.HasPrefix(lower, "postgresql://")) &&
		!strings.HasPrefix(connString, "postgres://") && !strings.HasPrefix(connString, "postgresql://") {
		// pgx (like libpq) recognises only the lower-case schemes at the very start, and
		// would take anything else for keyword/value settings that the server then echoes,
		// password and all.
		return nil, source, fmt.Errorf("pgidem: invalid connection string from %s: a URL must start with postgres:// or postgresql://, in lower case and with nothing before it", source)
	}
	cfg, err := pgxpool.ParseConfig(connString)
	if err != nil {
		return nil, source, parseError(connString, source, err)
	}
	// pgconn reports connect_timeout=0 (libpq: wait forever) and no connect_timeout alike,
	// as 0: both get the default (the package doc says so).
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = connectTimeoutDefault
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = applicationName
	}
	if a.schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = pgx.Identifier{a.schema}.Sanitize()
	}
	// goose's version table records when a migration was applied as a timestamp without
	// time zone, written with now() in the session time zone and read back by pgx as UTC.
	// Only a UTC session makes migrate status right, so a timezone in the connection string
	// is overridden. Everything else the CLI reads is timestamptz, which any zone reads the
	// same.
	for name := range cfg.ConnConfig.RuntimeParams {
		if strings.EqualFold(name, "timezone") {
			delete(cfg.ConnConfig.RuntimeParams, name)
		}
	}
	cfg.ConnConfig.RuntimeParams["timezone"] = "UTC"
	// On an interrupt, ask the server to cancel the statement and read its answer, rather
	// than drop the connection at once (pgconn's default): a dropped connection leaves the
	// statement running on the server, to commit or not.
	cfg.ConnConfig.BuildContextWatcherHandler = func(conn *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: conn, DeadlineDelay: interruptGrace}
	}
	cfg.MaxConns = 2
	return cfg, source, nil
}

// connectPool opens a pool and checks that the server answers.
func (a *app) connectPool(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, source, err := a.poolConfig()
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, connectError(ctx, cfg.ConnConfig, source, err)
	}
	if err := pool.Ping(ctx); err != nil {
		closePool(ctx, pool)
		return nil, connectError(ctx, cfg.ConnConfig, source, err)
	}
	return pool, nil
}

// connectDB opens a database/sql handle for the migrations package (search_path set to
// --schema, as migrations.Opts.Schema requires) and checks that the server answers.
func (a *app) connectDB(ctx context.Context) (*sql.DB, error) {
	cfg, source, err := a.poolConfig()
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDB(*cfg.ConnConfig)
	db.SetMaxOpenConns(2)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, connectError(ctx, cfg.ConnConfig, source, err)
	}
	return db, nil
}

// connectError says which address was tried, for whom and from which setting, and why it
// failed. It never includes the password. When ctx ended (an interrupt) it says so, as an
// [*interruptedError], instead of quoting pgconn's "context canceled",
// which reads like a network failure.
func connectError(ctx context.Context, cfg *pgx.ConnConfig, source string, err error) error {
	if ctx.Err() != nil {
		return interruptedf("pgidem: interrupted while connecting to Postgres at %s (database %q, user %q, from %s)",
			describeAddress(&cfg.Config), cmp.Or(cfg.Database, cfg.User), cfg.User, source)
	}
	cause := err
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) && ce.Unwrap() != nil {
		cause = ce.Unwrap()
	}
	// One attempt per host and TLS mode: the same failure is often reported twice.
	var parts []string
	for _, line := range strings.Split(cause.Error(), "\n") {
		line = strings.TrimSpace(line)
		if line != "" && !slices.ContainsFunc(parts, func(p string) bool { return strings.Contains(p, line) }) {
			parts = append(parts, line)
		}
	}
	// No password to mask: pgconn's connect errors name the host, user and database, and the
	// server's messages do not echo a password. A URL with an upper-case scheme, which pgx
	// would parse as settings the server echoes, is refused before connecting. Replacing
	// the password's text wherever it occurs would garble the message when the password is
	// short or a common word.
	msg := strings.Join(parts, "; ")
	return fmt.Errorf("pgidem: cannot connect to Postgres at %s (database %q, user %q, from %s): %s",
		describeAddress(&cfg.Config), cmp.Or(cfg.Database, cfg.User), cfg.User, source, msg)
}

// parseError reports a connection string pgx cannot parse. pgconn's message quotes the
// string with passwords masked only on a best-effort basis (see pgconn.ParseConfigError):
// malformed input, such as "password = secret" with spaces around the '=', slips through.
// So when the string may hold a password (it mentions "password", or has an '@' that may
// end a URL's user:password) the message names only its source; pgconn's detail is kept
// for strings that cannot hold one.
func parseError(connString, source string, err error) error {
	if mayHoldPassword(connString) {
		return fmt.Errorf("pgidem: invalid connection string from %s: it could not be parsed (details withheld: the string may contain a password)", source)
	}
	return fmt.Errorf("pgidem: invalid connection string from %s: %w", source, err)
}

// mayHoldPassword reports whether connString may carry a password that a parse error
// would repeat: a password setting anywhere, a URL whose user info has a password, or a
// URL too broken to tell. A URL with a user name only (postgres://app@host/db) does not.
func mayHoldPassword(connString string) bool {
	if strings.Contains(strings.ToLower(connString), "password") {
		return true
	}
	if !strings.HasPrefix(connString, "postgres://") && !strings.HasPrefix(connString, "postgresql://") {
		return false // keyword/value form: a password is only ever a password= setting
	}
	u, err := url.Parse(connString)
	if err != nil {
		return strings.Contains(connString, "@")
	}
	_, has := u.User.Password()
	return has
}

// describeAddress lists the host(s) a connection attempt tries, first to last.
func describeAddress(cfg *pgconn.Config) string {
	addrs := []string{hostPort(cfg.Host, cfg.Port)}
	for _, fb := range cfg.Fallbacks {
		if a := hostPort(fb.Host, fb.Port); a != addrs[len(addrs)-1] {
			addrs = append(addrs, a)
		}
	}
	return strings.Join(addrs, ", ")
}

func hostPort(host string, port uint16) string {
	if strings.HasPrefix(host, "/") {
		return fmt.Sprintf("unix socket %s/.s.PGSQL.%d", host, port)
	}
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}
