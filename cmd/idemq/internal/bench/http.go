package bench

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/gateway"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/redact"
	"github.com/idemq/idemq/outbox"
)

// The HTTP front door: what the Idempotency-Key middleware costs against
// the same handler unguarded, and what the gateway (middleware, outbox,
// relay) costs against an HTTP server that publishes with confirms itself.
// Each server is this binary re-executed (its CPU is its own), loaded by
// wrk for a fixed time with a new key per request (or a fifth repeated).

// httpServer is what an HTTP worker serves.
type httpServer string

const (
	httpBare    httpServer = "bare"     // BEGIN, a ledger INSERT, COMMIT, 201
	httpGuarded httpServer = "idemhttp" // the same handler behind idemhttp
	// httpGuardedSeparate: behind idemhttp with SeparateReservations (a
	// reservation committed on its own, a heartbeated lease).
	httpGuardedSeparate httpServer = "idemhttp-separate"
	httpBarePublish     httpServer = "bare-publish" // publish with a confirm, 202
	httpGateway         httpServer = "gateway"      // idemq gateway: middleware, outbox, relay
)

// httpPath is the path every row POSTs to (the gateway's endpoint; the
// other servers answer on any path).
const httpPath = "/messages"

// httpPoolConns is the Postgres pool of every HTTP server: the default
// --max-conns of idemq gateway.
const httpPoolConns = 20

// The targets of issue #37 for the front door, printed against the figures.
const (
	targetGuarded  = 0.70                  // guarded ≥ 70 % of bare
	targetGateway  = 0.50                  // gateway ≥ 50 % of bare HTTP → publish
	targetPacedP99 = 10 * time.Millisecond // p99 at half the guarded max rate
)

func httpScenarios() []scenario {
	return []scenario{
		{name: "http bare: POST, one INSERT in one tx", mode: modeHTTP, server: httpBare, group: "db", bare: true},
		{name: "http idemhttp: the same handler, guarded", mode: modeHTTP, server: httpGuarded, group: "db", paced: true},
		{name: "http idemhttp: the same handler, guarded, 20% dup", mode: modeHTTP, server: httpGuarded, group: "db", duplicates: 0.2},
		{name: "http idemhttp, separate reservations", mode: modeHTTP, server: httpGuardedSeparate, group: "db"},
		{name: "http bare publish: POST → publish with confirms", mode: modeHTTP, server: httpBarePublish, group: "publish", bare: true},
		{name: "idemq gateway", mode: modeHTTP, server: httpGateway, group: "publish"},
		{name: "idemq gateway, 20% dup", mode: modeHTTP, server: httpGateway, group: "publish", duplicates: 0.2},
	}
}

// runHTTPRows runs the HTTP table's rows, sets their ratios within their
// group, and returns them with the paced measurements: the guarded row at
// half its rate, then its group's bare row at the same rate (what the
// machine gives without the guard).
func (b *bench) runHTTPRows(ctx context.Context, out io.Writer, scs []scenario) ([]Result, []pacedHTTP, error) {
	wrk, err := findWrk()
	skip := ""
	if err != nil {
		skip = err.Error()
	}
	fmt.Fprintf(out, "HTTP front door: wrk, %d connections, %d threads, %s per row, bodies of %d bytes\n",
		wrkConnections, wrkThreads, b.o.HTTPDuration, b.o.BodySize)
	var rs []Result
	var paced []pacedHTTP
	for _, sc := range scs {
		sc.skip = cmp.Or(sc.skip, skip)
		r, err := b.runRow(ctx, out, sc, func(ctx context.Context, sc scenario, measure func() measured) (Result, error) {
			return b.runHTTPScenario(ctx, wrk, sc, measure)
		})
		if err != nil {
			return rs, paced, err
		}
		r.Section = SectionHTTP
		rs = append(rs, r)
		if !sc.paced || r.Rate == 0 {
			continue
		}
		pacedRows := []scenario{sc}
		if i := slices.IndexFunc(scs, func(o scenario) bool { return o.bare && o.group == sc.group }); i >= 0 {
			pacedRows = append(pacedRows, scs[i])
		}
		for _, p := range pacedRows {
			fmt.Fprintf(out, "  running %-55s", "… paced, open loop: "+p.name+" …")
			pr, err := b.runPacedHTTP(ctx, p, r.Rate/2)
			if err != nil {
				fmt.Fprintln(out, "failed")
				return rs, paced, fmt.Errorf("bench: %s, paced: %w", p.name, err)
			}
			pr.Scenario = p.name
			paced = append(paced, *pr)
			fmt.Fprintf(out, " p99 %s\n", lat(pr.P99))
		}
	}
	groupRatios(scs, rs)
	return rs, paced, nil
}

