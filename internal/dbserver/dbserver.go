// Package dbserver finds the Postgres server that tests and example programs use, the same
// way everywhere: DATABASE_URL, else libpq's PG* variables, else the local default
// postgres://postgres@127.0.0.1:5432/postgres, else a throwaway container through
// testcontainers-go when a Docker engine answers. When none answers it returns an error that
// says how to provide one.
package dbserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"

	"github.com/pgidem/pgidem/migrations"
)

// LocalDefault is the server tried when neither DATABASE_URL nor a PG* variable is set.
const LocalDefault = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ContainerImage is the image started when no server answers and a Docker engine does.
const ContainerImage = "postgres:15-alpine"

// Server is a reachable Postgres server.
type Server struct {
	// URL connects to a database on the server with rights to create databases.
	URL string
	// Source says where URL came from: "DATABASE_URL", "PG* variables", "local default" or
	// "testcontainers".
	Source string

	container *tcpostgres.PostgresContainer
}

// Close stops the container when the server was started for this process; otherwise it does
// nothing.
func (s *Server) Close(ctx context.Context) error {
	if s.container == nil {
		return nil
	}
	return testcontainers.TerminateContainer(s.container)
}

// Find returns the first server that answers, in the order the package doc gives.
func Find(ctx context.Context) (*Server, error) {
	var tried []string
	candidates := []struct{ url, source string }{}
	if u := os.Getenv("DATABASE_URL"); u != "" {
		candidates = append(candidates, struct{ url, source string }{u, "DATABASE_URL"})
	} else if hasPGEnv() {
		candidates = append(candidates, struct{ url, source string }{"", "PG* variables"})
	} else {
		candidates = append(candidates, struct{ url, source string }{LocalDefault, "local default"})
	}
	for _, c := range candidates {
		err := ping(ctx, c.url)
		if err == nil {
			return &Server{URL: c.url, Source: c.source}, nil
		}
		tried = append(tried, fmt.Sprintf("%s (%s): %v", c.source, redact(c.url), err))
	}

	if dockerAvailable() {
		startCtx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		container, err := tcpostgres.Run(startCtx, ContainerImage,
			tcpostgres.WithDatabase("postgres"),
			tcpostgres.WithUsername("postgres"),
			tcpostgres.WithPassword("postgres"),
			tcpostgres.BasicWaitStrategies(),
		)
		if err == nil {
			url, err := container.ConnectionString(startCtx, "sslmode=disable")
			if err == nil {
				return &Server{URL: url, Source: "testcontainers", container: container}, nil
			}
			_ = testcontainers.TerminateContainer(container)
		}
		tried = append(tried, fmt.Sprintf("testcontainers (%s): %v", ContainerImage, err))
	} else {
		tried = append(tried, "testcontainers: no Docker engine (no DOCKER_HOST, no /var/run/docker.sock)")
	}

	return nil, errors.New("pgidem: no Postgres server answered; tried:\n  " + strings.Join(tried, "\n  ") +
		"\nprovide one with DATABASE_URL=postgres://user@host:5432/db (a role that may CREATE DATABASE), " +
		"or libpq PGHOST/PGPORT/PGUSER variables, or start the local cluster " +
		"(pg_ctlcluster 15 main start), or run a Docker engine for testcontainers")
}

func hasPGEnv() bool {
	for _, name := range []string{"PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD", "PGSERVICE"} {
		if os.Getenv(name) != "" {
			return true
		}
	}
	return false
}

func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}

func dockerAvailable() bool {
	if os.Getenv("DOCKER_HOST") != "" {
		return true
	}
	_, err := os.Stat("/var/run/docker.sock")
	return err == nil
}

// redact hides a password in a URL for error messages.
func redact(url string) string {
	if url == "" {
		return "libpq environment"
	}
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "unparsable connection string"
	}
	return fmt.Sprintf("%s@%s:%d/%s", cfg.User, cfg.Host, cfg.Port, cfg.Database)
}

