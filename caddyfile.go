package fleetguard

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("fleetguard", parseGlobalOption)
	httpcaddyfile.RegisterHandlerDirective("fleetlimit", parseFleetLimit)
	httpcaddyfile.RegisterDirectiveOrder("fleetlimit", httpcaddyfile.Before, "basic_auth")
}

var (
	_ caddyfile.Unmarshaler = (*App)(nil)
	_ caddyfile.Unmarshaler = (*FleetLimit)(nil)
)

// parseGlobalOption parses the `fleetguard` global option into the app.
func parseGlobalOption(d *caddyfile.Dispenser, _ any) (any, error) {
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "fleetguard", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from Caddyfile tokens:
//
//	fleetguard {
//		redis         <url>
//		prefix        <prefix>
//		sync_interval <duration>
//	}
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "redis":
			if !d.AllArgs(&a.Redis) {
				return d.ArgErr()
			}
		case "prefix":
			if !d.AllArgs(&a.Prefix) {
				return d.ArgErr()
			}
		case "sync_interval":
			dur, err := parseDurationArg(d)
			if err != nil {
				return err
			}
			a.SyncInterval = dur
		default:
			return d.Errf("fleetguard: unknown option %q (want redis, prefix or sync_interval)", d.Val())
		}
	}
	return nil
}

func parseFleetLimit(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	fl := new(FleetLimit)
	if err := fl.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return fl, nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	fleetlimit {
//		zone <name> {
//			key      <placeholders>
//			events   <n>
//			window   <duration>
//			burst    <n>
//			max_keys <n>
//		}
//		dry_run
//	}
func (h *FleetLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "zone":
			var name string
			if !d.Args(&name) {
				return d.Errf("fleetlimit: zone needs a name")
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			if _, dup := h.Zones[name]; dup {
				return d.Errf("fleetlimit: zone %q is defined twice", name)
			}
			z, err := parseZone(d, name)
			if err != nil {
				return err
			}
			if h.Zones == nil {
				h.Zones = make(map[string]*ZoneConfig)
			}
			h.Zones[name] = z
		case "dry_run":
			if d.NextArg() {
				return d.ArgErr()
			}
			h.DryRun = true
		default:
			return d.Errf("fleetlimit: unknown subdirective %q (want zone or dry_run)", d.Val())
		}
	}
	if len(h.Zones) == 0 {
		return d.Err("fleetlimit: at least one zone is required")
	}
	return nil
}

func parseZone(d *caddyfile.Dispenser, name string) (*ZoneConfig, error) {
	z := new(ZoneConfig)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		field := d.Val()
		switch field {
		case "key":
			if !d.AllArgs(&z.Key) {
				return nil, d.Errf("fleetlimit: zone %q: key takes one value", name)
			}
		case "events", "burst", "max_keys":
			n, err := parseIntArg(d)
			if err != nil {
				return nil, d.Errf("fleetlimit: zone %q: %s: %v", name, field, err)
			}
			switch field {
			case "events":
				z.Events = n
			case "burst":
				z.Burst = n
			default:
				z.MaxKeys = n
			}
		case "window":
			dur, err := parseDurationArg(d)
			if err != nil {
				return nil, d.Errf("fleetlimit: zone %q: window: %v", name, err)
			}
			z.Window = dur
		default:
			return nil, d.Errf("fleetlimit: zone %q: unknown subdirective %q (want key, events, window, burst or max_keys)", name, field)
		}
	}
	if err := z.validate(name); err != nil {
		return nil, d.Err(err.Error())
	}
	return z, nil
}

func parseIntArg(d *caddyfile.Dispenser) (int64, error) {
	var s string
	if !d.AllArgs(&s) {
		return 0, d.ArgErr()
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, d.Errf("%q is not an integer", s)
	}
	return n, nil
}

func parseDurationArg(d *caddyfile.Dispenser) (caddy.Duration, error) {
	var s string
	if !d.AllArgs(&s) {
		return 0, d.ArgErr()
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, d.Errf("%q is not a duration: %v", s, err)
	}
	return caddy.Duration(dur), nil
}
