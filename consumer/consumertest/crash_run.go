package consumertest

import (
	"cmp"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/internal/kit"
	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/internal/amqpdial"
	"github.com/idemq/idemq/internal/propagator"
	"github.com/idemq/idemq/outbox"
)

// copyHeader names each copy a crash test publishes, so that the kit
// knows a delivery (a redelivery, a retry copy) for the copy it is.
const copyHeader = "x-consumertest-copy"

// groupLinger is the Group.Linger of a crash test's workers in the group
// modes, unless the Subject's Config sets one: long enough for the
// deliveries published at once to form one group.
const groupLinger = 200 * time.Millisecond

// crashWait bounds every wait of a crash test: for a worker to stop, for
// a held handler, for a lease to expire; and the time without any
// delivery ending before a point gives up.
const crashWait = time.Minute

// quietEnd is how long no delivery has an outcome before a point looks
// whether the queue and its tiers are empty although not every copy ended
// (the broker dead-lettered one itself, past its delivery limit).
const quietEnd = 10 * time.Second

// slowTimeout is the HandlerTimeout and StoreTimeout of the worker whose
// handler is slow in ScenarioLeaseExpired.
const slowTimeout = 2 * time.Second

// maxWorkers bounds the workers one point starts (one more after each
// crash) before it gives up on the deliveries ending.
const maxWorkers = 50

// pointRun is one point's run: a fresh Subject, a work queue of its own,
// the workers that consume it one after another (two at once in the
// scenarios), and what they did.
type pointRun struct {
	tb         testing.TB
	p          crashPoint
	subject    Subject
	mode       Mode
	deliveries []amqp.Publishing
	// cfg is the workers' configuration, before each worker's own settings.
	cfg  consumer.Config
	topo consumer.Topology
	prop propagation.TextMapPropagator
	conn *amqp.Connection
	// ch publishes, with confirms.
	ch *amqp.Channel
	// outbox is the Store's outbox when the Subject has a Downstream.
	outbox *outbox.Outbox

	mu  sync.Mutex
	row CrashRow
	// copies are the copies published; seen those with an outcome reported,
	// ended those with a final one (processed, rejected, dead-lettered, a
	// duplicate...); outcomes counts the outcomes.
	copies      []string
	seen, ended map[string]bool
	outcomes    int
	lastEvent   time.Time
	// crashed are the copies that crashed at the point.
	crashed map[string]bool
	workers int
	// events is signalled, without blocking, at every outcome.
	events chan struct{}
}

// runPoint runs every delivery on subject under p and checks.
func runPoint(tb testing.TB, subject Subject, deliveries []amqp.Publishing, p crashPoint) (CrashRow, error) {
	k, err := newPointRun(tb, subject, deliveries, p)
	if err != nil {
		return CrashRow{}, err
	}
	if err := k.open(); err != nil {
		return CrashRow{}, err
	}
	defer k.close()
	if p.scenario != nil {
		err = p.scenario(k)
	} else {
		err = k.publishAll()
		if err == nil {
			err = k.toEnd()
		}
	}
	if err != nil {
		return CrashRow{}, err
	}
	var msgs []amqp.Delivery
	if k.outbox != nil {
		if msgs, err = k.relay(p.relayCrash); err != nil {
			return CrashRow{}, err
		}
		if p.relayCrash {
			k.relayTraces(msgs)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), crashWait)
	defer cancel()
	k.mu.Lock()
	row := k.row
	k.mu.Unlock()
	row.Err = subject.Check(ctx)
	if k.outbox != nil && row.Err == nil {
		row.Err = subject.Downstream.Check(ctx, msgs)
	}
	return row, nil
}

