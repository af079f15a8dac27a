package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	lua "github.com/yuin/gopher-lua"
	"github.com/yuin/gopher-lua/parse"
)

// scriptStore is a SlotStore for tests that runs the store's own scripts,
// lease.lua and slots.lua, in process (gopher-lua is Lua 5.1, as Redis's)
// on hashes kept in memory: a fleet of engines in one test process, on a
// simulated clock, with no second implementation of what the store does.
// It answers the few commands the scripts call, as Redis does.
type scriptStore struct {
	mu           sync.Mutex
	vm           *lua.LState
	lease, slots *lua.LFunction
	keys         map[string]*scriptHash
}

type scriptHash struct {
	fields  map[string]string
	expires int64 // Unix ms; 0: none
}

var _ SlotStore = (*scriptStore)(nil)

// compiled holds the scripts compiled once for every store of the run.
var compiled = sync.OnceValues(func() ([2]*lua.FunctionProto, error) {
	// gopher-lua keeps an integer key below MaxArrayIndex in a table's
	// array part, grown to it: the scripts' tables keyed by time slot or
	// life (sparse numbers in the millions) would allocate that many
	// entries a call. Redis's Lua hashes them; so do we, past any array
	// the scripts build.
	lua.MaxArrayIndex = 1 << 20
	var protos [2]*lua.FunctionProto
	for i, src := range []string{leaseLua, slotsLua} {
		chunk, err := parse.Parse(strings.NewReader(src), "script")
		if err != nil {
			return protos, err
		}
		if protos[i], err = lua.Compile(chunk, "script"); err != nil {
			return protos, err
		}
	}
	return protos, nil
})

func newScriptStore(t testing.TB) *scriptStore {
	t.Helper()
	protos, err := compiled()
	if err != nil {
		t.Fatal(err)
	}
	s := &scriptStore{vm: lua.NewState(), keys: make(map[string]*scriptHash)}
	t.Cleanup(s.vm.Close)
	s.lease, s.slots = s.vm.NewFunctionFromProto(protos[0]), s.vm.NewFunctionFromProto(protos[1])
	redisTable := s.vm.NewTable()
	s.vm.SetField(redisTable, "call", s.vm.NewFunction(s.call))
	s.vm.SetGlobal("redis", redisTable)
	return s
}

// Lease implements SlotStore.
func (s *scriptStore) Lease(_ context.Context, calls []Lease, replies []LeaseReply) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var first error
	for i := range calls {
		res, err := s.run(s.lease, []string{calls[i].Key}, leaseArgs(&calls[i]))
		if err != nil {
			replies[i] = LeaseReply{Err: fmt.Errorf("leasing %s: %w", calls[i].Key, err)}
		} else {
			replies[i] = parseLease(calls[i].Key, res)
		}
		if first == nil {
			first = replies[i].Err
		}
	}
	return first
}

// Beat implements SlotStore.
func (s *scriptStore) Beat(_ context.Context, key, hotKey string, b Beat) (SlotTable, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	res, err := s.run(s.slots, []string{key, hotKey}, beatArgs(&b))
	if err != nil {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: %w", err)
	}
	vals, ok := res.([]any)
	if !ok {
		return SlotTable{}, fmt.Errorf("fleet heartbeat: unexpected reply %v", res)
	}
	return parseSlotTable(vals)
}

// run calls a script with KEYS and ARGV as Redis gives them (strings) and
// converts its reply as Redis does.
func (s *scriptStore) run(script *lua.LFunction, keys []string, args []any) (any, error) {
	vm := s.vm
	kt, at := vm.NewTable(), vm.NewTable()
	for _, k := range keys {
		kt.Append(lua.LString(k))
	}
	for _, a := range args {
		at.Append(lua.LString(fmt.Sprint(a)))
	}
	vm.SetGlobal("KEYS", kt)
	vm.SetGlobal("ARGV", at)
	if err := vm.CallByParam(lua.P{Fn: script, NRet: 1, Protect: true}); err != nil {
		return nil, err
	}
	ret := vm.Get(-1)
	vm.Pop(1)
	return fromLua(ret), nil
}

// fromLua converts a script's reply as Redis does: a number to an integer
// (truncated), a table to an array up to its first nil, true to 1, false
// and nil to nil.
func fromLua(v lua.LValue) any {
	switch v := v.(type) {
	case lua.LNumber:
		return int64(v)
	case lua.LString:
		return string(v)
	case lua.LBool:
		if v {
			return int64(1)
		}
	case *lua.LTable:
		var out []any
		for i := 1; v.RawGetInt(i) != lua.LNil; i++ {
			out = append(out, fromLua(v.RawGetInt(i)))
		}
		return out
	}
	return nil
}

// call is redis.call for the commands the scripts send.
func (s *scriptStore) call(vm *lua.LState) int {
	args := make([]string, vm.GetTop())
	for i := range args {
		args[i] = lua.LVAsString(vm.Get(i + 1))
	}
	n, err := s.command(args)
	if err != nil {
		vm.RaiseError("%v", err)
		return 0
	}
	switch n := n.(type) {
	case int64:
		vm.Push(lua.LNumber(n))
	case []string:
		t := vm.NewTable()
		for _, f := range n {
			t.Append(lua.LString(f))
		}
		vm.Push(t)
	}
	return 1
}

func (s *scriptStore) command(args []string) (any, error) {
	if len(args) < 2 {
		return nil, errors.New("wrong number of arguments")
	}
	h, now := s.hash(args[1]), time.Now().UnixMilli()
	switch cmd, rest := args[0], args[2:]; {
	case cmd == "HGETALL":
		var out []string
		for f, v := range h.fields {
			out = append(out, f, v)
		}
		return out, nil
	case cmd == "HSET" && len(rest) >= 2 && len(rest)%2 == 0:
		var added int64
		for i := 0; i < len(rest); i += 2 {
			if _, ok := h.fields[rest[i]]; !ok {
				added++
			}
			h.fields[rest[i]] = rest[i+1]
		}
		return added, nil
	case cmd == "HDEL" && len(rest) >= 1:
		var gone int64
		for _, f := range rest {
			if _, ok := h.fields[f]; ok {
				gone++
				delete(h.fields, f)
			}
		}
		return gone, nil
	case cmd == "PEXPIRE" && len(rest) == 1:
		ms, err := strconv.ParseInt(rest[0], 10, 64)
		if err != nil || len(h.fields) == 0 {
			return int64(0), err
		}
		if ms <= 0 {
			clear(h.fields) // as Redis deletes the key
		}
		h.expires = now + ms
		return int64(1), nil
	}
	return nil, fmt.Errorf("unknown command or arguments: %q", args)
}

// hash returns key's hash, made if absent; an expired one is dropped, as
// Redis drops it, and so is one with no field left.
func (s *scriptStore) hash(key string) *scriptHash {
	h := s.keys[key]
	if h != nil && (h.expires != 0 && h.expires <= time.Now().UnixMilli() || len(h.fields) == 0) {
		h = nil
	}
	if h == nil {
		h = &scriptHash{fields: make(map[string]string)}
		s.keys[key] = h
	}
	return h
}

// pttl is what PTTL answers for key: -2 when it does not exist.
func (s *scriptStore) pttl(key string) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := s.keys[key]
	if h == nil || len(h.fields) == 0 || h.expires != 0 && h.expires <= time.Now().UnixMilli() {
		return -2
	}
	if h.expires == 0 {
		return -1
	}
	return time.Duration(h.expires-time.Now().UnixMilli()) * time.Millisecond
}
