// Package benchkit holds what the bench commands that run a real Caddy
// share: a scratch folder, a Caddy built from this checkout, free ports,
// and a main that stops on a signal.
package benchkit

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
)

// Main runs run with a context that ends on SIGINT or SIGTERM, logging
// with prefix, and exits 1 with its error.
func Main(prefix string, run func(context.Context) error) {
	log.SetFlags(log.Ltime)
	log.SetPrefix(prefix + ": ")
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

// Scratch makes a scratch folder named for prefix. Its cleanup removes it,
// unless the environment variable keep is set, in which case it is logged
// and kept (with Caddy's logs in it).
func Scratch(prefix, keep string) (dir string, cleanup func(), err error) {
	if dir, err = os.MkdirTemp("", prefix+"-"); err != nil {
		return "", nil, err
	}
	if os.Getenv(keep) != "" {
		log.Printf("keeping %s", dir)
		return dir, func() {}, nil
	}
	return dir, func() { os.RemoveAll(dir) }, nil
}

// Workspace is Scratch and Caddy together, as every bench that runs Caddy
// processes starts: the scratch folder, its cleanup (which removes the
// folder unless keep is set), and the Caddy to run.
func Workspace(ctx context.Context, prefix, keep, caddyBin string) (dir, bin string, cleanup func(), err error) {
	if dir, cleanup, err = Scratch(prefix, keep); err != nil {
		return "", "", nil, err
	}
	if bin, err = Caddy(ctx, caddyBin, dir); err != nil {
		cleanup()
		return "", "", nil, err
	}
	return dir, bin, cleanup, nil
}

// Caddy is bin when it is set, else a Caddy built from this checkout's
// cmd/caddy into dir.
func Caddy(ctx context.Context, bin, dir string) (string, error) {
	if bin != "" {
		return bin, nil
	}
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	bin = filepath.Join(dir, "caddy")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/caddy")
	build.Dir, build.Stdout, build.Stderr = root, os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return "", fmt.Errorf("building caddy: %w", err)
	}
	return bin, nil
}

// ModuleRoot is the folder of this module's go.mod.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	gomod := strings.TrimSpace(string(out))
	if err != nil || gomod == "" || gomod == os.DevNull {
		return "", errors.New("run it inside the fleetguard module")
	}
	return filepath.Dir(gomod), nil
}

// FreePort is a TCP port on 127.0.0.1 that nothing listens on now.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
