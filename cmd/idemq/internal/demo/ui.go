package demo

import (
	"context"
	"fmt"
	"net"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemq/idemq/cmd/idemq/internal/jaeger"
	"github.com/idemq/idemq/cmd/idemq/internal/ui"
	"github.com/idemq/idemq/internal/amqpdial"
)

// serveUI leaves the UI running on the demo's schema and queue, with one
// worker so that the dead letters an operator replays are handled, until
// ctx ends (Ctrl-C).
func (r *runner) serveUI(ctx context.Context, rep Report) error {
	if err := ui.CheckListen(r.o.UIListen, false); err != nil {
		return fmt.Errorf("demo: --ui-listen: %w", err)
	}
	pool, err := newPool(ctx, r.o.PostgresURL, 8, "idemq-demo-ui", false)
	if err != nil {
		return fmt.Errorf("demo: ui: %w", err)
	}
	defer pool.Close()
	srv, err := ui.New(ui.Config{
		Pool: pool, Schema: r.o.Schema,
		Dial: func() (*amqp.Connection, error) {
			return amqpdial.DialURL(context.Background(), r.o.AMQPURL, "idemq-demo-ui", 5*time.Second)
		},
		Queues:    []ui.Queue{{Topology: r.topo, Consumer: consumerName}},
		JaegerURL: r.o.JaegerURL,
		Listen:    r.o.UIListen,
	})
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	if err := r.startWorker(); err != nil {
		return err
	}
	defer r.stopWorkers()
	ln, err := net.Listen("tcp", r.o.UIListen)
	if err != nil {
		return fmt.Errorf("demo: ui: listen on %s: %w", r.o.UIListen, err)
	}
	fmt.Fprintf(r.w, "\nidemq ui: serving http://%s/ on the demo's data (schema %s, queue %s), with one worker\n",
		ln.Addr(), r.o.Schema, r.o.Queue)
	fmt.Fprintln(r.w, "  replay its dead letters, look up a key (consumer "+consumerName+"); Ctrl-C stops the UI and the worker")
	r.printUILinks("http://"+ln.Addr().String(), rep)
	return ui.Serve(ctx, ln, srv)
}

// printUILinks prints the UI's pages of the report's duplicate: its trace,
// the original's, and the Duplicates page (which read Jaeger's query API).
func (r *runner) printUILinks(base string, rep Report) {
	if r.o.JaegerURL == "" {
		fmt.Fprintln(r.w, "  duplicates and their traces: no Jaeger, so none to show ("+jaegerHint+")")
		return
	}
	if rep.DuplicateTraceID != "" {
		note := ""
		if !rep.TraceLinkChecked {
			note = " (not found in Jaeger: its worker may have been killed before it exported its spans)"
		}
		fmt.Fprintf(r.w, "  a duplicate:       %s%s\n", jaeger.TracePageURL(base, rep.DuplicateTraceID), note)
		fmt.Fprintf(r.w, "  its original:      %s\n", jaeger.TracePageURL(base, rep.OriginalTraceID))
	}
	fmt.Fprintf(r.w, "  all duplicates:    %s%s (from Jaeger at %s)\n", base, jaeger.DuplicatesPath, r.o.JaegerURL)
}
