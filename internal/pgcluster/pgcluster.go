// Package pgcluster starts a throwaway Postgres cluster that one test owns, so the test can
// restart or stop the server without touching the shared one that other tests use.
//
// [Start] runs initdb into a temporary directory and starts the server with pg_ctl,
// listening only on a Unix socket in that directory (no TCP port is opened, so clusters
// never collide). The server binaries come from `pg_config --bindir`, else the newest
// /usr/lib/postgresql/<version>/bin, else initdb on PATH; Debian's postgresql package
// provides them. Postgres refuses to run as root, so a test running as root (as CI does)
// runs initdb and pg_ctl as the postgres user through runuser. The cluster is stopped and
// its directory removed when the test ends.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// Mode is a pg_ctl shutdown mode.
type Mode string

const (
	// Fast disconnects the clients, rolling back their open transactions, and shuts down
	// cleanly (a checkpoint): pg_ctl's -m fast, what a service manager's restart does.
	Fast Mode = "fast"
	// Immediate ends every server process at once, without a checkpoint: the next start
	// runs crash recovery, as after a server crash. pg_ctl's -m immediate.
	Immediate Mode = "immediate"
)

// osUser is the account the server runs as when the test runs as root.
const osUser = "postgres"

// pgCtlTimeout bounds pg_ctl's wait for the server to start or stop.
const pgCtlTimeout = 120 * time.Second

// Cluster is a Postgres cluster owned by one test. Its methods are safe for concurrent
// use; they return errors rather than failing the test, so they may be called from any
// goroutine.
type Cluster struct {
	bin    string // directory holding initdb and pg_ctl
	dir    string // the cluster's directory: data, socket and log
	port   int
	asUser string // the account to run the binaries as ("": the test's own)

	mu      sync.Mutex
	running bool
}

// Start creates and starts a cluster for t, with trust authentication for the superuser
// postgres and fsync off (the data is thrown away). It fails t when the server binaries
// are missing or the cluster cannot start. The cluster is stopped (immediate mode) and its
// directory removed when t ends.
func Start(t testing.TB) *Cluster {
	t.Helper()
	bin, err := binDir()
	if err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	c := &Cluster{bin: bin}
	if os.Geteuid() == 0 {
		c.asUser = osUser
	}
	if c.dir, err = c.makeDir(t); err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	t.Cleanup(func() {
		if err := c.shutdown(Immediate); err != nil {
			t.Errorf("pgcluster: stopping the cluster: %v", err)
		}
		if err := os.RemoveAll(c.dir); err != nil {
			t.Errorf("pgcluster: %v", err)
		}
	})
	if c.port, err = freePort(); err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	if err := c.initdb(); err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	if err := c.Start(); err != nil {
		t.Fatalf("pgcluster: %v", err)
	}
	return c
}

// URL returns a connection URL for the postgres database as the superuser postgres,
// through the cluster's Unix socket.
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@/postgres?host=%s&port=%d&sslmode=disable", c.socketDir(), c.port)
}

// Restart shuts the server down in mode and starts it again, returning once it accepts
// connections.
func (c *Cluster) Restart(mode Mode) error {
	if err := c.Shutdown(mode); err != nil {
		return err
	}
	return c.Start()
}

// Shutdown stops the server in mode; [Cluster.Start] starts it again. It returns an error
// when the server is not running.
func (c *Cluster) Shutdown(mode Mode) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.running {
		return errors.New("pgcluster: the server is not running")
	}
	return c.stopLocked(mode)
}

// Stop stops the server in fast mode; stopping a stopped server does nothing.
func (c *Cluster) Stop() error { return c.shutdown(Fast) }

// Start starts the server after [Cluster.Shutdown] or [Cluster.Stop], returning once it
// accepts connections; starting a running server does nothing.
func (c *Cluster) Start() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running {
		return nil
	}
	if err := c.pgCtl("start", "-l", filepath.Join(c.dir, "server.log")); err != nil {
		return err
	}
	c.running = true
	return nil
}

// shutdown stops the server in mode if it is running.
func (c *Cluster) shutdown(mode Mode) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.running {
		return nil
	}
	return c.stopLocked(mode)
}

// stopLocked stops the running server in mode; c.mu is held.
func (c *Cluster) stopLocked(mode Mode) error {
	if mode != Fast && mode != Immediate {
		return fmt.Errorf("pgcluster: unknown shutdown mode %q", mode)
	}
	if err := c.pgCtl("stop", "-m", string(mode)); err != nil {
		return err
	}
	c.running = false
	return nil
}

// pgCtl runs pg_ctl action on the cluster, waiting for it to take effect.
func (c *Cluster) pgCtl(action string, args ...string) error {
	args = append([]string{action, "-D", c.dataDir(), "-w", "-t", strconv.Itoa(int(pgCtlTimeout.Seconds()))}, args...)
	return c.run("pg_ctl", args...)
}