// httpRowSpec is the worker spec of an HTTP row, and the queue it
// publishes to ("" for the database rows), declared fresh.
func (b *bench) httpRowSpec(sc scenario) (workerSpec, error) {
	spec := workerSpec{Mode: modeHTTP, Server: sc.server, PostgresURL: b.o.PostgresURL, AMQPURL: b.o.AMQPURL,
		Schema: benchSchema, MaxDuration: b.o.HTTPDuration + time.Minute, BodySize: b.o.BodySize}
	if sc.server == httpBarePublish || sc.server == httpGateway {
		spec.Target = fmt.Sprintf("idemq.bench.http.%d", time.Now().UnixNano())
		if err := declarePlain(b.conn, spec.Target, false); err != nil {
			return spec, err
		}
	}
	return spec, nil
}

// runHTTPScenario runs one row: a fresh schema (and queue), the server
// started, wrk for the run's HTTP duration, the server stopped (the
// gateway's relay drains its outbox first), then the effects counted.
func (b *bench) runHTTPScenario(ctx context.Context, wrk string, sc scenario, measure func() measured) (Result, error) {
	if err := resetSchema(ctx, b.pool); err != nil {
		return Result{}, err
	}
	spec, err := b.httpRowSpec(sc)
	if err != nil {
		return Result{}, err
	}
	if spec.Target != "" {
		defer deleteQueue(b.conn, spec.Target)
	}
	dir, err := os.MkdirTemp("", "idemq-bench-wrk-")
	if err != nil {
		return Result{}, err
	}
	defer os.RemoveAll(dir)
	script, err := writeWrkScript(dir, fmt.Sprintf("%08x-", rand.Uint32()), sc.duplicates > 0, b.o.BodySize, httpPath)
	if err != nil {
		return Result{}, err
	}
	quiesce(ctx, b.pool)
	m := measure()
	srv, err := startHTTPWorker(ctx, spec)
	if err != nil {
		return Result{}, err
	}
	w, wrkErr := runWrk(ctx, wrk, "http://"+srv.addr+httpPath, script, b.o.HTTPDuration)
	res, usage, err := srv.stop()
	if err := errors.Join(wrkErr, err); err != nil {
		return Result{}, err
	}
	r := Result{Settled: int(w.Requests), Rate: w.Rate, P50: w.P50, P99: w.P99,
		Replayed: w.Replayed, Conflicts: w.Conflicts, Failed: w.Others + w.SocketErrors}
	m.cost(&r, int(w.Requests), usage)
	r.Note = res.Note
	// Every answer that is a 2xx and no replay is one effect: a ledger
	// row, or a message in the queue. A request cut by wrk's end may have
	// had its effect without its answer being counted: at most one per
	// connection more.
	fresh := w.Requests - w.Non2xx - w.Replayed
	effects, err := b.countEffects(ctx, spec.Target)
	if err != nil {
		return r, err
	}
	if effects < fresh || effects > fresh+wrkConnections {
		r.Note = strings.TrimPrefix(r.Note+"; ", "; ") + fmt.Sprintf("%d effects (ledger rows or messages) for %d fresh 2xx answers", effects, fresh)
	}
	return r, nil
}

