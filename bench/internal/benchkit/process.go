package benchkit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// Process is one Caddy of a bench's fleet, started, signalled and started
// again as the bench restarts it.
type Process struct {
	mu  sync.Mutex
	cmd *exec.Cmd // nil while it is down
}

// Start runs bin on config (a Caddyfile), its output appended to logPath and
// env added to its environment, and waits until port accepts connections.
func (p *Process) Start(ctx context.Context, bin, config, logPath string, port int, env ...string) error {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "run", "--config", config, "--adapter", "caddyfile")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		return err
	}
	p.mu.Lock()
	p.cmd = cmd
	p.mu.Unlock()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
			conn.Close()
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return errors.New("a site did not come up in 10 s")
		}
	}
}

// Stop signals the process, if it runs, and waits for it to end.
func (p *Process) Stop(sig syscall.Signal) {
	p.mu.Lock()
	cmd := p.cmd
	p.cmd = nil
	p.mu.Unlock()
	if cmd != nil {
		_ = cmd.Process.Signal(sig)
		_ = cmd.Wait()
	}
}