// newPointRun prepares the run of p on subject: the workers'
// configuration, a work queue of its own.
func newPointRun(tb testing.TB, subject Subject, deliveries []amqp.Publishing, p crashPoint) (*pointRun, error) {
	mode, err := subject.mode()
	if err != nil {
		return nil, err
	}
	if subject.Store == nil || subject.Check == nil {
		return nil, errors.New("the setup's Subject needs a Store and a Check")
	}
	var cfg consumer.Config
	if subject.Config != nil {
		cfg = *subject.Config
	}
	if cfg.URL == "" {
		return nil, errors.New("the Subject's Config needs the broker's URL")
	}
	cfg.Queue = cmp.Or(cfg.Queue, DefaultQueue) + "." + strings.ToLower(rand.Text()[:12])
	cfg.Name = cmp.Or(cfg.Name, DefaultName)
	cfg.Lease = cmp.Or(cfg.Lease, CrashLease)
	cfg.Concurrency, cfg.Prefetch = 1, 0
	mode.Apply(&cfg)
	if !mode.Single() {
		cfg.Group.Size = max(2, len(deliveries))
		cfg.Group.Linger = cmp.Or(cfg.Group.Linger, groupLinger)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(testWriter{tb}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	k := &pointRun{
		tb: tb, p: p, subject: subject, mode: mode, deliveries: deliveries,
		cfg: cfg, topo: consumer.NewTopology(cfg.TopologyConfig()), prop: propagator.Or(cfg.Propagator),
		row: CrashRow{Point: p.name, Reached: p.stage == 0 && p.scenario == nil && !p.relayCrash}, lastEvent: time.Now(),
		crashed: map[string]bool{}, seen: map[string]bool{}, ended: map[string]bool{}, events: make(chan struct{}, 1),
	}
	if d := subject.Downstream; d != nil {
		if d.Queue == "" || d.Check == nil {
			return nil, errors.New("the Subject's Downstream needs a Queue and a Check")
		}
		if k.outbox, err = outbox.New(subject.Store.Pool(), &outbox.Config{Schema: subject.Store.Config().Schema}); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// open connects the kit to the broker and declares the point's topology.
func (k *pointRun) open() error {
	conn, err := dialKit(k.cfg.URL, "consumertest-"+k.cfg.Queue, k.cfg.AMQPConfig)
	if err != nil {
		return fmt.Errorf("dial the broker: %w", err)
	}
	k.conn = conn
	if k.ch, err = conn.Channel(); err != nil {
		return fmt.Errorf("open a channel: %w", err)
	}
	if err := k.ch.Confirm(false); err != nil {
		return fmt.Errorf("confirm mode: %w", err)
	}
	if err := k.topo.OnBroker(consumer.BrokerVersion(conn)).Declare(k.ch); err != nil {
		return fmt.Errorf("declare the topology: %w", err)
	}
	return nil
}

// close deletes the point's topology and closes the kit's connection.
func (k *pointRun) close() {
	defer k.conn.Close()
	ch, err := k.conn.Channel()
	if err != nil {
		return
	}
	for _, q := range k.queues() {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	_, _ = ch.QueueDelete(k.topo.DLQ, false, false, false)
	_ = ch.ExchangeDelete(k.topo.DLX, false, false)
}

// queues are the work queue and its retry tiers: where a delivery waits
// until it ends.
func (k *pointRun) queues() []string {
	qs := []string{k.topo.Queue}
	for _, d := range k.topo.Delays {
		qs = append(qs, k.topo.TierName(d))
	}
	return qs
}

// queued counts the messages ready in the work queue and its tiers (those
// a worker holds unacked are not counted).
func (k *pointRun) queued() (int, error) {
	ch, err := k.conn.Channel()
	if err != nil {
		return 0, fmt.Errorf("open a channel: %w", err)
	}
	defer ch.Close()
	n := 0
	for _, name := range k.queues() {
		q, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			return 0, fmt.Errorf("inspect queue %s: %w", name, err)
		}
		n += q.Messages
	}
	return n, nil
}

// drained reports whether the work queue and its tiers are empty once no
// worker runs, looking twice a moment apart: a copy on its way from a
// tier back to the work queue may be counted in neither.
func (k *pointRun) drained() (bool, error) {
	for i := range 2 {
		if i > 0 {
			<-time.After(200 * time.Millisecond)
		}
		n, err := k.queued()
		if err != nil || n > 0 {
			return false, err
		}
	}
	return true, nil
}

// publishAll publishes one copy of every delivery, in order.
func (k *pointRun) publishAll() error {
	for _, msg := range k.deliveries {
		if _, _, err := k.publish(msg); err != nil {
			return err
		}
	}
	return nil
}

// publish publishes a copy of msg to the work queue, with the broker's
// confirm, named by copyHeader and with a trace context of its own unless
// msg carries one. It returns the copy's name and its trace.
func (k *pointRun) publish(msg amqp.Publishing) (id, traceID string, err error) {
	msg.Headers = maps.Clone(msg.Headers)
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}
	k.mu.Lock()
	id = strconv.Itoa(len(k.copies) + 1)
	k.copies = append(k.copies, id)
	k.mu.Unlock()
	msg.Headers[copyHeader] = id
	carrier := propagation.MapCarrier{}
	for key, v := range msg.Headers {
		if s, ok := v.(string); ok {
			carrier[key] = s
		}
	}
	sc := trace.SpanContextFromContext(k.prop.Extract(context.Background(), carrier))
	if !sc.IsValid() {
		sc = newSpanContext()
		carrier = propagation.MapCarrier{}
		k.prop.Inject(trace.ContextWithSpanContext(context.Background(), sc), carrier)
		for key, v := range carrier {
			msg.Headers[key] = v
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), crashWait)
	defer cancel()
	dc, err := k.ch.PublishWithDeferredConfirmWithContext(ctx, "", k.cfg.Queue, false, false, msg)
	if err != nil {
		return "", "", fmt.Errorf("publish %q: %w", msg.MessageId, err)
	}
	if ok, err := dc.WaitContext(ctx); err != nil || !ok {
		return "", "", fmt.Errorf("publish %q: not confirmed (%v)", msg.MessageId, err)
	}
	return id, sc.TraceID().String(), nil
}

// newSpanContext is a random, sampled span context: a copy's own trace.
func newSpanContext() trace.SpanContext {
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled})
}

// settled records a copy's outcome.
func (k *pointRun) settled(at kit.At) {
	k.mu.Lock()
	k.outcomes++
	k.lastEvent = time.Now()
	for _, d := range at.Deliveries {
		id := copyOf(d.Headers)
		k.seen[id] = true
		switch consumer.Outcome(at.Outcome) {
		case consumer.OutcomeProcessed, consumer.OutcomeRejected, consumer.OutcomeDuplicate,
			consumer.OutcomeDeadLettered, consumer.OutcomeInvalidKey, consumer.OutcomeKeyReuse:
			k.ended[id] = true
		}
	}
	k.mu.Unlock()
	select {
	case k.events <- struct{}{}:
	default:
	}
}

// allEnded reports whether every copy in ids (every copy published, when
// ids is nil) has ended.
func (k *pointRun) allEnded(ids []string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if ids == nil {
		ids = k.copies
	}
	for _, id := range ids {
		if !k.ended[id] {
			return false
		}
	}
	return true
}

// allSeen reports whether every copy in ids has had an outcome.
func (k *pointRun) allSeen(ids []string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, id := range ids {
		if !k.seen[id] {
			return false
		}
	}
	return true
}

// waitFor waits until cond holds, looking at every outcome and every
// 100ms, for at most crashWait; it gives up early when w (if any) dies.
func (k *pointRun) waitFor(w *worker, what string, cond func() bool) error {
	deadline := time.After(crashWait)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		var dead <-chan struct{}
		if w != nil {
			dead = w.dead
		}
		select {
		case <-k.events:
		case <-tick.C:
		case <-dead:
			return fmt.Errorf("the worker crashed while waiting for %s", what)
		case <-deadline:
			return fmt.Errorf("%s: not within %s", what, crashWait)
		}
	}
	return nil
}