// countEffects counts the ledger's rows, or the messages in queue.
func (b *bench) countEffects(ctx context.Context, queue string) (int64, error) {
	if queue == "" {
		var n int64
		err := b.pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{benchSchema, "ledger"}.Sanitize()).Scan(&n)
		return n, err
	}
	ch, err := b.conn.Channel()
	if err != nil {
		return 0, err
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	return int64(q.Messages), err
}

// pacedHTTP is the open-loop latency of the guarded row at half its rate.
type pacedHTTP struct {
	Scenario string
	Rate     float64
	openLoopResult
}

// runPacedHTTP runs a row's server again, fresh, and sends it an open-loop
// load at rate for the run's HTTP duration.
func (b *bench) runPacedHTTP(ctx context.Context, sc scenario, rate float64) (*pacedHTTP, error) {
	if err := resetSchema(ctx, b.pool); err != nil {
		return nil, err
	}
	spec, err := b.httpRowSpec(sc)
	if err != nil {
		return nil, err
	}
	if spec.Target != "" {
		defer deleteQueue(b.conn, spec.Target)
	}
	quiesce(ctx, b.pool)
	srv, err := startHTTPWorker(ctx, spec)
	if err != nil {
		return nil, err
	}
	res := openLoop(ctx, "http://"+srv.addr+httpPath, rate, b.o.HTTPDuration, bytes.Repeat([]byte("x"), b.o.BodySize), fmt.Sprintf("p%08x-", rand.Uint32()))
	if _, _, err := srv.stop(); err != nil {
		return nil, err
	}
	if res.Sent == 0 {
		return nil, errors.New("no request sent")
	}
	return &pacedHTTP{Rate: rate, openLoopResult: res}, nil
}

// httpWorker is a running HTTP server process.
type httpWorker struct {
	addr   string
	stdin  io.WriteCloser
	stdout *bufio.Reader
	stderr *bytes.Buffer
	wait   func() (*syscall.Rusage, error)
	// head is what was read of stdout when it was no address.
	head string
}

// startHTTPWorker re-executes this binary as an HTTP server and returns
// once it listens: its first line on stdout is "listening ADDR".
func startHTTPWorker(ctx context.Context, spec workerSpec) (*httpWorker, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	b, _ := json.Marshal(spec)
	cmd := exec.CommandContext(ctx, exe, os.Args[1:]...)
	cmd.Env = append(os.Environ(), workerEnv+"="+string(b))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	wait, err := startMeasured(cmd)
	if err != nil {
		return nil, err
	}
	w := &httpWorker{stdin: stdin, stdout: bufio.NewReader(stdout), stderr: &stderr, wait: wait}
	line, err := w.stdout.ReadString('\n')
	if addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening "); ok && err == nil {
		w.addr = addr
		return w, nil
	}
	// It ended before listening: its result (the line read) says why.
	w.head = line
	_, _, werr := w.stop()
	return nil, fmt.Errorf("http worker did not start: %w", cmp.Or(werr, errors.New("no address")))
}

// stop closes the worker's stdin, which stops it, and reads its result.
func (w *httpWorker) stop() (workerResult, *syscall.Rusage, error) {
	_ = w.stdin.Close()
	rest, _ := io.ReadAll(w.stdout)
	rest = append([]byte(w.head), rest...)
	usage, err := w.wait()
	if err != nil {
		return workerResult{}, nil, fmt.Errorf("http worker: %w: %s", err, redact.String(w.stderr.String()))
	}
	var res workerResult
	if err := json.Unmarshal(lastLine(rest), &res); err != nil {
		return res, nil, fmt.Errorf("http worker output %q: %w", rest, err)
	}
	if res.Error != "" {
		return res, nil, errors.New("http worker: " + redact.String(res.Error))
	}
	return res, usage, nil
}

