// Package pgbouncer puts PgBouncer, in transaction pooling mode, between tests and the test
// server, so that the pooler tests run through a real transaction pooler.
//
// [URL] uses the PgBouncer named by the environment variable [EnvURL] (.ci/run starts one
// and sets it); when the variable is unset it starts a pgbouncer process of its own for the
// test, on a free local port, and stops it when the test ends. When neither is possible
// the test fails (never skips) with a message saying how to install PgBouncer.
//
// The PgBouncer it starts routes every database name to the test server (a "*" entry),
// so the per-test databases of internal/testdb are reachable through it, and it trusts
// the user of the test server's URL. Prepared statements are not tracked across server
// connections (max_prepared_statements is 0, and before PgBouncer 1.21 there is no such
// setting), as in most deployments: pgx's default query mode fails through it.
package pgbouncer

import (
	"context"
	"errors"
	"fmt"
	"net"
	neturl "net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// EnvURL names the environment variable holding a connection URL of a running PgBouncer in
// transaction pooling mode, in front of the same server as the tests' DATABASE_URL. Only
// its host and port are used.
const EnvURL = "PGIDEM_PGBOUNCER_URL"

// InstallHint says how to make PgBouncer available; it ends the failure message of [URL].
const InstallHint = "install PgBouncer (Debian/Ubuntu: apt-get install pgbouncer; it need not run as a service) " +
	"or set " + EnvURL + " to a PgBouncer in transaction pooling mode in front of the test server"

// PoolSize is the number of server connections per database (default_pool_size) of the
// PgBouncer [URL] starts.
const PoolSize = 4

// URL returns dbURL (a postgres:// URL or a keyword/value string from internal/testdb)
// rewritten to connect through PgBouncer in transaction pooling mode, with pgx's
// default_query_exec_mode set to mode ("exec", "simple_protocol"; "" keeps pgx's default,
// cache_statement). It fails the test when no PgBouncer can be found or started.
func URL(tb testing.TB, dbURL, mode string) string {
	tb.Helper()
	host, port := address(tb, dbURL)
	return rewrite(tb, dbURL, host, port, mode)
}

// address returns the host and port of the PgBouncer to use: [EnvURL]'s, or those of one
// started for this test in front of dbURL's server.
func address(tb testing.TB, dbURL string) (string, int) {
	tb.Helper()
	if env := os.Getenv(EnvURL); env != "" {
		cfg, err := pgx.ParseConfig(env)
		if err != nil {
			tb.Fatalf("pgbouncer: %s: %v", EnvURL, err)
		}
		return cfg.Host, int(cfg.Port)
	}
	bin, err := binary()
	if err != nil {
		tb.Fatalf("pgbouncer: the pooler tests need PgBouncer: %v; %s", err, InstallHint)
	}
	server, err := pgx.ParseConfig(dbURL)
	if err != nil {
		tb.Fatalf("pgbouncer: %v", err)
	}
	port, err := start(tb, bin, server)
	if err != nil {
		tb.Fatalf("pgbouncer: %v", err)
	}
	return "127.0.0.1", port
}

// binary finds the pgbouncer executable on PATH or where Debian installs it.
func binary() (string, error) {
	if bin, err := exec.LookPath("pgbouncer"); err == nil {
		return bin, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if _, err := os.Stat(debian); err == nil {
		return debian, nil
	}
	return "", errors.New("no pgbouncer executable on PATH or at /usr/sbin/pgbouncer")
}

// start runs a pgbouncer process in front of server until the test ends and returns its
// port. PgBouncer refuses to run as root: then it runs as the postgres user (-u).
func start(tb testing.TB, bin string, server *pgx.ConnConfig) (int, error) {
	tb.Helper()
	dir, err := os.MkdirTemp("", "pgidem-pgbouncer-")
	if err != nil {
		return 0, err
	}
	tb.Cleanup(func() { _ = os.RemoveAll(dir) })
	// Readable by the postgres user when pgbouncer drops root for it.
	if err := os.Chmod(dir, 0o755); err != nil {
		return 0, err
	}
	var lastErr error
	for range 5 { // the free port may be taken between the probe and pgbouncer's bind
		port, err := freePort()
		if err != nil {
			return 0, err
		}
		if lastErr = run(tb, bin, dir, server, port); lastErr == nil {
			return port, nil
		}
	}
	return 0, lastErr
}

// freePort returns a local TCP port nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// config is the pgbouncer.ini of a started PgBouncer: every database name to the server,
// transaction pooling, trust for the users in the auth file.
const config = `[databases]
* = host=%s port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
default_pool_size = %d
max_client_conn = 1000
server_reset_query =
server_check_delay = 0
ignore_startup_parameters = extra_float_digits
`

// run writes the configuration for port, starts pgbouncer and waits until it accepts
// connections; the test's cleanup stops it.
func run(tb testing.TB, bin, dir string, server *pgx.ConnConfig, port int) error {
	tb.Helper()
	authFile := filepath.Join(dir, "userlist.txt")
	quote := func(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
	if err := os.WriteFile(authFile, []byte(quote(server.User)+" "+quote(server.Password)+"\n"), 0o644); err != nil {
		return err
	}
	host := server.Host
	if strings.HasPrefix(host, "/") || host == "localhost" {
		host = "127.0.0.1"
	}
	ini := filepath.Join(dir, fmt.Sprintf("pgbouncer-%d.ini", port))
	if err := os.WriteFile(ini, fmt.Appendf(nil, config, host, server.Port, port, authFile, PoolSize), 0o644); err != nil {
		return err
	}
	logPath := filepath.Join(dir, fmt.Sprintf("pgbouncer-%d.log", port))
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	args := []string{ini}
	if os.Geteuid() == 0 {
		if _, err := user.Lookup("postgres"); err != nil {
			return fmt.Errorf("pgbouncer does not run as root and there is no postgres user to run it as: %w", err)
		}
		args = []string{"-u", "postgres", ini}
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile // files: no copying goroutines
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM) // immediate shutdown
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}
	if err := ready(port, exited); err != nil {
		stop()
		out, _ := os.ReadFile(logPath)
		return fmt.Errorf("%w; its log:\n%s", err, out)
	}
	tb.Cleanup(stop)
	return nil
}

// ready waits until pgbouncer accepts connections on port, or exits, or 30 s pass.
func ready(port int, exited <-chan error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for {
		conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
		if err == nil {
			conn.Close()
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("pgbouncer exited: %v", err)
		case <-ctx.Done():
			return fmt.Errorf("pgbouncer did not listen on %s within 30 s", addr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// rewrite returns dbURL with its host and port replaced and default_query_exec_mode set
// to mode when mode is non-empty.
func rewrite(tb testing.TB, dbURL, host string, port int, mode string) string {
	tb.Helper()
	if strings.HasPrefix(dbURL, "postgres://") || strings.HasPrefix(dbURL, "postgresql://") {
		u, err := neturl.Parse(dbURL)
		if err != nil {
			tb.Fatalf("pgbouncer: parse %q: %v", dbURL, err)
		}
		u.Host = net.JoinHostPort(host, strconv.Itoa(port))
		q := u.Query()
		q.Del("host")
		q.Del("port")
		if mode != "" {
			q.Set("default_query_exec_mode", mode)
		}
		u.RawQuery = q.Encode()
		return u.String()
	}
	// Keyword/value form: later settings override earlier ones.
	s := fmt.Sprintf("%s host=%s port=%d", dbURL, host, port)
	if mode != "" {
		s += " default_query_exec_mode=" + mode
	}
	return strings.TrimSpace(s)
}