// toEnd runs workers, one after another, until every copy ended: a new
// one after each crash, until one sees every copy end and, once stopped,
// leaves the work queue and its tiers empty.
func (k *pointRun) toEnd() error {
	for range maxWorkers {
		w, err := k.start(workerOpts{})
		if err != nil {
			return err
		}
		ended, err := k.waitEnd(w)
		if err != nil {
			w.stop() //nolint:errcheck // the wait's error is the one to report
			return err
		}
		if !ended {
			// It crashed: its Run returns once its executor is gone.
			if err := w.stop(); err != nil {
				return err
			}
			continue
		}
		if err := w.stop(); err != nil {
			return err
		}
		if ok, err := k.drained(); err != nil || ok {
			return err
		}
	}
	return fmt.Errorf("the deliveries did not end after %d workers", maxWorkers)
}

// waitEnd waits until w crashes (false) or every copy ended (or none had
// an outcome for quietEnd) and nothing is ready in the work queue or its
// tiers (true).
func (k *pointRun) waitEnd(w *worker) (bool, error) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-w.dead:
			return false, nil
		case <-w.ended:
			select {
			case <-w.dead: // it crashed, and its Run returned since
				return false, nil
			default:
			}
			return false, fmt.Errorf("the consumer stopped: %v", w.err)
		case <-k.events:
		case <-tick.C:
		}
		k.mu.Lock()
		last := k.lastEvent
		k.mu.Unlock()
		if k.allEnded(nil) || time.Since(last) > quietEnd {
			n, err := k.queued()
			if err != nil {
				return false, err
			}
			if n == 0 {
				return true, nil
			}
		}
		if time.Since(last) > crashWait {
			return false, fmt.Errorf("no delivery ended for %s", crashWait)
		}
	}
}

