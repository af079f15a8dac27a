package redistest

import (
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Cluster is a Redis Cluster of three primaries (no replicas) owned by a test.
type Cluster struct {
	Nodes []*Server
}

// StartCluster starts three cluster-enabled redis-server processes, joins
// them into one cluster that covers every slot, and waits until it serves.
// Like Start, a missing redis-server or redis-cli fails the test.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	c, err := LaunchCluster(t.TempDir())
	if err != nil {
		t.Fatalf("redistest: %v", err)
	}
	t.Cleanup(c.Stop)
	return c
}

// LaunchCluster is StartCluster for a program that is not a test; dir holds
// the nodes' cluster files and the caller stops the cluster.
func LaunchCluster(dir string) (*Cluster, error) {
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		return nil, fmt.Errorf("redis-cli is not on PATH; install it with: %s (or run `make test`, which does)", InstallHint)
	}
	c := &Cluster{}
	for i := 0; i < 3; i++ {
		port, err := clusterPort()
		if err == nil {
			var n *Server
			n, err = launchNode(port,
				"--cluster-enabled", "yes",
				"--cluster-config-file", fmt.Sprintf("%s/nodes-%d.conf", dir, i),
				"--cluster-node-timeout", "2000",
			)
			if n != nil {
				c.Nodes = append(c.Nodes, n)
			}
		}
		if err != nil {
			c.Stop()
			return nil, err
		}
	}
	args := append(c.Addrs(), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, append([]string{"--cluster", "create"}, args...)...).CombinedOutput(); err != nil {
		c.Stop()
		return nil, fmt.Errorf("creating the cluster: %v\n%s", err, out)
	}
	deadline := time.Now().Add(15 * time.Second)
	for _, n := range c.Nodes {
		for {
			out, _ := exec.Command(cli, "-p", strconv.Itoa(n.port), "cluster", "info").Output()
			if strings.Contains(string(out), "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				c.Stop()
				return nil, fmt.Errorf("cluster not ready on %s: %s", n.Addr(), out)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return c, nil
}

// Stop stops every node.
func (c *Cluster) Stop() {
	for _, n := range c.Nodes {
		n.Stop()
	}
}

// Addrs are the host:port of every node.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// URL is a go-redis cluster URL naming every node
// (redis://first?addr=second&addr=third).
func (c *Cluster) URL() string {
	addrs := c.Addrs()
	u := "redis://" + addrs[0]
	for i, a := range addrs[1:] {
		sep := "&"
		if i == 0 {
			sep = "?"
		}
		u += sep + "addr=" + a
	}
	return u
}

// clusterPort finds a port whose cluster bus port (port + 10000) is free too.
func clusterPort() (int, error) {
	for attempt := 0; attempt < 100; attempt++ {
		p, err := freePort()
		if err != nil {
			return 0, err
		}
		if p+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+10000))
		if err != nil {
			continue
		}
		l.Close()
		return p, nil
	}
	return 0, fmt.Errorf("no port pair free for a cluster node")
}

// Client is a cluster client for a test, closed at its cleanup, that never
// retries a command by itself.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.Addrs(), DialTimeout: 500 * time.Millisecond, MaxRetries: -1})
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}
