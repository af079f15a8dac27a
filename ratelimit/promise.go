package ratelimit

import (
	"encoding/binary"
	"hash/fnv"
	"sync/atomic"
	"time"

	"github.com/fleetguard/fleetguard/internal/keyhash"
)

// Floor promises. What an instance admits of a key on its floor (or
// probation) share, it tells no one until the key gets busy, so once it is
// killed the others cannot know it, and they left its whole share of every
// key aside for a window: a key near its limit was denied in the window
// after a founder's kill -9. A promise bounds it per key. Each heartbeat
// carries a sketch of the most this instance has counted of each key on
// such shares within the last window (two rows of cells, each key raising
// one cell of each row; a key's bound is the smaller of its two). For a
// gone instance that sent one, the others leave aside each key's bound plus
// promiseHeadroom, not its share.
//
// The headroom is for the admits after the last heartbeat. An admit past
// it (past the bound plus headroom as last sent, and as being sent) is not
// refused: it queues the key to push what this instance admitted of it and
// sync from then on, an early pass later (earlySpacing), so the store
// counts what the others leave no room for. A kill -9 in between loses
// those admits, as it loses any admit not pushed yet (see shareAdmits).
//
// The bounds grow as keys are admitted: the request path raises the cells
// of the current generation (generations of a window / (promiseGens-1), so
// that those kept cover a window), and a heartbeat sends the largest of
// every generation's cell.
const (
	promiseRows  = 2
	promiseWidth = 512
	promiseGens  = 8
	// promiseSaturated is a cell's most: a bound that large bounds nothing
	// (the share does).
	promiseSaturated = 1<<16 - 1
)

// promiseHeadroom is how far past its bound a key of z with a limit of
// events may be admitted on a floor share before the next heartbeat sends a
// larger bound, without being pushed: what a fifth of the limit's rate
// admits in half a second, a heartbeat at the default sync interval (a
// hundredth of the limit of a 10 s window), and at least one. A key far
// below its limit rarely comes past it; a larger one left more aside for a
// killed instance (bench/churn, kill: the key at 90% of its limit was
// denied 15-20 times with a twentieth, 0-2 with a hundredth).
func promiseHeadroom(z *Zone, events int64) int64 {
	return max(events*int64(promiseHeadroomTime)/(z.slots.N*z.slots.Len), 1)
}

// promiseHeadroomTime is how long a fifth of a limit's rate takes to fill
// the headroom (see promiseHeadroom).
const promiseHeadroomTime = 100 * time.Millisecond

// promises is one sketch of bounds, and the keys it names as pushed (see
// promise_pushed.go). Its cells change atomically: the request path reads
// and raises them while a heartbeat folds them.
type promises struct {
	cells  [promiseRows * promiseWidth]atomic.Uint32
	pushed []uint64 // sorted; set before the promise is published
}

// promiseSketchBytes is the size of a promise's sketch as sent.
const promiseSketchBytes = 2 * promiseRows * promiseWidth

// promiseCells are the cells of h in z's keys: one in each row.
func (z *Zone) promiseCells(h keyhash.Hash) (int, int) {
	return int((h.Lo ^ z.promiseSeed) % promiseWidth), promiseWidth + int((h.Hi^z.promiseSeed)%promiseWidth)
}

// promiseSeedOf spreads each zone's keys over the cells its own way.
func promiseSeedOf(storeID, storeSuffix string) uint64 {
	f := fnv.New64a()
	f.Write([]byte(storeID))
	f.Write([]byte(storeSuffix))
	return f.Sum64()
}

func (p *promises) bound(i, j int) int64 {
	return int64(min(p.cells[i].Load(), p.cells[j].Load()))
}

func (p *promises) raise(i int, v uint32) {
	for {
		c := p.cells[i].Load()
		if c >= v || p.cells[i].CompareAndSwap(c, v) {
			return
		}
	}
}

// fold raises every cell of p to the cell of q.
func (p *promises) fold(q *promises) {
	for i := range p.cells {
		if v := q.cells[i].Load(); v > 0 {
			p.raise(i, v)
		}
	}
}

// lowest is a new sketch with the smaller of p's and q's cells (either may
// be nil: none).
func lowest(p, q *promises) *promises {
	if p == nil || q == nil {
		if p == nil {
			return q
		}
		return p
	}
	out := new(promises)
	for i := range out.cells {
		out.cells[i].Store(min(p.cells[i].Load(), q.cells[i].Load()))
	}
	return out
}

// encode is p as a heartbeat carries it: each cell in two bytes, little
// endian, saturated, then the keys it names, if any (a promise naming none
// reads the same to a version that knows no names).
func (p *promises) encode() []byte {
	b := make([]byte, promiseSketchBytes, promiseSketchBytes+8*len(p.pushed))
	for i := range p.cells {
		binary.LittleEndian.PutUint16(b[2*i:], uint16(min(p.cells[i].Load(), promiseSaturated)))
	}
	return appendPushed(b, p.pushed)
}

// sentPromise is a gone instance's promise as its record carries it: nil, or
// a sketch of another size (another version), bounds nothing.
type sentPromise []byte

func (s sentPromise) valid() bool {
	return len(s) >= promiseSketchBytes && (len(s)-promiseSketchBytes)%8 == 0
}