// workerOpts are what a worker adds to the point's configuration.
type workerOpts struct {
	// hold holds the first handler call of its copies once it returned.
	hold *hold
	// enter is signalled when a handler is called with one of its copies.
	enter *signal
	// noHeartbeat: the worker does not extend its leases.
	noHeartbeat bool
	// prefetch, when positive, is the worker's prefetch.
	prefetch int
}

// worker is one consumer of the point's queue: a process, which a crash
// kills.
type worker struct {
	k      *pointRun
	cancel context.CancelFunc
	// dead is closed when the worker crashed; ended when its Run returned
	// (err).
	dead, ended chan struct{}
	err         error
	once        sync.Once

	mu    sync.Mutex
	conns []net.Conn
}

// start starts a worker: a consumer of the point's queue, in the point's
// mode, with the point's crash hook.
func (k *pointRun) start(o workerOpts) (*worker, error) {
	cfg := k.cfg
	k.mu.Lock()
	k.workers++
	cfg.ConnectionName = fmt.Sprintf("consumertest-%s-%d", cfg.Queue, k.workers)
	k.mu.Unlock()
	w := &worker{k: k, dead: make(chan struct{}), ended: make(chan struct{})}
	k.mu.Lock()
	k.lastEvent = time.Now()
	k.mu.Unlock()
	var ac amqp.Config
	if cfg.AMQPConfig != nil {
		ac = *cfg.AMQPConfig
	}
	dial := ac.Dial
	if dial == nil {
		dial = amqp.DefaultDial(30 * time.Second)
	}
	ac.Dial = func(network, addr string) (net.Conn, error) {
		select {
		case <-w.dead:
			return nil, errors.New("the worker crashed")
		default:
		}
		conn, err := dial(network, addr)
		if err != nil {
			return nil, err
		}
		w.mu.Lock()
		w.conns = append(w.conns, conn)
		w.mu.Unlock()
		return conn, nil
	}
	cfg.AMQPConfig = &ac
	if o.noHeartbeat {
		cfg.Testing.DisableHeartbeat = true
		// Where a group's keys are reserved in its transaction, its row
		// locks are the leases: Postgres ends the transaction once idle
		// for HandlerTimeout + StoreTimeout, which frees the keys.
		cfg.HandlerTimeout, cfg.StoreTimeout = slowTimeout, slowTimeout
	}
	if o.prefetch > 0 {
		cfg.Prefetch = o.prefetch
	}
	var (
		c   *consumer.Consumer
		err error
	)
	if k.mode.Batch() {
		c, err = consumer.NewBatch(k.subject.Store, w.batchHandler(o), &cfg)
	} else {
		c, err = consumer.New(k.subject.Store, w.handler(o), &cfg)
	}
	if err != nil {
		return nil, err
	}
	kit.SetCrash(c, w.hook)
	ctx, cancel := context.WithCancel(context.Background())
	w.cancel = cancel
	go func() {
		w.err = c.Run(ctx)
		close(w.ended)
	}()
	return w, nil
}

