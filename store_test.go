package fleetguard

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// identityOf is the identity of the store an App's options name.
func identityOf(t *testing.T, a App) storeIdentity {
	t.Helper()
	id, _, err := a.configuredStore()
	if err != nil {
		t.Fatalf("configuredStore: %v", err)
	}
	return id
}

// The public form of each kind of store: the same for the status and the
// metrics, with TLS, database and prefix, never a user or a password (raw or
// hashed), however the identity is printed.
func TestStoreIdentityPublicForm(t *testing.T) {
	tests := []struct {
		name string
		app  App
		want string
	}{
		{"memory", App{}, "memory|fg"},
		{"redis", App{Redis: "redis://127.0.0.1:6379/0"}, "redis|127.0.0.1:6379|0|fg|plain"},
		{"redis, default port", App{Redis: "redis://cache.internal"}, "redis|cache.internal:6379|0|fg|plain"},
		{"redis with a user, a password, TLS and a database", App{Redis: "rediss://app:pw-one@10.0.0.5:6380/3"}, "redis|10.0.0.5:6380|3|fg|tls"},
		{"cluster, seeds sorted", App{RedisCluster: "redis://app:pw-one@10.0.0.2:7001?addr=10.0.0.1:7000"}, "cluster|10.0.0.1:7000,10.0.0.2:7001|0|fg|plain"},
		{"cluster with TLS", App{RedisCluster: "rediss://10.0.0.1:7000?addr=10.0.0.2:7001"}, "cluster|10.0.0.1:7000,10.0.0.2:7001|0|fg|tls"},
		{"sentinel, sentinels sorted", App{RedisSentinel: "redis://watcher:pw-two@127.0.0.1:26380/1?addr=127.0.0.1:26379&master_name=mymaster&username=app&password=pw-one"},
			"sentinel|mymaster@127.0.0.1:26379,127.0.0.1:26380|1|fg|plain"},
		{"sentinel with TLS", App{RedisSentinel: "rediss://127.0.0.1:26379?master_name=mymaster&db=2"}, "sentinel|mymaster@127.0.0.1:26379|2|fg|tls"},
	}
	secrets := []string{"app", "watcher", "pw-one", "pw-two", keyhash.Of("pw-one").String()[:16], keyhash.Of("pw-two").String()[:16]}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.app.Prefix = "fg"
			id := identityOf(t, tt.app)
			if got := id.name.String(); got != tt.want {
				t.Fatalf("public form %q, want %q", got, tt.want)
			}
			for _, printed := range []string{id.String(), fmt.Sprint(id), fmt.Sprintf("%+v", id)} {
				if printed != tt.want {
					t.Fatalf("the identity prints as %q, want its public form %q", printed, tt.want)
				}
				for _, secret := range secrets {
					if strings.Contains(printed, secret) {
						t.Fatalf("%q shows %q", printed, secret)
					}
				}
			}
		})
	}
}

// Two configs of one store that log in differently get two pool entries
// (two clients), shown under one public form; the same credentials share one.
func TestStoreIdentityCredentials(t *testing.T) {
	tests := []struct {
		name   string
		option func(url string) App
		a, b   string
	}{
		{"redis password", func(u string) App { return App{Redis: u} }, "redis://:pw-one@127.0.0.1:6379/0", "redis://:pw-two@127.0.0.1:6379/0"},
		{"redis user", func(u string) App { return App{Redis: u} }, "redis://app:pw@127.0.0.1:6379/0", "redis://ops:pw@127.0.0.1:6379/0"},
		{"redis password or none", func(u string) App { return App{Redis: u} }, "redis://:pw-one@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"},
		{"cluster password", func(u string) App { return App{RedisCluster: u} }, "redis://:pw-one@127.0.0.1:7000?addr=127.0.0.1:7001", "redis://:pw-two@127.0.0.1:7000?addr=127.0.0.1:7001"},
		{"sentinel master password", func(u string) App { return App{RedisSentinel: u} }, sentinelBase + "&password=pw-one", sentinelBase + "&password=pw-two"},
		{"sentinel master user", func(u string) App { return App{RedisSentinel: u} }, sentinelBase + "&username=app", sentinelBase + "&username=ops"},
		{"sentinel password", func(u string) App { return App{RedisSentinel: u} },
			"redis://:pw-one@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster", "redis://:pw-two@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster"},
		{"sentinel user", func(u string) App { return App{RedisSentinel: u} },
			"redis://app@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster", "redis://ops@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := identityOf(t, tt.option(tt.a)), identityOf(t, tt.option(tt.b))
			if a == b {
				t.Fatalf("%s and %s share a pool key: a reload that changes the login would keep the old client", tt.a, tt.b)
			}
			if a.String() != b.String() {
				t.Fatalf("public forms %q and %q, want one", a, b)
			}
			if again := identityOf(t, tt.option(tt.a)); again != a {
				t.Fatalf("the same URL twice gives two pool keys")
			}
		})
	}
}

