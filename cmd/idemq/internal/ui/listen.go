package ui

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
)

// ErrNotLoopback means an address other than loopback was asked for without
// a token to protect it.
var ErrNotLoopback = errors.New("not a loopback address")

// CheckListen refuses to listen on addr (host:port) without a token unless
// its host is a loopback address or "localhost". An empty host (every
// interface) and other host names count as not loopback.
func CheckListen(addr string, haveToken bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen address %q: %w", addr, err)
	}
	if haveToken || isLoopback(host) {
		return nil
	}
	return fmt.Errorf("listen address %q: %w: give --auth-token-file to listen on it", addr, ErrNotLoopback)
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}