// initdb creates the cluster's data directory and configures the server to listen on the
// cluster's socket only.
func (c *Cluster) initdb() error {
	if err := c.run("initdb", "-D", c.dataDir(), "-U", "postgres", "--auth=trust", "-E", "UTF8",
		"--locale=C", "--no-sync"); err != nil {
		return err
	}
	if err := os.MkdirAll(c.socketDir(), 0o700); err != nil {
		return err
	}
	if err := c.chown(c.socketDir()); err != nil {
		return err
	}
	conf := fmt.Sprintf("\n# pgcluster\nlisten_addresses = ''\nunix_socket_directories = '%s'\nport = %d\n"+
		"fsync = off\nshared_buffers = 16MB\nmax_connections = 60\n", c.socketDir(), c.port)
	f, err := os.OpenFile(filepath.Join(c.dataDir(), "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = f.WriteString(conf)
	return errors.Join(err, f.Close())
}

// run runs one of the server binaries, as c.asUser when set, and returns an error holding
// its output when it fails.
func (c *Cluster) run(name string, args ...string) error {
	path := filepath.Join(c.bin, name)
	if c.asUser != "" {
		runuser, err := exec.LookPath("runuser")
		if err != nil {
			return fmt.Errorf("running as root, the server must run as %s through runuser (util-linux): %w", c.asUser, err)
		}
		args = append([]string{"-u", c.asUser, "--", path}, args...)
		path = runuser
	}
	ctx, cancel := context.WithTimeout(context.Background(), pgCtlTimeout+30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Dir = c.dir
	cmd.WaitDelay = 10 * time.Second
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s %s: %w\n%s%s", name, strings.Join(args, " "), err, out, c.logTail())
	}
	return nil
}

// logTail returns the end of the server's log, for an error message.
func (c *Cluster) logTail() string {
	b, err := os.ReadFile(filepath.Join(c.dir, "server.log"))
	if err != nil {
		return ""
	}
	const keep = 2000
	return "server log:\n" + string(b[max(0, len(b)-keep):])
}

// makeDir creates the cluster's directory: t's temporary directory, or, when the server
// runs as another user, a directory of its own that the user owns (t's temporary
// directories are private to the test's user).
func (c *Cluster) makeDir(t testing.TB) (string, error) {
	if c.asUser == "" {
		return t.TempDir(), nil
	}
	dir, err := os.MkdirTemp("", "pgcluster-")
	if err != nil {
		return "", err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return "", errors.Join(err, os.RemoveAll(dir))
	}
	if err := c.chown(dir); err != nil {
		return "", errors.Join(err, os.RemoveAll(dir))
	}
	return dir, nil
}

// chown gives path to c.asUser, if set.
func (c *Cluster) chown(path string) error {
	if c.asUser == "" {
		return nil
	}
	u, err := user.Lookup(c.asUser)
	if err != nil {
		return fmt.Errorf("running as root, the server must run as %s: %w", c.asUser, err)
	}
	uid, err := strconv.Atoi(u.Uid)
	if err != nil {
		return err
	}
	gid, err := strconv.Atoi(u.Gid)
	if err != nil {
		return err
	}
	return os.Chown(path, uid, gid)
}

func (c *Cluster) dataDir() string   { return filepath.Join(c.dir, "data") }
func (c *Cluster) socketDir() string { return filepath.Join(c.dir, "sock") }

// freePort returns a TCP port no one listens on at the moment. The server listens on no
// TCP port; the number names its socket file.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// binDir finds the directory holding initdb and pg_ctl.
func binDir() (string, error) {
	var candidates []string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		candidates = append(candidates, strings.TrimSpace(string(out)))
	}
	versions, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(versions, func(a, b string) int { return versionOf(b) - versionOf(a) }) // newest first
	candidates = append(candidates, versions...)
	if initdb, err := exec.LookPath("initdb"); err == nil {
		if resolved, err := filepath.EvalSymlinks(initdb); err == nil {
			initdb = resolved
		}
		candidates = append(candidates, filepath.Dir(initdb))
	}
	for _, dir := range candidates {
		if isFile(filepath.Join(dir, "initdb")) && isFile(filepath.Join(dir, "pg_ctl")) {
			return dir, nil
		}
	}
	return "", errors.New("no Postgres server binaries (initdb, pg_ctl) found through pg_config --bindir, " +
		"/usr/lib/postgresql/*/bin or PATH; install the server (Debian: apt-get install postgresql)")
}

// versionOf returns the major version in a /usr/lib/postgresql/<version>/bin path, or 0.
func versionOf(dir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(dir)))
	return v
}

// isFile reports whether path is a regular file (following links).
func isFile(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}
