// Package idemhttp is idemq's key store at the HTTP front door: a net/http
// middleware that applies the Idempotency-Key protocol to requests, with the
// same keys, leases, fencing and retention as the message consumers (package
// dedup), so that one key travels from a client's retry to a worker's effect.
//
// # The protocol
//
// A request with a guarded method (default POST and PATCH) must carry an
// Idempotency-Key header. As the Idempotency-Key draft has it, the header is
// an RFC 8941 sf-string ("k", parameters ignored), the key being its
// content; a value that does not start with a double quote is taken as the
// key as it is, so "k" and k are one key, k (Key gives it to the handler).
// The key is validated like a message key (1 to 255 bytes of UTF-8, no
// control characters); a missing or invalid key, or a malformed sf-string,
// answers 400 with an RFC 9457 problem body (application/problem+json)
// whose type links to Config.DocURL. A route wrapped with Optional instead
// of Require lets a request without a key through unguarded.
//
// The key is reserved, in its scope (Config.Consumer, the tenant of the
// request, the key), before the handler runs:
//
//   - while another request with the key runs: 409 Conflict with Retry-After;
//   - the key was used for another request (another method, path, query or
//     body: another fingerprint): 422 Unprocessable Content;
//   - the key is completed: its stored status, headers and body are replayed
//     exactly, with Idempotent-Replayed: true, and the handler does not run;
//   - else the handler runs, in a transaction (Tx) that holds the key: the
//     reservation is written in it and commits with the handler's effects
//     and the result, one commit per request. A concurrent request with the
//     key does not wait for that commit: the key's advisory lock, taken
//     first, sends it the 409 at once. Config.SeparateReservations reserves
//     the key with a commit of its own instead, under a lease a heartbeat
//     extends, visible as in progress while the handler runs.
//
// The handler writes its effects and its outbox messages (outbox.Enqueue
// with r.Context() and Tx(r)) in the request's transaction and its answer to
// the ResponseWriter, which holds it. When it returns, the middleware
// decides: a result (Config.Stored; default 2xx, 3xx and 402) is stored with
// the key's completion in that transaction, which commits, and only then
// does the answer leave; anything else (another 4xx: a request refused
// before the operation ran; a 5xx; a panic; a timeout) rolls back, releases
// the key and stores nothing, so that the retry, or the corrected request,
// runs again. Keep and Discard decide for one response. An informational
// answer (103 Early Hints) goes to the client as the handler writes it and
// is never stored; a 101 Switching Protocols cannot pass the guard (500,
// key released).
//
// With SeparateReservations the completion is fenced by the lease token: a
// handler so slow that its lease was taken over cannot commit. Completed keys are kept for the
// store's retention (dedup.Config.Retention, GC); a retry after it runs as
// a new request. See docs/http.md for the table of situations.
//
// # Tenants
//
// Config.Tenant returns the tenant of a request from its authenticated
// principal. By default every request is in the tenant "": the middleware
// never takes a tenant from a header on its own, since any client can set
// one. A tenant is held to the consumer's rule (dedup.ValidateTenant); one
// that breaks it answers 400 tenant_invalid before anything is reserved,
// rather than being accepted at the door and dead-lettered by the worker.
package idemhttp
