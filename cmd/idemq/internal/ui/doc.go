// Package ui is idemq's web UI for operators (`idemq ui`): server-rendered
// pages over the key store, the queues and the outbox, with what they need
// embedded in the binary (templates and a style sheet; no script).
//
// # Pages
//
//   - / (overview): each consumer scope's keys (completed and rejected in
//     the last hour and day, leases held with the oldest one's age, expired
//     leases waiting for takeover, released keys), each queue's depth and
//     consumers, its retry tiers' and DLQ's depths (the DLQ's by reason), and
//     the outbox backlog. It refreshes itself. A partitioned queue
//     (Topology.Partitions) is shown partition by partition, each with its
//     depths and its active consumer as the consumers record it
//     (internal/ordering.Owners), marked when its ready messages do not move,
//     and with its consumer's blocked ordering keys (ordering.Blocked).
//   - /dlq?queue=Q: the dead letters of Q (or of a partition, Q.p0) by
//     reason, each letter's headers and body (/dlq/letter), and their
//     replay: one, a selection or all of one reason, after a confirmation
//     page, as a job whose progress page refreshes itself (/jobs).
//   - /keys: the row of one key (consumer, tenant, key), as `idemq keys
//     inspect` shows it, with its stored response and a link to its first
//     processing's trace in Jaeger.
//   - /outbox: pending and parked rows; unpark one, a selection or all, after
//     a confirmation page.
//   - /duplicates and /trace?id=TRACEID, with Config.JaegerURL: the recent
//     suppressed duplicates per consumer scope, each with its trace and the
//     original processing's, and one trace as a timeline whose span links
//     open the linked trace, read from Jaeger's query API (package
//     cmd/idemq/internal/jaeger), which any Jaeger serves, with or without
//     its own UI.
//
// # Safety
//
// Every request's Host must name the server (internal/hostguard: the listen
// address, localhost, Config.AllowHosts), else 421, so that a web page whose
// name is rebound to 127.0.0.1 reads nothing. The CLI binds loopback unless a
// token is configured (CheckListen). With a token, every page wants it, as a
// bearer token (any case of the scheme) or from a session the login form
// opens: a random id held in the server's memory, ended by logout, by 1 h
// idle or 12 h in all, and by a restart. Every change is a POST that carries a CSRF token
// bound to a cookie, and is refused cross-origin; Config.ReadOnly refuses
// them all. No connection URL is ever rendered (errors are redacted), and raw
// keys appear only where the operator typed them, unless Config.ShowKeys:
// elsewhere a key is its short hash, the key_hash of the logs and spans.
package ui