// ConnStringFor returns serverURL with its database replaced by dbName, keeping every other
// setting (host, user, TLS mode, password).
func ConnStringFor(serverURL, dbName string) (string, error) {
	if strings.HasPrefix(serverURL, "postgres://") || strings.HasPrefix(serverURL, "postgresql://") {
		u, err := neturl.Parse(serverURL)
		if err != nil {
			return "", fmt.Errorf("parse server url: %w", err)
		}
		u.Path = "/" + dbName
		return u.String(), nil
	}
	// Keyword/value form (or "" for the PG* variables): a later dbname overrides.
	return strings.TrimSpace(serverURL + " dbname='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(dbName) + "'"), nil
}

// Database is a database this process created on a server, to be dropped when done.
type Database struct {
	// Name is the database's name.
	Name string
	// URL connects to it.
	URL string

	serverURL string
}

// CreateDatabase creates an empty database named prefix followed by random hex, cloned from
// template when template is non-empty.
func (s *Server) CreateDatabase(ctx context.Context, prefix, template string) (*Database, error) {
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	name := prefix + hex.EncodeToString(suffix[:])
	admin, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to server: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	create := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		create += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
	}
	if _, err := admin.Exec(ctx, create); err != nil {
		return nil, fmt.Errorf("%s: %w", create, err)
	}
	db := &Database{Name: name, serverURL: s.URL}
	// The comment dates the database, so that DropStale can tell one a killed run left
	// behind. (COMMENT takes no parameters; the text is ours and holds no quote.)
	comment := fmt.Sprintf("COMMENT ON DATABASE %s IS '%s%s'", pgx.Identifier{name}.Sanitize(),
		scratchComment, time.Now().UTC().Format(time.RFC3339))
	if _, err := admin.Exec(ctx, comment); err != nil {
		return nil, errors.Join(fmt.Errorf("date database %s: %w", name, err), db.Drop(ctx))
	}
	if db.URL, err = ConnStringFor(s.URL, name); err != nil {
		return nil, errors.Join(err, db.Drop(ctx))
	}
	return db, nil
}

// scratchComment starts the comment [Server.CreateDatabase] puts on its databases; the
// creation time (RFC 3339, UTC) follows.
const scratchComment = "pgidem scratch database created at "

// DropStale drops the databases [Server.CreateDatabase] created more than age ago that
// nobody is connected to: those left behind by test runs and example programs that were
// killed before their cleanup. A database still in use is kept (the DROP does not force
// it). It returns the names it dropped.
func (s *Server) DropStale(ctx context.Context, age time.Duration) ([]string, error) {
	admin, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to server: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	rows, err := admin.Query(ctx, `SELECT datname FROM pg_database
		WHERE NOT datistemplate
			AND substring(shobj_description(oid, 'pg_database') FROM '^'||$1||'(.*)$')::timestamptz < now() - $2::interval`,
		scratchComment, age)
	if err != nil {
		return nil, fmt.Errorf("list stale databases: %w", err)
	}
	stale, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list stale databases: %w", err)
	}
	var dropped []string
	for _, name := range stale {
		_, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize())
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse: // someone still uses it
		case err != nil:
			return dropped, fmt.Errorf("drop stale database %s: %w", name, err)
		default:
			dropped = append(dropped, name)
		}
	}
	return dropped, nil
}

// Drop drops the database, ending its open connections. It runs on its own 30 s timeout,
// detached from ctx's cancellation, so cleanup after a cancelled run still happens.
func (d *Database) Drop(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, d.serverURL)
	if err != nil {
		return fmt.Errorf("drop %s: connect: %w", d.Name, err)
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{d.Name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop %s: %w", d.Name, err)
	}
	return nil
}

// Scratch is a migrated database for an example program, on the server [Find] chose.
type Scratch struct {
	*Database
	// Pool is a pool on the database.
	Pool *pgxpool.Pool

	server *Server
}

// NewScratch finds a server, creates a database named prefix plus random hex on it and
// runs pgidem's migrations. Close drops it.
func NewScratch(ctx context.Context, prefix string) (*Scratch, error) {
	server, err := Find(ctx)
	if err != nil {
		return nil, err
	}
	db, err := server.CreateDatabase(ctx, prefix, "")
	if err != nil {
		return nil, errors.Join(err, server.Close(ctx))
	}
	s := &Scratch{Database: db, server: server}
	if err := s.migrate(ctx); err != nil {
		return nil, errors.Join(err, s.Close(ctx))
	}
	if s.Pool, err = pgxpool.New(ctx, db.URL); err != nil {
		return nil, errors.Join(err, s.Close(ctx))
	}
	return s, nil
}

func (s *Scratch) migrate(ctx context.Context) error {
	sqlDB, err := migrations.OpenDB(s.URL, "")
	if err != nil {
		return err
	}
	defer sqlDB.Close()
	_, err = migrations.Up(ctx, sqlDB, nil)
	return err
}

// Close closes the pool, drops the database and stops a container started for it.
func (s *Scratch) Close(ctx context.Context) error {
	if s.Pool != nil {
		s.Pool.Close()
	}
	return errors.Join(s.Drop(ctx), s.server.Close(ctx))
}
