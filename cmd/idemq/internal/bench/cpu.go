package bench

import (
	"bytes"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// The CPU of the servers: on one machine the worker, Postgres and RabbitMQ
// share the cores, so a row's cost per message is the sum of the three.
// The servers are found by the port they listen on (other clusters on the
// machine are not counted), and each is read as the process holding the
// listening socket plus its children, from /proc/<pid>/stat: utime + stime,
// plus cutime + cstime, where a parent finds the time of the children it
// reaped (a Postgres backend that ends during a row is counted there).

// clockTick is USER_HZ, the unit of /proc/<pid>/stat times: 100 on Linux
// whatever the kernel's HZ.
const clockTick = 10 * time.Millisecond

// serverCPU is a reading of the servers' CPU time; a negative value means
// the server was not found.
type serverCPU struct {
	pg, mq       time.Duration
	pgPID, mqPID int
}

// cpuProbe reads the CPU of the Postgres and RabbitMQ servers of the URLs,
// when they run on this machine.
type cpuProbe struct {
	pgPort, mqPort int
}

func newCPUProbe(pgURL, amqpURL string) *cpuProbe {
	return &cpuProbe{pgPort: localPort(pgURL, 5432), mqPort: localPort(amqpURL, 5672)}
}

// localPort is the port of a URL (or key=value DSN) whose host is this
// machine's loopback, else 0.
func localPort(raw string, def int) int {
	host, port := "", ""
	if u, err := url.Parse(raw); err == nil && u.Scheme != "" && u.Host != "" {
		host, port = u.Hostname(), u.Port()
	} else {
		for _, f := range strings.Fields(raw) {
			k, v, _ := strings.Cut(f, "=")
			switch k {
			case "host":
				host = v
			case "port":
				port = v
			}
		}
	}
	if host != "localhost" && !strings.HasPrefix(host, "/") {
		if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
			return 0
		}
	}
	if port == "" {
		return def
	}
	p, err := strconv.Atoi(port)
	if err != nil {
		return 0
	}
	return p
}

// sample reads both servers now. A server restarted between two samples
// reads as absent in the difference (see sub).
func (p *cpuProbe) sample() serverCPU {
	s := serverCPU{pg: -1, mq: -1}
	if p == nil {
		return s
	}
	listeners := listenerPIDs(p.pgPort, p.mqPort)
	if pid, ok := listeners[p.pgPort]; ok && p.pgPort != 0 {
		if d, ok := treeCPU(pid); ok {
			s.pg, s.pgPID = d, pid
		}
	}
	if pid, ok := listeners[p.mqPort]; ok && p.mqPort != 0 {
		if d, ok := treeCPU(pid); ok {
			s.mq, s.mqPID = d, pid
		}
	}
	return s
}

// treeCPU reads the CPU time of pid and its descendants consistently: a
// child reaped while /proc is scanned (read before its parent counts it,
// gone after) would be lost, so the scan is repeated until the parent
// reaped no child during it. Right after a consumer exits, its Postgres
// backends end exactly then.
func treeCPU(pid int) (time.Duration, bool) {
	for range 20 {
		before, ok := readStat(pid)
		if !ok {
			return 0, false
		}
		procs := readProcs()
		after, ok := readStat(pid)
		if !ok {
			return 0, false
		}
		if before.reaped == after.reaped {
			procs[pid] = after
			return procs.tree(pid), true
		}
	}
	return 0, false
}

func readStat(pid int) (procStat, bool) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStat{}, false
	}
	return parseStat(b)
}

// sub is the CPU spent between two samples, -1 for a server not seen (or
// not the same process) in both.
func (s serverCPU) sub(before serverCPU) serverCPU {
	d := serverCPU{pg: -1, mq: -1, pgPID: s.pgPID, mqPID: s.mqPID}
	if s.pg >= 0 && before.pg >= 0 && s.pgPID == before.pgPID {
		d.pg = s.pg - before.pg
	}
	if s.mq >= 0 && before.mq >= 0 && s.mqPID == before.mqPID {
		d.mq = s.mq - before.mq
	}
	return d
}

type procStat struct {
	ppid   int
	own    int64 // utime + stime
	reaped int64 // cutime + cstime: the children it waited for
}

type procTable map[int]procStat

func readProcs() procTable {
	t := procTable{}
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil {
			continue
		}
		if st, ok := parseStat(b); ok {
			t[pid] = st
		}
	}
	return t
}

// parseStat reads ppid and the four CPU times of a /proc/<pid>/stat line.
func parseStat(b []byte) (procStat, bool) {
	// The command is in parentheses and may hold spaces: the fields start
	// after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, utime..cstime 14..17.
	if len(f) < 15 {
		return procStat{}, false
	}
	ppid, err := strconv.Atoi(f[1])
	if err != nil {
		return procStat{}, false
	}
	var t [4]int64
	for i, k := range f[11:15] {
		n, err := strconv.ParseInt(k, 10, 64)
		if err != nil {
			return procStat{}, false
		}
		t[i] = n
	}
	return procStat{ppid: ppid, own: t[0] + t[1], reaped: t[2] + t[3]}, true
}

// tree is the CPU time of pid and of its descendants still alive.
func (t procTable) tree(pid int) time.Duration {
	children := map[int][]int{}
	for p, st := range t {
		children[st.ppid] = append(children[st.ppid], p)
	}
	var ticks int64
	var walk func(int)
	walk = func(p int) {
		ticks += t[p].own + t[p].reaped
		for _, c := range children[p] {
			walk(c)
		}
	}
	walk(pid)
	return time.Duration(ticks) * clockTick
}

// listenerPIDs maps each port to the process holding a socket that listens
// on it (loopback or any address, IPv4 or IPv6).
func listenerPIDs(ports ...int) map[int]int {
	inodes := map[string]int{} // socket inode → port
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] != "0A" { // 0A: LISTEN
				continue
			}
			_, hexPort, _ := strings.Cut(fs[1], ":")
			port, err := strconv.ParseInt(hexPort, 16, 32)
			if err != nil {
				continue
			}
			for _, want := range ports {
				if want != 0 && int(port) == want {
					inodes["socket:["+fs[9]+"]"] = want
				}
			}
		}
	}
	out := map[int]int{}
	if len(inodes) == 0 {
		return out
	}
	dirs, _ := os.ReadDir("/proc")
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		fds, err := os.ReadDir(filepath.Join("/proc", d.Name(), "fd"))
		if err != nil {
			continue
		}
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join("/proc", d.Name(), "fd", fd.Name()))
			if err != nil {
				continue
			}
			if port, ok := inodes[link]; ok {
				// The lowest pid holding it is the server's main process
				// (a forked child may inherit the socket).
				if cur, seen := out[port]; !seen || pid < cur {
					out[port] = pid
				}
			}
		}
	}
	return out
}

// describe names what the CPU columns counted, for the table's footer.
func (s serverCPU) describe() string {
	part := func(name string, pid int, d time.Duration) string {
		if d < 0 {
			return name + " not found on this machine"
		}
		return fmt.Sprintf("%s pid %d and its children", name, pid)
	}
	return part("Postgres", s.pgPID, s.pg) + ", " + part("RabbitMQ", s.mqPID, s.mq)
}
