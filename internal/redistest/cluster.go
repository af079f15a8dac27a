package redistest

import (
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
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
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		t.Fatalf("redis-cli is not on PATH; install it with: %s (or run `make test`, which does)", InstallHint)
	}
	dir := t.TempDir()
	c := &Cluster{}
	for i := 0; i < 3; i++ {
		c.Nodes = append(c.Nodes, startNode(t, clusterPort(t),
			"--cluster-enabled", "yes",
			"--cluster-config-file", fmt.Sprintf("%s/nodes-%d.conf", dir, i),
			"--cluster-node-timeout", "2000",
		))
	}
	args := append(c.Addrs(), "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, append([]string{"--cluster", "create"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("redistest: creating the cluster: %v\n%s", err, out)
	}
	deadline := time.Now().Add(15 * time.Second)
	for _, n := range c.Nodes {
		for {
			out, _ := exec.Command(cli, "-p", strconv.Itoa(n.port), "cluster", "info").Output()
			if strings.Contains(string(out), "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("redistest: cluster not ready on %s: %s", n.Addr(), out)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return c
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
func clusterPort(t testing.TB) int {
	t.Helper()
	for attempt := 0; attempt < 100; attempt++ {
		p := freePort(t)
		if p+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+10000))
		if err != nil {
			continue
		}
		l.Close()
		return p
	}
	t.Fatal("redistest: no port pair free for a cluster node")
	return 0
}