// runHTTPServer is the body of an HTTP worker: it serves on a loopback
// port, which it prints first, until stdin ends.
func runHTTPServer(ctx context.Context, spec workerSpec, stdin io.Reader, out io.Writer) (workerResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, stdin)
		cancel()
	}()
	// IDEMQ_BENCH_HTTP_POOL sets the servers' pool size (an experiment's knob).
	conns := httpPoolConns
	if n, err := strconv.Atoi(os.Getenv("IDEMQ_BENCH_HTTP_POOL")); err == nil && n > 0 {
		conns = n
	}
	store, closePool, err := openStore(ctx, spec, conns)
	if err != nil {
		return workerResult{}, err
	}
	defer closePool()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return workerResult{}, err
	}
	var effects atomic.Int64
	var serve func(context.Context, net.Listener) error
	switch spec.Server {
	case httpBare, httpGuarded, httpGuardedSeparate:
		var h http.Handler = ledgerHandler(store.Pool(), pgx.Identifier{spec.Schema, "ledger"}.Sanitize(), &effects)
		if spec.Server != httpBare {
			mw, err := idemhttp.New(store, &idemhttp.Config{
				Consumer: "bench-http", Logger: discardLogger(), SeparateReservations: spec.Server == httpGuardedSeparate})
			if err != nil {
				return workerResult{}, err
			}
			h = mw.Require(h)
		}
		serve = plainServer(h)
	case httpBarePublish:
		conn, ch, err := confirmChannel(ctx, spec.AMQPURL, "idemq-bench-http")
		if err != nil {
			return workerResult{}, err
		}
		defer conn.Close()
		serve = plainServer(publishHandler(ch, spec.Target, &effects))
	case httpGateway:
		// As `idemq gateway` builds it: its relay runs beside the server
		// and drains the outbox when the server stops.
		g, err := gateway.New(store, gateway.Config{
			Consumer:     "bench-gateway",
			RoutingKey:   spec.Target,
			AMQPURL:      spec.AMQPURL,
			Relay:        outbox.RelayConfig{ConnectionName: "idemq-bench-gateway-relay"},
			DrainTimeout: time.Minute,
			Logger:       discardLogger(),
			Around: func(next http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					next.ServeHTTP(w, r)
					effects.Add(1)
				})
			},
		})
		if err != nil {
			return workerResult{}, err
		}
		serve = g.Serve
	default:
		return workerResult{}, fmt.Errorf("unknown HTTP server %q", spec.Server)
	}
	fmt.Fprintf(out, "listening %s\n", ln.Addr())
	err = serve(ctx, ln)
	return workerResult{Settled: int(effects.Load())}, err
}

