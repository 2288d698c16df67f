package bench

import (
	"net"
	"os"
	"strconv"
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// A command with spaces and a parenthesis: fields are read after the last ')'.
	line := []byte("2962 (beam (x) smp) S 1 2961 2961 0 -1 4194304 234836 0 1 0 4413 2651 7 9 20 0 20 0 4963\n")
	st, ok := parseStat(line)
	if !ok || st.ppid != 1 || st.own != 4413+2651 || st.reaped != 7+9 {
		t.Fatalf("parseStat = %+v, %v; want ppid 1, own %d, reaped %d", st, ok, 4413+2651, 7+9)
	}
	if _, ok := parseStat([]byte("12 (short) S 1 2")); ok {
		t.Error("a truncated line parsed")
	}
}

func TestProcTree(t *testing.T) {
	procs := procTable{
		10: {ppid: 1, own: 3, reaped: 2}, // the server
		11: {ppid: 10, own: 3},           // a backend
		12: {ppid: 11, own: 1},           // its child
		20: {ppid: 1, own: 100},
	}
	if got, want := procs.tree(10), 9*clockTick; got != want {
		t.Errorf("tree(10) = %s, want %s", got, want)
	}
}

func TestLocalPort(t *testing.T) {
	for _, c := range []struct {
		url  string
		def  int
		want int
	}{
		{"postgres://postgres@127.0.0.1:5432/test?sslmode=disable", 5432, 5432},
		{"postgres://postgres@localhost/test", 5432, 5432},
		{"amqp://guest:guest@127.0.0.1:5673/", 5672, 5673},
		{"amqp://guest:guest@[::1]:5672/", 5672, 5672},
		{"postgres://db.example.com:5432/x", 5432, 0},
		{"host=127.0.0.1 port=6543 user=postgres", 5432, 6543},
		{"host=/var/run/postgresql user=postgres", 5432, 5432},
	} {
		if got := localPort(c.url, c.def); got != c.want {
			t.Errorf("localPort(%q) = %d, want %d", c.url, got, c.want)
		}
	}
}

func TestServerCPUSub(t *testing.T) {
	before := serverCPU{pg: time.Second, mq: time.Second, pgPID: 1, mqPID: 2}
	after := serverCPU{pg: 3 * time.Second, mq: 2 * time.Second, pgPID: 1, mqPID: 3} // RabbitMQ restarted
	d := after.sub(before)
	if d.pg != 2*time.Second || d.mq != -1 {
		t.Errorf("sub = %+v; want pg 2s, mq -1 (another process)", d)
	}
}

// The probe finds the process that listens on a port: here, this test.
func TestListenerPIDs(t *testing.T) {
	if _, err := os.Stat("/proc/net/tcp"); err != nil {
		t.Skip("no /proc/net/tcp: the CPU columns are Linux only")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	if got := listenerPIDs(port)[port]; got != os.Getpid() {
		t.Errorf("listener of port %d: pid %d, want this process %d", port, got, os.Getpid())
	}
	if s := newCPUProbe("postgres://x@127.0.0.1:"+strconv.Itoa(port)+"/db", "amqp://db.example.com/").sample(); s.pg < 0 || s.mq != -1 {
		t.Errorf("sample = %+v; want this process's CPU as pg, no mq (not local)", s)
	}
}
