package idemhttp_test

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemq/idemq/dedup"
	"github.com/idemq/idemq/dedup/idemhttp"
	"github.com/idemq/idemq/dedup/schema"
)

// A payments endpoint behind the middleware: the charge is written in the
// request's transaction, which commits with the key's completion before the
// answer leaves; the client's retry gets the same answer replayed, a reused
// key gets 422, a missing key 400.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("IDEMQ_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	dbSchema := fmt.Sprintf("idemq_example_http_%d", os.Getpid()) // one per run
	if err := schema.Migrate(ctx, pool, dbSchema); err != nil {
		log.Fatal(err)
	}
	defer pool.Exec(ctx, "DROP SCHEMA "+dbSchema+" CASCADE") //nolint:errcheck
	if _, err := pool.Exec(ctx, "CREATE TABLE "+dbSchema+".charges (id serial PRIMARY KEY, body text)"); err != nil {
		log.Fatal(err)
	}
	store, err := dedup.NewStore(pool, &dedup.Config{Schema: dbSchema})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idemhttp.New(store, &idemhttp.Config{
		Consumer: "payments-api",
		DocURL:   "https://api.example.com/docs/idempotency",
		// Tenant: func(r *http.Request) (string, error) { return principal(r) },
	})
	if err != nil {
		log.Fatal(err)
	}
	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var id int
		err := idemhttp.Tx(r).QueryRow(r.Context(), "INSERT INTO "+dbSchema+".charges (body) VALUES ($1) RETURNING id", body).Scan(&id)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: not stored, the retry runs
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge_id":%d}`, id)
	})
	srv := httptest.NewServer(mw.Require(charge))
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest("POST", srv.URL+"/charges", strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d replayed=%q %s\n", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b)
	}
	post("7f3c1e8a-charge", `{"amount":4990}`) // the first request
	post("7f3c1e8a-charge", `{"amount":4990}`) // the client's retry
	post("7f3c1e8a-charge", `{"amount":9800}`) // the same key, another body
	post("", `{"amount":4990}`)                // no key
	var charges int
	_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+dbSchema+".charges").Scan(&charges)
	fmt.Println("charges:", charges)
	// Output:
	// 201 replayed="" {"charge_id":1}
	// 201 replayed="true" {"charge_id":1}
	// 422 replayed="" {"type":"https://api.example.com/docs/idempotency#idempotency_key_reuse","title":"Unprocessable Entity","status":422,"detail":"this key was first used for another request; use a new key for a new operation","code":"idempotency_key_reuse"}
	// 400 replayed="" {"type":"https://api.example.com/docs/idempotency#idempotency_key_required","title":"Bad Request","status":400,"detail":"this request needs an Idempotency-Key header: a unique key per operation, the same on every retry","code":"idempotency_key_required"}
	// charges: 1
}
