package idemhttp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/deduptest"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/internal/testdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// api is a payments API under test: POST /orders creates an order in the
// request's transaction, DELETE /orders/{id} deletes one.
type api struct {
	t      *testing.T
	pool   *pgxpool.Pool
	store  *dedup.Store
	schema string
	srv    *httptest.Server
	// before, when set, runs at the start of every guarded handler.
	before func(w http.ResponseWriter, r *http.Request) bool
}

// newAPI starts the API behind a middleware configured by cfg (Consumer
// defaults to "payments-api").
func newAPI(t *testing.T, cfg idemhttp.Config, storeCfg *dedup.Config) *api {
	t.Helper()
	pool := testdb.Pool(t, 32)
	store := deduptest.Store(t, pool, storeCfg)
	a := &api{t: t, pool: pool, store: store, schema: store.Config().Schema}
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+a.schema+`.orders (id serial PRIMARY KEY, amount int NOT NULL, note text)`); err != nil {
		t.Fatal(err)
	}
	if cfg.Consumer == "" {
		cfg.Consumer = "payments-api"
	}
	// The panics the tests cause are logged; keep them out of the output.
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	mw, err := idemhttp.New(store, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /orders", a.create)
	mux.HandleFunc("DELETE /orders/{id}", a.delete)
	mux.HandleFunc("GET /orders", a.list)
	a.srv = httptest.NewServer(mw.Require(mux))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *api) create(w http.ResponseWriter, r *http.Request) {
	if a.before != nil && !a.before(w, r) {
		return
	}
	var in struct {
		Amount int    `json:"amount"`
		Note   string `json:"note"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Amount <= 0 {
		http.Error(w, `{"error":"amount must be positive"}`, http.StatusBadRequest)
		return
	}
	if in.Amount > 10_000 {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusPaymentRequired)
		fmt.Fprint(w, `{"error":"insufficient funds"}`)
		return
	}
	var id int
	if err := idemhttp.Tx(r).QueryRow(r.Context(), `INSERT INTO `+a.schema+`.orders (amount, note) VALUES ($1, $2) RETURNING id`, in.Amount, in.Note).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+strconv.Itoa(id))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"order_id":%d}`, id)
}

func (a *api) delete(w http.ResponseWriter, r *http.Request) {
	// Unguarded, the handler has no transaction of the request.
	exec := a.pool.Exec
	if tx := idemhttp.Tx(r); tx != nil {
		exec = tx.Exec
	}
	tag, err := exec(r.Context(), `DELETE FROM `+a.schema+`.orders WHERE id = $1`, r.PathValue("id"))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if tag.RowsAffected() == 0 {
		http.Error(w, "no such order", http.StatusNotFound)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (a *api) list(w http.ResponseWriter, r *http.Request) {
	if idemhttp.Tx(r) != nil {
		http.Error(w, "a GET got a transaction", http.StatusInternalServerError)
		return
	}
	fmt.Fprint(w, a.orders())
}

// orders counts the orders.
func (a *api) orders() int {
	a.t.Helper()
	var n int
	if err := a.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+a.schema+`.orders`).Scan(&n); err != nil {
		a.t.Fatal(err)
	}
	return n
}

// reply is a response, read whole.
type reply struct {
	status int
	header http.Header
	body   string
}

func (r reply) replayed() bool { return r.header.Get(idemhttp.ReplayedHeader) == "true" }

// do sends one request; headers alternate name and value.
func (a *api) do(method, path, key, body string, headers ...string) reply {
	a.t.Helper()
	rep, err := send(a.srv.Client(), a.srv.URL, method, path, key, body, headers...)
	if err != nil {
		a.t.Fatal(err)
	}
	return rep
}

// sendRaw writes one request by hand on a new connection, for what
// net/http's client refuses to send, and returns the status line.
func sendRaw(t *testing.T, base, request string) string {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, request); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(line)
}

func send(c *http.Client, base, method, path, key, body string, headers ...string) (reply, error) {
	req, err := http.NewRequest(method, base+path, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if key != "" {
		req.Header.Set(idemhttp.DefaultHeader, key)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Add(headers[i], headers[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, header: resp.Header, body: string(b)}, nil
}

// problemOf decodes a problem body, checking its media type.
func problemOf(t *testing.T, r reply) idemhttp.Problem {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("content type %q, want application/problem+json (body %s)", ct, r.body)
	}
	var p idemhttp.Problem
	if err := json.Unmarshal([]byte(r.body), &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	if p.Status != r.status {
		t.Fatalf("problem status %d, response status %d", p.Status, r.status)
	}
	return p
}

// keyRow reads the key's row in the default tenant.
func (a *api) keyRow(key string) (*dedup.Record, error) {
	return a.store.Inspect(context.Background(), dedup.Scope{Consumer: "payments-api", Key: key})
}

// newServer serves h until the test ends.
func newServer(t *testing.T, h http.Handler) *httptest.Server {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}