// hook is the worker's crash hook: it watches for the baseline, and
// crashes the worker when deliveries reach the point that have not
// crashed there yet.
func (w *worker) hook(at kit.At) bool {
	k := w.k
	p := k.p
	if at.Stage == kit.StageSettled {
		k.settled(at)
		return false
	}
	if p.watch != nil {
		k.mu.Lock()
		p.watch(at)
		k.mu.Unlock()
	}
	if p.stage == 0 || at.Stage != p.stage || at.Step != p.step {
		return false
	}
	if p.outboxRows {
		b, err := k.outbox.Pending(context.Background())
		if err != nil || b.Pending == 0 {
			return false
		}
	}
	k.mu.Lock()
	fresh := false
	for i, d := range at.Deliveries {
		id := copyOf(d.Headers)
		if k.crashed[id] {
			continue
		}
		k.crashed[id], fresh = true, true
		if at.TraceIDs[i] != "" {
			k.row.TraceIDs = append(k.row.TraceIDs, at.TraceIDs[i])
		}
	}
	if fresh {
		k.row.Reached = true
	}
	k.mu.Unlock()
	if fresh {
		w.die()
	}
	return fresh
}

// die kills the worker as a process dies, on the broker's side: its
// connections drop (the broker requeues what it had not acked) and its Run
// ends without reconnecting. The pipeline abandons the transactions.
func (w *worker) die() {
	w.once.Do(func() {
		close(w.dead)
		w.mu.Lock()
		for _, conn := range w.conns {
			_ = conn.Close()
		}
		w.mu.Unlock()
		w.cancel()
	})
}

// stop ends the worker's Run (a graceful stop, unless it crashed) and
// waits for it.
func (w *worker) stop() error {
	w.cancel()
	select {
	case <-w.ended:
		return w.err
	case <-time.After(w.k.cfg.WithDefaults().ShutdownTimeout + crashWait):
		return errors.New("the worker did not stop")
	}
}

// handler is the Subject's Handler as the worker runs it.
func (w *worker) handler(o workerOpts) consumer.Handler {
	h, name := w.k.subject.Handler, w.k.cfg.Name
	return func(ctx context.Context, tx pgx.Tx, d *consumer.Delivery) (consumer.Response, error) {
		o.enter.notify(d)
		resp, err := h(ctx, tx, d)
		if err == nil {
			o.hold.wait(name, tx, d)
		}
		return resp, err
	}
}

