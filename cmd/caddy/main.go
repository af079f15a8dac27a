// Command caddy is a Caddy build with the standard modules plus fleetguard.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/fleetguard/fleetguard"
)

func main() {
	caddycmd.Main()
}
