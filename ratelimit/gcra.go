package ratelimit

// gcra is the outcome of the generic cell rate algorithm for one request.
type gcra struct {
	allowed    bool
	newTAT     int64 // theoretical arrival time to store if the request is admitted
	remaining  int64 // requests that would still fit right now after this one
	retryAfter int64 // nanoseconds until this request would fit, when denied
}

// gcraCheck decides one request at now against a key whose theoretical arrival
// time is tat. It changes nothing; the caller stores newTAT on commit.
func gcraCheck(tat, now int64, l *Limit) gcra {
	if tat < now {
		tat = now
	}
	newTAT := tat + l.emission
	ahead := newTAT - now
	if ahead > l.tolerance {
		return gcra{newTAT: newTAT, retryAfter: ahead - l.tolerance}
	}
	return gcra{allowed: true, newTAT: newTAT, remaining: (l.tolerance - ahead) / l.emission}
}

// gcraRefill is how long after now, when a key's theoretical arrival time is
// tat and remaining more requests fit, until one more fits: at most one
// emission interval.
func gcraRefill(tat, now, remaining int64, l *Limit) int64 {
	return max(tat-now+(remaining+1)*l.emission-l.tolerance, 0)
}