const sentinelBase = "redis://127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster"

// The identity of a Sentinel store changes with every connection setting,
// never with the order of the sentinels.
func TestRedisSentinelIdentity(t *testing.T) {
	base := identityOf(t, App{RedisSentinel: sentinelBase, Prefix: "p"})
	tests := []struct {
		name, url, prefix string
		same              bool
	}{
		{"sentinels in another order", "redis://127.0.0.1:26380?addr=127.0.0.1:26379&master_name=mymaster", "p", true},
		{"another sentinel", "redis://127.0.0.1:26379?addr=127.0.0.1:26381&master_name=mymaster", "p", false},
		{"another master name", "redis://127.0.0.1:26379?addr=127.0.0.1:26380&master_name=other", "p", false},
		{"a master user", sentinelBase + "&username=app", "p", false},
		{"a master password", sentinelBase + "&password=s3cret-master", "p", false},
		{"another master password", sentinelBase + "&password=s3cret-other", "p", false},
		{"a sentinel user", "redis://watcher@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster", "p", false},
		{"a sentinel password", "redis://:s3cret-sentinel@127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster", "p", false},
		{"a database in the path", "redis://127.0.0.1:26379/2?addr=127.0.0.1:26380&master_name=mymaster", "p", false},
		{"a database parameter", sentinelBase + "&db=3", "p", false},
		{"TLS", "rediss://127.0.0.1:26379?addr=127.0.0.1:26380&master_name=mymaster", "p", false},
		{"another prefix", sentinelBase, "q", false},
	}
	seen := map[storeIdentity]string{base: "base"}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id := identityOf(t, App{RedisSentinel: tt.url, Prefix: tt.prefix})
			if (id == base) != tt.same {
				t.Fatalf("identity %v against the base %v: same = %v, want %v", id, base, id == base, tt.same)
			}
			if prev, dup := seen[id]; dup && !tt.same {
				t.Fatalf("identity %v is also that of %q", id, prev)
			}
			seen[id] = tt.name
		})
	}
}

// Every kind of client is built with the plugin's timeouts and no retries,
// whatever its URL says.
func TestStoreClientSettings(t *testing.T) {
	const url = "redis://127.0.0.1:1?max_retries=5&dial_timeout=10s&read_timeout=9s&write_timeout=8s"
	type settings struct {
		retries           bool // MaxRetries > 0: -1 (never retry) stays -1 or becomes 0
		dialAttempts      int
		dial, read, write time.Duration
		contextTimeout    bool
	}
	tests := []struct {
		name string
		app  App
		// of reads the settings the client was built with.
		of func(redis.UniversalClient) settings
	}{
		{"redis", App{Redis: url}, func(c redis.UniversalClient) settings {
			o := c.(*redis.Client).Options()
			return settings{o.MaxRetries > 0, o.DialerRetries, o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled}
		}},
		{"cluster", App{RedisCluster: url + "&addr=127.0.0.1:2"}, func(c redis.UniversalClient) settings {
			o := c.(*redis.ClusterClient).Options()
			return settings{o.MaxRetries > 0, o.DialerRetries, o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled}
		}},
		{"sentinel", App{RedisSentinel: url + "&master_name=m"}, func(c redis.UniversalClient) settings {
			o := c.(*redis.Client).Options()
			return settings{o.MaxRetries > 0, o.DialerRetries, o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.ContextTimeoutEnabled}
		}},
	}
	want := settings{false, redisDialAttempts, redisTimeout, redisTimeout, redisTimeout, true}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, connect, err := tt.app.configuredStore()
			if err != nil || connect == nil {
				t.Fatalf("configuredStore: %v", err)
			}
			c := connect()
			defer c.Close()
			if got := tt.of(c); got != want {
				t.Fatalf("client settings %+v, want the plugin's %+v, whatever the URL says", got, want)
			}
		})
	}
}

