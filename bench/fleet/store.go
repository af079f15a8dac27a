package main

import (
	"context"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/redistest"
)

// backend is the Redis the instances share.
type backend struct {
	srv     *redistest.Server
	cluster *redistest.Cluster
	dir     string
	// stats holds one connection per node for INFO, opened before the first
	// reading so that its handshake never falls inside a measured interval.
	stats []*redis.Client
}

func newBackend(cluster bool) (*backend, error) {
	b := &backend{}
	if !cluster {
		srv, err := redistest.Launch()
		if err != nil {
			return nil, err
		}
		b.srv = srv
	} else {
		dir, err := os.MkdirTemp("", "fleet-cluster")
		if err != nil {
			return nil, err
		}
		c, err := redistest.LaunchCluster(dir)
		b.cluster, b.dir = c, dir
		if err != nil {
			b.stop()
			return nil, err
		}
	}
	for _, a := range b.addrs() {
		b.stats = append(b.stats, redis.NewClient(&redis.Options{Addr: a, PoolSize: 1}))
	}
	if _, err := b.commandStats(); err != nil {
		b.stop()
		return nil, err
	}
	return b, nil
}

func (b *backend) addrs() []string {
	if b.cluster != nil {
		return b.cluster.Addrs()
	}
	return []string{b.srv.Addr()}
}

func (b *backend) stop() {
	for _, c := range b.stats {
		_ = c.Close()
	}
	if b.srv != nil {
		b.srv.Stop()
	}
	if b.cluster != nil {
		b.cluster.Stop()
		_ = os.RemoveAll(b.dir)
	}
}

// client is what one instance of the fleet would open: the plugin's timeouts,
// no retries by the client.
func (b *backend) client() redis.UniversalClient {
	const timeout = 500 * time.Millisecond
	if b.cluster != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: b.cluster.Addrs(), DialTimeout: timeout,
			ReadTimeout: timeout, WriteTimeout: timeout, MaxRetries: -1, DialerRetries: 1})
	}
	return redis.NewClient(&redis.Options{Addr: b.srv.Addr(), DialTimeout: timeout,
		ReadTimeout: timeout, WriteTimeout: timeout, MaxRetries: -1, DialerRetries: 1})
}

// load is the commands Redis has run since it started, over every node.
type load struct {
	all     int64 // every command, the commands scripts call included
	scripts int64 // script calls (EVAL, EVALSHA and their read-only forms)
}

// commandStats reads INFO commandstats on every node. The bench's own
// commands are left out: INFO itself, and the handshake of the stats
// connections, which precedes every reading.
func (b *backend) commandStats() (load, error) {
	var l load
	for _, c := range b.stats {
		info, err := c.Info(context.Background(), "commandstats").Result()
		if err != nil {
			return load{}, err
		}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":")
			if !ok || !strings.HasPrefix(name, "cmdstat_") || name == "cmdstat_info" {
				continue
			}
			calls, _, _ := strings.Cut(strings.TrimPrefix(rest, "calls="), ",")
			n, _ := strconv.ParseInt(calls, 10, 64)
			l.all += n
			switch name {
			case "cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro":
				l.scripts += n
			}
		}
	}
	return l, nil
}
