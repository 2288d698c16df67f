package ui

import (
	"testing"
	"time"
)

// clock is a time a test moves by hand.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

// live reports whether id is a live session, opened by alice.
func live(ss *sessions, id string) bool {
	name, ok := ss.valid(id)
	return ok && name == "alice"
}

func TestSessionIdleAndLifetime(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Date(2026, 1, 2, 9, 0, 0, 0, time.UTC)}
	ss := newSessions(c.now)

	idle := ss.start("alice")
	c.t = c.t.Add(sessionIdle - time.Second)
	if !live(ss, idle) {
		t.Fatal("a session used within its idle time ended")
	}
	c.t = c.t.Add(sessionIdle)
	if live(ss, idle) {
		t.Fatal("a session idle for longer than sessionIdle is still valid")
	}

	// Used all the time, a session still ends sessionLifetime after its login.
	busy := ss.start("alice")
	end := c.t.Add(sessionLifetime)
	for c.t = c.t.Add(sessionIdle / 2); c.t.Before(end); c.t = c.t.Add(sessionIdle / 2) {
		if !live(ss, busy) {
			t.Fatalf("a session in use ended at %s, before its lifetime", c.t)
		}
	}
	if live(ss, busy) {
		t.Fatal("a session outlived sessionLifetime")
	}
	if live(ss, "") || live(ss, "nonsense") {
		t.Fatal("an id never given out is valid")
	}
}

func TestSessionsBounded(t *testing.T) {
	t.Parallel()
	c := &clock{t: time.Date(2026, 1, 2, 9, 0, 0, 0, time.UTC)}
	ss := newSessions(c.now)
	ids := make([]string, 0, maxSessions+1)
	seen := map[string]bool{}
	for range maxSessions + 1 {
		c.t = c.t.Add(time.Millisecond)
		id := ss.start("alice")
		if len(id) != 64 || seen[id] {
			t.Fatalf("session id %q: want 64 hex digits, new", id)
		}
		seen[id] = true
		ids = append(ids, id)
	}
	if n := len(ss.byID); n != maxSessions {
		t.Fatalf("%d sessions held, want at most %d", n, maxSessions)
	}
	if live(ss, ids[0]) {
		t.Fatal("the oldest session survived a login beyond the bound")
	}
	if !live(ss, ids[1]) || !live(ss, ids[maxSessions]) {
		t.Fatal("a session other than the oldest was ended")
	}
	ss.end(ids[1])
	if live(ss, ids[1]) {
		t.Fatal("an ended session is still valid")
	}
}