// bound is what s leaves aside for h of z with a share of sh: the bound and
// the headroom, at most the share; only the headroom once the admits the
// bound counts have left the window (past, see goneAside), or for a key it
// names as pushed.
func (s sentPromise) bound(z *Zone, h keyhash.Hash, sh, events int64, past bool) int64 {
	if !s.valid() {
		return sh
	}
	i, j := z.promiseCells(h)
	c := min(binary.LittleEndian.Uint16(s[2*i:]), binary.LittleEndian.Uint16(s[2*j:]))
	if c == promiseSaturated {
		return sh
	}
	if past || c > 0 && s.names(z, h) {
		c = 0
	}
	return min(sh, int64(c)+promiseHeadroom(z, events))
}

// promisedCap is how many of h's admits in the window this instance may
// hold on its floor share of floor without pushing them: what the promise
// it sent (and the one it is sending) allows. Before its first promise, the
// share.
func (e *Engine) promisedCap(z *Zone, h keyhash.Hash, floor, events int64) int64 {
	sent, sending := e.promised.Load(), e.promising.Load()
	if sent == nil && sending == nil {
		return floor
	}
	i, j := z.promiseCells(h)
	c := int64(promiseSaturated)
	if sent != nil {
		c = min(c, sent.bound(i, j))
	}
	if sending != nil {
		c = min(c, sending.bound(i, j))
	}
	if c >= promiseSaturated {
		return floor
	}
	return min(floor, c+promiseHeadroom(z, events))
}

// notePromised raises h's cells of the current generation to used, what
// this instance counts of h in the window with the admit it is deciding. It
// runs before the admit is decided: a heartbeat that folds the generations
// after the request read the promise it is sending finds it there.
func (e *Engine) notePromised(z *Zone, h keyhash.Hash, used int64) {
	g := e.promiseGen.Load()
	if g == nil {
		return
	}
	i, j := z.promiseCells(h)
	v := uint32(min(used, promiseSaturated))
	g.raise(i, v)
	g.raise(j, v)
}

// promiseGenerations are the sketches of the last window, the current one
// first. The heartbeat owns them (under heartbeatMu); the request path
// raises the current one (promiseGen).
type promiseGenerations struct {
	gens  [promiseGens]*promises
	start int64 // the current generation's start, Unix ns
}

// propose is the promise the next heartbeat sends: the largest of every
// generation's cell. It starts a new generation if the current one is due,
// and is published as being sent (promising) before its cells are folded a
// second time, for the raises made meanwhile. The caller holds heartbeatMu.
func (e *Engine) propose(now int64) *promises {
	pg := &e.promiseGens
	genLen := max((e.longestWindow()+promiseGens-2)/(promiseGens-1), 1)
	if pg.gens[0] == nil || now-pg.start >= genLen {
		copy(pg.gens[1:], pg.gens[:promiseGens-1])
		pg.gens[0], pg.start = new(promises), now
		e.promiseGen.Store(pg.gens[0])
	}
	p := new(promises)
	fold := func() {
		for _, g := range pg.gens {
			if g != nil {
				p.fold(g)
			}
		}
	}
	fold()
	p.pushed = e.pushedKeys(now)
	e.promising.Store(p)
	fold()
	return p
}

// promiseSent settles a promise once its heartbeat answered: sent, it is
// the promise; failed, the store holds it or the last one, so the smaller of
// the two cells binds.
func (e *Engine) promiseSent(p *promises, ok bool) {
	if ok {
		e.promised.Store(p)
	} else {
		e.promised.Store(lowest(e.promised.Load(), p))
	}
	e.promising.Store(nil)
}

// longestWindow is the longest window of the zones, in ns.
func (e *Engine) longestWindow() int64 {
	var w int64
	for _, z := range *e.zones.Load() {
		w = max(w, z.slots.N*z.slots.Len)
	}
	return w
}

// heldPromise is a gone member's promise, as of its record's end (until,
// Unix ms).
type heldPromise struct {
	until   int64
	promise sentPromise
}

// knownPromises names the gone members' promises this instance holds, for
// the store not to send again: a gone member's record (and promise) stays
// for a window, which may be hours, and is read at every heartbeat. The
// caller holds heartbeatMu.
func (e *Engine) knownPromises() []KnownPromise {
	if len(e.gonePromises) == 0 {
		return nil
	}
	known := make([]KnownPromise, 0, len(e.gonePromises))
	for m, h := range e.gonePromises {
		known = append(known, KnownPromise{Member: m, Until: h.until})
	}
	return known
}

// holdPromises fills in the promises of f the store did not send again
// (known: this instance holds them), and holds every gone member's promise
// for the next heartbeat. The caller holds heartbeatMu.
func (e *Engine) holdPromises(f *Fleet, nowMs int64) {
	held := make(map[int64]heldPromise)
	for i := range f.Members {
		r := &f.Members[i]
		if r.PromiseKnown {
			if h, ok := e.gonePromises[r.Member]; ok && h.until == r.Until {
				r.Promise = h.promise
			}
		}
		if r.Until <= nowMs && r.Promise != nil {
			held[r.Member] = heldPromise{until: r.Until, promise: r.Promise}
		}
	}
	e.gonePromises = held
}
