package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// MasterName is the name the sentinels of a Sentinel setup monitor.
const MasterName = "mymaster"

// Sentinel timings: a master that does not answer for sentinelDownAfter is
// down, so a failover completes in about two seconds.
const (
	sentinelDownAfter       = 500 * time.Millisecond
	sentinelFailoverTimeout = 2 * time.Second
)

// Sentinel is a Redis Sentinel setup owned by a test: a master, one replica
// of it, and sentinels that monitor the master as MasterName and promote the
// replica when the master goes down.
type Sentinel struct {
	// Master and Replica are the data servers as started; after a failover
	// the replica is the master (see AwaitFailover).
	Master, Replica *Server
	Sentinels       []*Server
}

// StartSentinel starts a master, a replica and n sentinels (1 to 3; the
// quorum is a majority of them) in t.TempDir(), waits until the sentinels
// know the replica and each other, and stops everything at cleanup. Like
// Start, a missing redis-server fails the test.
func StartSentinel(t testing.TB, n int) *Sentinel {
	t.Helper()
	s, err := LaunchSentinel(t.TempDir(), n)
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// LaunchSentinel is StartSentinel for a program that is not a test; dir
// holds the sentinels' config files (a sentinel rewrites its own, so they
// must be writable) and the caller stops the setup.
func LaunchSentinel(dir string, n int) (*Sentinel, error) {
	if n < 1 || n > 3 {
		return nil, fmt.Errorf("sentinels: %d, want 1 to 3", n)
	}
	s := &Sentinel{}
	fail := func(err error) (*Sentinel, error) {
		s.Stop()
		return nil, err
	}
	// Persistence is off, but a full sync still writes an RDB file (the
	// master's, and the replica's copy of it): into dir, not the test's
	// working directory.
	var err error
	if s.Master, err = Launch("--dir", dir, "--repl-diskless-sync-delay", "0"); err != nil {
		return fail(err)
	}
	if s.Replica, err = Launch("--dir", dir, "--replicaof", "127.0.0.1", strconv.Itoa(s.Master.port)); err != nil {
		return fail(err)
	}
	if err := waitReplicaLinked(s.Replica, 10*time.Second); err != nil {
		return fail(err)
	}

	// Each sentinel is told the replica and the other sentinels up front
	// (known-replica, known-sentinel with fixed IDs): discovering them takes
	// a sentinel up to ten seconds, and a failover needs them.
	ports, ids := make([]int, n), make([]string, n)
	for i := range ports {
		if ports[i], err = freePort(); err != nil {
			return fail(err)
		}
		if ids[i], err = sentinelID(); err != nil {
			return fail(err)
		}
	}
	quorum := n/2 + 1
	for i := range ports {
		path, err := s.writeConf(dir, i, ports, ids, quorum)
		if err != nil {
			return fail(err)
		}
		bin, err := redisServer()
		if err != nil {
			return fail(err)
		}
		node := &Server{bin: bin, port: ports[i], conf: path, extra: []string{"--sentinel"}}
		if err := node.start(); err != nil {
			return fail(fmt.Errorf("sentinel %d: %w", i, err))
		}
		s.Sentinels = append(s.Sentinels, node)
	}
	if err := s.waitReady(10 * time.Second); err != nil {
		return fail(err)
	}
	return s, nil
}

// writeConf writes the config of sentinel i of ports (ids are their fixed
// IDs) into dir and returns its path.
func (s *Sentinel) writeConf(dir string, i int, ports []int, ids []string, quorum int) (string, error) {
	var conf strings.Builder
	fmt.Fprintf(&conf, "dir %s\n", dir)
	fmt.Fprintf(&conf, "sentinel myid %s\n", ids[i])
	fmt.Fprintf(&conf, "sentinel monitor %s 127.0.0.1 %d %d\n", MasterName, s.Master.port, quorum)
	fmt.Fprintf(&conf, "sentinel down-after-milliseconds %s %d\n", MasterName, sentinelDownAfter.Milliseconds())
	fmt.Fprintf(&conf, "sentinel failover-timeout %s %d\n", MasterName, sentinelFailoverTimeout.Milliseconds())
	fmt.Fprintf(&conf, "sentinel known-replica %s 127.0.0.1 %d\n", MasterName, s.Replica.port)
	for j := range ports {
		if j != i {
			fmt.Fprintf(&conf, "sentinel known-sentinel %s 127.0.0.1 %d %s\n", MasterName, ports[j], ids[j])
		}
	}
	path := filepath.Join(dir, fmt.Sprintf("sentinel-%d.conf", i))
	if err := os.WriteFile(path, []byte(conf.String()), 0o644); err != nil {
		return "", fmt.Errorf("writing %s: %w", path, err)
	}
	return path, nil
}

// Stop stops every process of the setup.
func (s *Sentinel) Stop() {
	for _, n := range s.Sentinels {
		n.Stop()
	}
	for _, n := range []*Server{s.Master, s.Replica} {
		if n != nil {
			n.Stop()
		}
	}
}

// Addrs are the sentinels' host:port.
func (s *Sentinel) Addrs() []string {
	addrs := make([]string, len(s.Sentinels))
	for i, n := range s.Sentinels {
		addrs[i] = n.Addr()
	}
	return addrs
}

// URL is a go-redis failover URL naming every sentinel and the master:
// redis://first?addr=second&addr=third&master_name=mymaster.
func (s *Sentinel) URL() string {
	addrs := s.Addrs()
	u := "redis://" + addrs[0] + "?"
	for _, a := range addrs[1:] {
		u += "addr=" + a + "&"
	}
	return u + "master_name=" + MasterName
}

// Client is a failover client for a test, closed at its cleanup, with the
// plugin's settings that matter to a fault test: short timeouts that honour
// the context, no retries by the client, one dial attempt.
func (s *Sentinel) Client(t testing.TB) *redis.Client {
	t.Helper()
	c := redis.NewFailoverClient(&redis.FailoverOptions{MasterName: MasterName, SentinelAddrs: s.Addrs(),
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 300 * time.Millisecond, WriteTimeout: 300 * time.Millisecond,
		MaxRetries: -1, DialerRetries: 1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// MasterAddr is the master's host:port as the sentinels report it now: the
// answer of every running sentinel, or an error if they disagree.
func (s *Sentinel) MasterAddr(ctx context.Context) (string, error) {
	var addr string
	for _, n := range s.Sentinels {
		if !n.running() {
			continue
		}
		sc := redis.NewSentinelClient(&redis.Options{Addr: n.Addr(), DialTimeout: time.Second, MaxRetries: -1})
		got, err := sc.GetMasterAddrByName(ctx, MasterName).Result()
		_ = sc.Close()
		if err != nil {
			return "", fmt.Errorf("sentinel %s: %w", n.Addr(), err)
		}
		a := got[0] + ":" + got[1]
		if addr != "" && a != addr {
			return "", fmt.Errorf("sentinels disagree: %s and %s", addr, a)
		}
		addr = a
	}
	if addr == "" {
		return "", errors.New("no sentinel is running")
	}
	return addr, nil
}

// AwaitFailover waits until every running sentinel names a master other
// than from and that server answers as a master, and returns it.
func (s *Sentinel) AwaitFailover(from string, timeout time.Duration) (*Server, error) {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		addr, err := s.MasterAddr(ctx)
		if err == nil && addr != from {
			if srv := s.server(addr); srv == nil {
				err = fmt.Errorf("the sentinels name %s, which is not in the setup", addr)
			} else if err = isMaster(ctx, srv); err == nil {
				cancel()
				return srv, nil
			}
		} else if err == nil {
			err = fmt.Errorf("the sentinels still name %s", addr)
		}
		cancel()
		last = err
		time.Sleep(50 * time.Millisecond)
	}
	return nil, fmt.Errorf("no failover from %s within %s: %v", from, timeout, last)
}

func (s *Sentinel) server(addr string) *Server {
	for _, n := range []*Server{s.Master, s.Replica} {
		if n.Addr() == addr {
			return n
		}
	}
	return nil
}

// waitReady waits until every sentinel monitors a master that is up and
// knows the replica and the other sentinels.
func (s *Sentinel) waitReady(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, n := range s.Sentinels {
		sc := redis.NewSentinelClient(&redis.Options{Addr: n.Addr(), DialTimeout: time.Second, MaxRetries: -1})
		var last string
		for {
			m, err := sc.Master(context.Background(), MasterName).Result()
			if err == nil && m["flags"] == "master" && m["num-slaves"] == "1" && m["num-other-sentinels"] == strconv.Itoa(len(s.Sentinels)-1) {
				break
			}
			last = fmt.Sprint(m, err)
			if time.Now().After(deadline) {
				_ = sc.Close()
				return fmt.Errorf("sentinel %s not ready: %s", n.Addr(), last)
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = sc.Close()
	}
	return nil
}

// waitReplicaLinked waits until the replica has synced with its master.
func waitReplicaLinked(r *Server, timeout time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: r.Addr(), DialTimeout: time.Second, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(timeout)
	for {
		info, err := c.Info(context.Background(), "replication").Result()
		if err == nil && strings.Contains(info, "master_link_status:up") {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replica %s never linked to its master: %q %v", r.Addr(), info, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func isMaster(ctx context.Context, srv *Server) error {
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), DialTimeout: time.Second, MaxRetries: -1})
	defer c.Close()
	info, err := c.Info(ctx, "replication").Result()
	if err != nil {
		return err
	}
	if !strings.Contains(info, "role:master") {
		return fmt.Errorf("%s is not a master yet", srv.Addr())
	}
	return nil
}

// sentinelID is a random sentinel run ID (40 hex digits).
func sentinelID() (string, error) {
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}