// The failover client verifies TLS against each host it dials.
func TestRedisSentinelURL(t *testing.T) {
	opts, err := parseSentinelURL("rediss://u:sp@127.0.0.1:26379/1?addr=127.0.0.1:26380&master_name=m&username=app&password=mp&max_retries=5")
	if err != nil {
		t.Fatal(err)
	}
	if opts.MasterName != "m" || len(opts.SentinelAddrs) != 2 || opts.DB != 1 ||
		opts.Username != "app" || opts.Password != "mp" || opts.SentinelUsername != "u" || opts.SentinelPassword != "sp" {
		t.Fatalf("parsed %+v", opts)
	}
	if opts.TLSConfig == nil || opts.TLSConfig.ServerName != "" {
		t.Fatalf("TLS %+v: want TLS with the server name left to each dial", opts.TLSConfig)
	}
}

// Bad store settings are refused, naming the field, without echoing a
// password.
func TestStoreOptionErrors(t *testing.T) {
	tests := []struct {
		name string
		app  App
		want string
	}{
		{"redis: not a URL", App{Redis: "127.0.0.1:6379"}, "fleetguard: redis: \"127.0.0.1:6379\" is not a redis:// or rediss:// URL"},
		{"redis: a bad database", App{Redis: "redis://:s3cret@127.0.0.1:6379/x"}, "fleetguard: redis: redis: invalid database number"},
		{"redis_cluster: another scheme", App{RedisCluster: "http://:s3cret@127.0.0.1:7000"}, "fleetguard: redis_cluster: \"http://:xxxxx@127.0.0.1:7000\" is not a redis:// or rediss:// URL"},
		{"no master name", App{RedisSentinel: "redis://:s3cret@127.0.0.1:26379?addr=127.0.0.1:26380&password=s3cret"}, "redis_sentinel: the URL parameter master_name is required"},
		{"not a URL", App{RedisSentinel: "127.0.0.1:26379"}, "redis_sentinel: \"127.0.0.1:26379\" is not a redis:// or rediss:// URL"},
		{"another scheme", App{RedisSentinel: "sentinel://:s3cret@127.0.0.1:26379?master_name=m&password=s3cret"}, "redis_sentinel:"},
		{"no host, password in the query", App{RedisSentinel: "redis://?master_name=m&password=s3cret"}, "redis_sentinel:"},
		{"replica_only", App{RedisSentinel: sentinelBase + "&replica_only=true"}, "replica_only, route_by_latency and route_randomly are not supported"},
		{"route_randomly", App{RedisSentinel: sentinelBase + "&route_randomly=true"}, "are not supported"},
		{"route_by_latency", App{RedisSentinel: sentinelBase + "&route_by_latency=true"}, "are not supported"},
		{"a parameter twice", App{RedisSentinel: sentinelBase + "&password=s3cret&password=s3cret2"}, "fleetguard: redis_sentinel: the URL parameter password is given 2 times"},
		{"master_name twice", App{RedisSentinel: sentinelBase + "&master_name=other"}, "master_name is given 2 times"},
		{"an unknown parameter", App{RedisSentinel: sentinelBase + "&password=s3cret&sentinel_password=s3cret"}, "redis_sentinel: redis: unexpected option: sentinel_password"},
		{"a bad database", App{RedisSentinel: "redis://:s3cret@127.0.0.1:26379/x?master_name=m"}, "redis_sentinel: redis: invalid database number"},
		{"a bad addr", App{RedisSentinel: sentinelBase + "&addr=nohost&password=s3cret"}, "redis_sentinel: redis: unable to parse addr param"},
		{"redis and redis_sentinel", App{Redis: "redis://127.0.0.1:1", RedisSentinel: sentinelBase}, "fleetguard: redis and redis_sentinel are both set; set one of redis, redis_cluster and redis_sentinel"},
		{"redis_cluster and redis_sentinel", App{RedisCluster: "redis://127.0.0.1:1", RedisSentinel: sentinelBase}, "redis_cluster and redis_sentinel are both set"},
		{"all three", App{Redis: "redis://127.0.0.1:1", RedisCluster: "redis://127.0.0.1:2", RedisSentinel: sentinelBase}, "redis, redis_cluster and redis_sentinel are all set"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := tt.app.configuredStore()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "s3cret") {
				t.Fatalf("error %q echoes a password", err)
			}
		})
	}
}
