package cork_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/idemq/idemq/internal/cork"
)

// pair returns a held-capable client conn and the server side of a real
// loopback TCP connection.
func pair(t *testing.T) (*cork.Conn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept()
		accepted <- c
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s := <-accepted
	if s == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { _ = c.Close(); _ = s.Close() })
	return cork.New(c), s
}

// readWithin reads what arrives within d.
func readWithin(t *testing.T, s net.Conn, d time.Duration) []byte {
	t.Helper()
	_ = s.SetReadDeadline(time.Now().Add(d))
	var out []byte
	buf := make([]byte, 64<<10)
	for {
		n, err := s.Read(buf)
		out = append(out, buf[:n]...)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				return out
			}
			if errors.Is(err, io.EOF) {
				return out
			}
			t.Fatal(err)
		}
	}
}

func TestHeldWritesWaitForRelease(t *testing.T) {
	c, s := pair(t)
	if _, err := c.Write([]byte("a")); err != nil {
		t.Fatal(err)
	}
	if got := readWithin(t, s, time.Second); string(got) != "a" {
		t.Fatalf("before hold got %q, want a", got)
	}
	c.Hold()
	for _, p := range []string{"b", "c", "d"} {
		if n, err := c.Write([]byte(p)); n != 1 || err != nil {
			t.Fatalf("held write = %d, %v", n, err)
		}
	}
	if got := readWithin(t, s, 200*time.Millisecond); len(got) != 0 {
		t.Fatalf("held writes arrived before the release: %q", got)
	}
	if err := c.Release(); err != nil {
		t.Fatal(err)
	}
	if got := readWithin(t, s, time.Second); string(got) != "bcd" {
		t.Fatalf("after release got %q, want bcd", got)
	}
	// Released: writes go out at once again.
	if _, err := c.Write([]byte("e")); err != nil {
		t.Fatal(err)
	}
	if got := readWithin(t, s, time.Second); string(got) != "e" {
		t.Fatalf("after release got %q, want e", got)
	}
}

// A write that would hold more than MaxHeld sends what is held, then
// itself, in order.
func TestHeldWritesAreBounded(t *testing.T) {
	c, s := pair(t)
	c.Hold()
	first := bytes.Repeat([]byte{1}, cork.MaxHeld-10)
	second := bytes.Repeat([]byte{2}, 100)
	done := make(chan error, 1)
	go func() {
		if _, err := c.Write(first); err != nil {
			done <- err
			return
		}
		_, err := c.Write(second)
		done <- err
	}()
	got := readWithin(t, s, time.Second)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, append(append([]byte(nil), first...), second...)) {
		t.Fatalf("got %d bytes, want the %d held then the %d past the bound, in order", len(got), len(first), len(second))
	}
}

// A release that cannot send closes the connection and says so.
func TestFailedReleaseClosesTheConnection(t *testing.T) {
	c, s := pair(t)
	c.Hold()
	if _, err := c.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = c.Conn.Close() // the connection broke under the held bytes
	if err := c.Release(); err == nil {
		t.Fatal("release on a closed connection: nil error")
	}
	if _, err := c.Write([]byte("y")); err == nil {
		t.Fatal("write after a failed release: nil error")
	}
	_ = s
}
