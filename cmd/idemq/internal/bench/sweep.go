package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/consumer"
)

// sweepPoint is one measurement of group commit throughput.
type sweepPoint struct {
	Concurrency, GroupSize int
	Rate                   float64
}

// runSweep measures group commit at several group sizes (concurrency 8) and
// several concurrencies (group size 32), a few seconds each.
func runSweep(ctx context.Context, o Options, pool *pgxpool.Pool, conn *amqp.Connection, out io.Writer) ([]sweepPoint, error) {
	var points []sweepPoint
	grid := []sweepPoint{
		{8, 1, 0}, {8, 8, 0}, {8, 32, 0}, {8, 100, 0},
		{2, 32, 0}, {4, 32, 0}, {16, 32, 0},
	}
	fmt.Fprintf(out, "  sweep: group commit by group size and concurrency")
	for _, p := range grid {
		queue := fmt.Sprintf("idemq.bench.sweep.%d", time.Now().UnixNano())
		if err := prepare(ctx, pool, conn, queue, 0); err != nil {
			return nil, err
		}
		n := min(o.Messages, 10000)
		if err := publish(ctx, conn, queue, n, o.BodySize, 0, "s-", 0, 0); err != nil {
			cleanupQueue(conn, queue, 0)
			return nil, err
		}
		m := consumer.ModeOptimistic
		if p.GroupSize == 1 {
			m = consumer.ModeSingle
		}
		res, _, err := runWorkerProcess(ctx, workerSpec{Mode: modeIdemq, Consumer: m, PostgresURL: o.PostgresURL, AMQPURL: o.AMQPURL, Schema: benchSchema,
			Queue: queue, Count: n, MaxDuration: 5 * time.Second, Concurrency: p.Concurrency,
			Prefetch: p.Concurrency * (p.GroupSize + 1), GroupSize: p.GroupSize})
		cleanupQueue(conn, queue, 0)
		if err != nil {
			return nil, err
		}
		if res.FirstToLast > 0 {
			p.Rate = float64(res.Settled) / time.Duration(res.FirstToLast).Seconds()
		}
		points = append(points, p)
		fmt.Fprint(out, ".")
	}
	fmt.Fprintln(out)
	for _, p := range points {
		fmt.Fprintf(out, "    concurrency %2d, group %3d: %7.0f msg/s\n", p.Concurrency, p.GroupSize, p.Rate)
	}
	return points, nil
}

// writePlot draws the scenarios as bars and the sweep as two lines, in SVG.
func writePlot(path string, results []Result, sweep []sweepPoint) error {
	const w, h, pad = 900, 420, 60
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	maxRate := 1.0
	for _, r := range results {
		maxRate = max(maxRate, r.Rate)
	}
	for _, p := range sweep {
		maxRate = max(maxRate, p.Rate)
	}
	// Left: one bar per scenario.
	left := w/2 - pad
	fmt.Fprintf(&b, `<text x="%d" y="20" font-size="13">messages/s by scenario (same run)</text>`+"\n", pad)
	bw := float64(left) / float64(max(1, len(results)))
	for i, r := range results {
		bh := float64(h-2*pad) * r.Rate / maxRate
		x := float64(pad) + float64(i)*bw
		fmt.Fprintf(&b, `<rect x="%.0f" y="%.0f" width="%.0f" height="%.0f" fill="#4c78a8"/>`+"\n", x+4, float64(h-pad)-bh, bw-8, bh)
		fmt.Fprintf(&b, `<text x="%.0f" y="%.0f" text-anchor="middle">%.0f</text>`+"\n", x+bw/2, float64(h-pad)-bh-4, r.Rate)
		fmt.Fprintf(&b, `<text transform="translate(%.0f,%d) rotate(30)">%s</text>`+"\n", x+bw/2-10, h-pad+12, xmlEscape(shortName(r.Scenario)))
	}
	// Right: group commit throughput against group size and concurrency.
	if len(sweep) > 0 {
		x0 := w/2 + pad/2
		fmt.Fprintf(&b, `<text x="%d" y="20" font-size="13">group commit: msg/s vs group size (c=8, blue) and concurrency (g=32, orange)</text>`+"\n", x0)
		plotLine(&b, sweep, func(p sweepPoint) (float64, bool) { return float64(p.GroupSize), p.Concurrency == 8 }, []float64{1, 8, 32, 100}, "#4c78a8", x0, w-pad, h, pad, maxRate)
		plotLine(&b, sweep, func(p sweepPoint) (float64, bool) { return float64(p.Concurrency), p.GroupSize == 32 }, []float64{2, 4, 8, 16}, "#f58518", x0, w-pad, h, pad, maxRate)
	}
	b.WriteString("</svg>\n")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

func plotLine(b *strings.Builder, sweep []sweepPoint, x func(sweepPoint) (float64, bool), ticks []float64, color string, x0, x1, h, pad int, maxRate float64) {
	pos := func(v float64) float64 {
		for i, t := range ticks {
			if v <= t {
				return float64(x0) + float64(i)*float64(x1-x0)/float64(len(ticks)-1)
			}
		}
		return float64(x1)
	}
	var pts []string
	for _, p := range sweep {
		v, ok := x(p)
		if !ok {
			continue
		}
		y := float64(h-pad) - float64(h-2*pad)*p.Rate/maxRate
		pts = append(pts, fmt.Sprintf("%.0f,%.0f", pos(v), y))
		fmt.Fprintf(b, `<circle cx="%.0f" cy="%.0f" r="3" fill="%s"/><text x="%.0f" y="%.0f" fill="%s">%.0f</text>`+"\n", pos(v), y, color, pos(v)+4, y-4, color, p.Rate)
	}
	fmt.Fprintf(b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), color)
	for _, t := range ticks {
		fmt.Fprintf(b, `<text x="%.0f" y="%d" fill="%s" text-anchor="middle">%g</text>`+"\n", pos(t), h-pad+14+btoi(color == "#f58518")*12, color, t)
	}
}

func btoi(v bool) int {
	if v {
		return 1
	}
	return 0
}

func shortName(s string) string {
	s = strings.TrimPrefix(s, "idemq ")
	if len(s) > 28 {
		return s[:28] + "…"
	}
	return s
}

func xmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;").Replace(s)
}
