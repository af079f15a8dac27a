// Package fleetguard adapts the fleet rate limiter and the LLM budget engine to Caddy.
package fleetguard
