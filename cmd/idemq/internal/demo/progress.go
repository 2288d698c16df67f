package demo

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"golang.org/x/term"
)

// progress shows one status line: rewritten in place on a terminal, printed
// every few seconds elsewhere (a log or a pipe is not flooded). It is safe
// for concurrent use.
type progress struct {
	mu    sync.Mutex
	w     io.Writer
	tty   bool
	fd    int
	every time.Duration
	last  time.Time
	shown bool // a line is on screen and not yet ended (terminal only)
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w, every: 5 * time.Second}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.tty, p.fd, p.every = true, int(f.Fd()), 250*time.Millisecond
	}
	return p
}

// update shows line if its time has come (always when force).
func (p *progress) update(line string, force bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if !force && now.Sub(p.last) < p.every {
		return
	}
	p.last = now
	if p.tty {
		// A line longer than the terminal would wrap, and \r would then
		// rewrite only its last row.
		if width, _, err := term.GetSize(p.fd); err == nil && width > 1 {
			line = cut(line, width-1)
		}
		fmt.Fprintf(p.w, "\r\033[K%s", line)
		p.shown = true
		return
	}
	fmt.Fprintln(p.w, line)
}

// note prints a line of its own, above the status line on a terminal.
func (p *progress) note(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endLocked()
	fmt.Fprintf(p.w, format+"\n", args...)
}

// end finishes the status line on a terminal.
func (p *progress) end() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endLocked()
}

func (p *progress) endLocked() {
	if p.tty && p.shown {
		fmt.Fprintln(p.w)
		p.shown = false
	}
}

// bar draws a fraction as a 20-cell bar.
func bar(done, total int) string {
	const cells = 20
	n := 0
	if total > 0 {
		n = min(cells, done*cells/total)
	}
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", cells-n) + "]"
}

// cut shortens s to at most n runes.
func cut(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n])
}
