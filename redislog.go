package fleetguard

import (
	"context"
	"fmt"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

var routeRedisLogOnce sync.Once

// routeRedisLog sends go-redis's own messages (one per failed dial, every
// reconcile pass during an outage) to Caddy's log at debug level. The
// reconciler already warns once per outage; stderr lines per pass would
// drown that. go-redis has one logger per process, so this also applies to
// other modules of the same Caddy build that use go-redis.
func routeRedisLog() {
	routeRedisLogOnce.Do(func() {
		redis.SetLogger(redisLogger{})
	})
}

type redisLogger struct{}

func (redisLogger) Printf(_ context.Context, format string, v ...any) {
	caddy.Log().Named("fleetguard.redis").Debug(fmt.Sprintf(format, v...))
}
