// Package redistest starts real redis-server processes for tests.
//
// Tests never talk to a mock: each Server is a redis-server child process on a
// free loopback port with persistence off, stopped at the test's cleanup. Stop
// and Start let a test simulate an outage and a recovery on the same address.
package redistest

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// InstallHint is the command that provides redis-server on this project's machines.
const InstallHint = "apt-get update && apt-get install -y redis-server"

// Server is one redis-server process, owned by a test (Start) or by a
// program such as a benchmark (Launch).
type Server struct {
	bin   string
	port  int
	conf  string   // a config file, for a sentinel; empty for a plain server
	extra []string // further redis-server arguments

	mu  sync.Mutex
	cmd *exec.Cmd
}

// Start launches a redis-server on a free loopback port and registers its
// shutdown with t.Cleanup. A missing redis-server fails the test with the
// install command: a test that needs Redis never passes without it.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t)
}

// StartWith is Start with further redis-server arguments, such as
// "--enable-debug-command", "yes" for a test that stalls the server with DEBUG
// SLEEP.
func StartWith(t testing.TB, args ...string) *Server {
	t.Helper()
	s, err := Launch(args...)
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// Launch starts a redis-server on a free loopback port for a program that is
// not a test; the caller stops it.
func Launch(args ...string) (*Server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	return launchNode(port, args...)
}

func launchNode(port int, extra ...string) (*Server, error) {
	bin, err := redisServer()
	if err != nil {
		return nil, err
	}
	s := &Server{bin: bin, port: port, extra: extra}
	if err := s.start(); err != nil {
		return nil, err
	}
	return s, nil
}

func redisServer() (string, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", fmt.Errorf("redis-server is not on PATH; install it with: %s (or run `make test`, which does)", InstallHint)
	}
	return bin, nil
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// URL is a redis:// URL for database 0 of the server.
func (s *Server) URL() string { return "redis://" + s.Addr() + "/0" }

// Stop kills the server and waits for it to exit. Stopping a stopped server
// does nothing.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// running reports whether the server was started and not stopped.
func (s *Server) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cmd != nil
}

// Restart starts the server again on the same port after Stop, with an empty
// dataset (persistence is off), as after a real crash of a cache node.
func (s *Server) Restart() error {
	if err := s.start(); err != nil {
		return fmt.Errorf("redistest: restart: %w", err)
	}
	return nil
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return fmt.Errorf("redis-server on port %d is already running", s.port)
	}
	var args []string
	if s.conf != "" {
		args = append(args, s.conf) // redis-server reads a config file only as its first argument
	}
	args = append(args,
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--protected-mode", "no",
	)
	args = append(args, s.extra...)
	cmd := exec.Command(s.bin, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", s.bin, err)
	}
	ready := make(chan struct{})
	var log []string
	go func() {
		sc := bufio.NewScanner(out)
		signalled := false
		for sc.Scan() {
			line := sc.Text()
			if !signalled {
				log = append(log, line)
				// A sentinel has no "Ready" line; it says its ID once it listens.
				if strings.Contains(line, "Ready to accept connections") || strings.Contains(line, "Sentinel ID is") {
					signalled = true
					close(ready)
				}
			}
		}
		if !signalled {
			close(ready)
		}
	}()
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
	}
	if err := waitDial(s.Addr(), 5*time.Second); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("redis-server did not come up on %s: %w; output: %v", s.Addr(), err, log)
	}
	s.cmd = cmd
	return nil
}

func waitDial(addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			_ = c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("finding a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Client is a client of the server for a test, closed at its cleanup, with
// the plugin's settings that matter to a fault test: short timeouts that
// honour the context, no retries by the client, one dial attempt.
func (s *Server) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), DialTimeout: 200 * time.Millisecond,
		ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond,
		MaxRetries: -1, DialerRetries: 1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// WaitStalled waits until the server has begun a stall (a DEBUG SLEEP sent on
// another connection): a PING on a new connection goes unanswered. A test
// that stalls the server from a goroutine calls it before it acts, rather
// than sleeping and hoping the stall has begun.
func (s *Server) WaitStalled(t testing.TB) {
	t.Helper()
	answers := func() bool {
		probe := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: 20 * time.Millisecond})
		defer probe.Close()
		return probe.Ping(context.Background()).Err() == nil
	}
	deadline := time.Now().Add(5 * time.Second)
	for answers() {
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s never stalled", s.Addr())
		}
	}
}