// batchHandler is the Subject's BatchHandler as the worker runs it; without
// one, a batch handler that calls its Handler on each delivery in turn.
func (w *worker) batchHandler(o workerOpts) consumer.BatchHandler {
	bh, name := w.k.subject.BatchHandler, w.k.cfg.Name
	if bh == nil {
		h := w.k.subject.Handler
		bh = func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
			resps := make([]consumer.Response, 0, len(ds))
			for _, d := range ds {
				resp, err := h(ctx, tx, d)
				if err != nil {
					return nil, err
				}
				resps = append(resps, resp)
			}
			return resps, nil
		}
	}
	return func(ctx context.Context, tx pgx.Tx, ds []*consumer.Delivery) ([]consumer.Response, error) {
		o.enter.notify(ds...)
		resps, err := bh(ctx, tx, ds)
		if err == nil {
			o.hold.wait(name, tx, ds...)
		}
		return resps, err
	}
}

// copyOf is the name of the copy a delivery is ("" if it is none of the
// kit's).
func copyOf(headers amqp.Table) string {
	s, _ := headers[copyHeader].(string)
	return s
}

// hold holds the first handler call of one of its copies once the handler
// returned without error, until released.
type hold struct {
	copies        map[string]bool
	once, freed   sync.Once
	held, release chan struct{}
	// scope is the key of the held delivery, and tx its transaction on the
	// server; set before held is closed.
	scope dedup.Scope
	tx    backendTx
	txErr error
}

// backendTx is a transaction as the server sees it: its backend and when it
// began. Through a transaction pooler (PgBouncer) the client connection's
// PID names no backend, and the backend outlives the transaction: the
// server is asked.
type backendTx struct {
	pid   uint32
	start time.Time
}

// serverTx is tx's backendTx.
func serverTx(ctx context.Context, tx pgx.Tx) (backendTx, error) {
	var b backendTx
	err := tx.QueryRow(ctx, "SELECT pid::bigint, xact_start FROM pg_stat_activity WHERE pid = pg_backend_pid()").Scan(&b.pid, &b.start)
	return b, err
}

// open reports whether b is still going: its backend is in that same
// transaction.
func (b backendTx) open(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (bool, error) {
	var open bool
	err := q.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND xact_start = $2)", int64(b.pid), b.start).Scan(&open)
	return open, err
}

func newHold() *hold {
	return &hold{copies: map[string]bool{}, held: make(chan struct{}), release: make(chan struct{})}
}

// wait holds the call, in tx, if it is the first one of h's copies (a nil
// h holds nothing).
func (h *hold) wait(name string, tx pgx.Tx, ds ...*consumer.Delivery) {
	if h == nil {
		return
	}
	for _, d := range ds {
		if !h.copies[copyOf(d.Headers)] {
			continue
		}
		first := false
		h.once.Do(func() {
			h.scope = dedup.Scope{Consumer: name, Tenant: d.Tenant, Key: d.Key}
			h.tx, h.txErr = serverTx(context.Background(), tx)
			close(h.held)
			first = true
		})
		if first {
			<-h.release
		}
		return
	}
}

// isHeld reports whether a call is held.
func (h *hold) isHeld() bool {
	select {
	case <-h.held:
		return true
	default:
		return false
	}
}

// free lets the held call go on.
func (h *hold) free() { h.freed.Do(func() { close(h.release) }) }

// signal is closed when a handler is called with one of its copies.
type signal struct {
	copies map[string]bool
	once   sync.Once
	c      chan struct{}
}

func newSignal() *signal { return &signal{copies: map[string]bool{}, c: make(chan struct{})} }

func (s *signal) notify(ds ...*consumer.Delivery) {
	if s == nil {
		return
	}
	for _, d := range ds {
		if s.copies[copyOf(d.Headers)] {
			s.once.Do(func() { close(s.c) })
		}
	}
}

// dialKit opens the kit's own connection, named name, to the first of url's
// addresses (one AMQP URL or several separated by commas) that answers.
func dialKit(url, name string, base *amqp.Config) (*amqp.Connection, error) {
	addrs, err := amqpdial.Parse(url)
	if err != nil {
		return nil, err
	}
	d := amqpdial.Dialer{Addrs: addrs, Name: name, Config: base}
	return d.Dial(context.Background())
}
