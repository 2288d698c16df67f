package demo

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progress shows one status line: rewritten in place on a terminal, printed
// every few seconds elsewhere (a log or a pipe is not flooded).
type progress struct {
	w     io.Writer
	tty   bool
	every time.Duration
	last  time.Time
	shown bool // a line is on screen and not yet ended (terminal only)
}

func newProgress(w io.Writer) *progress {
	p := &progress{w: w, every: 5 * time.Second}
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			p.tty, p.every = true, 250*time.Millisecond
		}
	}
	return p
}

// update shows line if its time has come (always when force).
func (p *progress) update(line string, force bool) {
	now := time.Now()
	if !force && now.Sub(p.last) < p.every {
		return
	}
	p.last = now
	if p.tty {
		fmt.Fprintf(p.w, "\r\033[K%s", line)
		p.shown = true
		return
	}
	fmt.Fprintln(p.w, line)
}

// note prints a line of its own, above the status line on a terminal.
func (p *progress) note(format string, args ...any) {
	p.end()
	fmt.Fprintf(p.w, format+"\n", args...)
}

// end finishes the status line on a terminal.
func (p *progress) end() {
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