// plainServer serves h on a listener until ctx ends.
func plainServer(h http.Handler) func(context.Context, net.Listener) error {
	return func(ctx context.Context, ln net.Listener) error {
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
		errc := make(chan error, 1)
		go func() { errc <- srv.Serve(ln) }()
		select {
		case err := <-errc:
			return err
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		err := srv.Shutdown(sctx)
		<-errc
		return err
	}
}

// ledgerHandler is the handler of the database rows: one ledger INSERT in
// one transaction, then 201. Behind idemhttp it writes in the request's
// transaction (idemhttp.Tx), which the middleware commits with the key's
// completion; unguarded it begins and commits its own.
func ledgerHandler(pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, ledger string, effects *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			http.Error(w, "read body", http.StatusBadRequest)
			return
		}
		ctx := r.Context()
		key := cmp.Or(idemhttp.Key(r), r.Header.Get(idemhttp.DefaultHeader))
		tx := idemhttp.Tx(r)
		own := tx == nil
		if own {
			var err error
			if tx, err = pool.Begin(ctx); err != nil {
				http.Error(w, "begin", http.StatusServiceUnavailable)
				return
			}
			defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // a no-op after COMMIT
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+ledger+" (key) VALUES ($1)", key)
		if err == nil && own {
			err = tx.Commit(ctx)
		}
		if err != nil {
			http.Error(w, "insert", http.StatusServiceUnavailable)
			return
		}
		effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"status":"created"}`+"\n")
	}
}

// publishHandler is the bare HTTP → publish server: the body published to
// queue, persistent and mandatory, on one channel in confirm mode shared by
// every request; 202 once the broker confirmed it.
func publishHandler(ch *amqp.Channel, queue string, effects *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "read body", http.StatusBadRequest)
			return
		}
		c, err := ch.PublishWithDeferredConfirmWithContext(r.Context(), "", queue, true, false, amqp.Publishing{
			MessageId: r.Header.Get(idemhttp.DefaultHeader), ContentType: r.Header.Get("Content-Type"),
			Body: body, DeliveryMode: amqp.Persistent,
		})
		if err != nil {
			http.Error(w, "publish", http.StatusServiceUnavailable)
			return
		}
		if ok, err := c.WaitContext(r.Context()); err != nil || !ok {
			http.Error(w, "not confirmed", http.StatusServiceUnavailable)
			return
		}
		effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusAccepted)
		_, _ = io.WriteString(w, `{"status":"accepted"}`+"\n")
	}
}

// printHTTPTable prints the HTTP front door's table, the paced latency
// and the targets.
func printHTTPTable(out io.Writer, results []Result, paced []pacedHTTP) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "HTTP front door\treq/s\tvs bare\tp50\tp99\treplayed\t409\tfailed\tpeak RSS\tCPU/req\tpg/req\tmq/req\tall/req\t")
	for _, r := range results {
		if r.Rate == 0 && r.Note != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t\n", r.Scenario)
			continue
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f%%\t%s\t%s\t%d\t%d\t%d\t%d MiB\t%s\t%s\t%s\t%s\t\n", r.Scenario, r.Rate, 100*r.Ratio,
			lat(r.P50), lat(r.P99), r.Replayed, r.Conflicts, r.Failed, r.PeakRSSKiB/1024,
			cpu(r.CPUPerMsg), cpu(r.PGPerMsg), cpu(r.MQPerMsg), cpu(r.AllPerMsg))
	}
	tw.Flush()
	fmt.Fprintf(out, "req/s, p50, p99: wrk's (closed loop: %d connections, each sending when answered; latency at saturation). vs bare: idemhttp rows to the bare handler, gateway rows to the bare HTTP → publish server.\n", wrkConnections)
	fmt.Fprintln(out, "replayed: 2xx answers replayed (Idempotent-Replayed: true); 409: a request with the key still in flight (expected in the 20% dup rows: a fifth of the requests repeat an earlier key); failed: any other answer that is not 2xx, and socket errors.")
	fmt.Fprintln(out, "CPU/req: the server process (start to stop; the gateway's includes its relay draining the outbox); pg/req, mq/req: the servers during the row; per request answered.")
	for i, p := range paced {
		what := "half the guarded row's rate above"
		if i > 0 {
			what = "the same rate, for comparison"
		}
		fmt.Fprintf(out, "paced, open loop: %s at %.0f req/s (%s): p50 %s, p99 %s from each request's scheduled send time (%d sent, %d not 2xx, the first tenth left out)\n",
			p.Scenario, p.Rate, what, lat(p.P50), lat(p.P99), p.Sent, p.Failed)
	}
	var targets []string
	for _, r := range results {
		switch r.Scenario {
		case "http idemhttp: the same handler, guarded":
			targets = append(targets, target(fmt.Sprintf("guarded ≥ %.0f%% of bare", 100*targetGuarded), r.Rate > 0 && r.Ratio > 0, r.Ratio >= targetGuarded, fmt.Sprintf("%.0f%%", 100*r.Ratio)))
		case "idemq gateway":
			targets = append(targets, target(fmt.Sprintf("gateway ≥ %.0f%% of bare HTTP → publish", 100*targetGateway), r.Rate > 0 && r.Ratio > 0, r.Ratio >= targetGateway, fmt.Sprintf("%.0f%%", 100*r.Ratio)))
		}
	}
	if len(paced) > 0 {
		targets = append(targets, target("p99 < "+targetPacedP99.String()+" at half the guarded max rate", true, paced[0].P99 < targetPacedP99, lat(paced[0].P99)))
	}
	printTargets(out, targets)
	printNotes(out, results)
}

func target(what string, measured, met bool, got string) string {
	switch {
	case !measured:
		return what + ": not measured"
	case met:
		return what + ": " + got + ", met"
	}
	return what + ": " + got + ", missed"
}
