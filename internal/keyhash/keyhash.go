// Package keyhash turns user key material (API keys, header values) into a
// fixed 128-bit digest that is safe to put in store keys, logs and metrics.
//
// The digest names Redis keys shared by a whole fleet, so it must be the same on
// every instance and every release: it is unseeded XXH3-128, never a
// per-process seeded hash. It is not a password hash; it only keeps raw secrets
// out of places that are read by people and by other systems.
package keyhash

import (
	"encoding/hex"

	"github.com/zeebo/xxh3"
)

// Hash is the 128-bit digest of a key.
type Hash struct{ Hi, Lo uint64 }

// Of returns the digest of s. It does not allocate.
func Of(s string) Hash {
	h := xxh3.HashString128(s)
	return Hash{Hi: h.Hi, Lo: h.Lo}
}

// OfBytes returns the digest of b, the same as Of(string(b)), without the
// conversion. It does not allocate.
func OfBytes(b []byte) Hash {
	h := xxh3.Hash128(b)
	return Hash{Hi: h.Hi, Lo: h.Lo}
}

// String renders the digest as 32 lowercase hex digits.
func (h Hash) String() string {
	var b [16]byte
	for i := 0; i < 8; i++ {
		b[i] = byte(h.Hi >> (56 - 8*i))
		b[8+i] = byte(h.Lo >> (56 - 8*i))
	}
	return hex.EncodeToString(b[:])
}

// Parse reads a digest rendered by String.
func Parse(s string) (Hash, bool) {
	var b [16]byte
	if len(s) != 32 {
		return Hash{}, false
	}
	if _, err := hex.Decode(b[:], []byte(s)); err != nil {
		return Hash{}, false
	}
	var h Hash
	for i := 0; i < 8; i++ {
		h.Hi = h.Hi<<8 | uint64(b[i])
		h.Lo = h.Lo<<8 | uint64(b[8+i])
	}
	return h, true
}
