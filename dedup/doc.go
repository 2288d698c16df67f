// Package dedup is idemq's key store: idempotency keys claimed in Postgres
// before a message is handled, with three states and fenced leases.
//
// # The protocol
//
// A key is absent, in progress (a lease with a fencing token) or completed
// (with the stored result):
//
//	absent ──Reserve──▶ in_progress(token T) ──Complete(T) in the handler's tx──▶ completed(outcome, response)
//	                       │  ▲
//	                       │  └── Extend(T): heartbeat
//	                       └── Release(T), or the lease expires ──Reserve by another worker──▶ in_progress(T')
//
// Reserve is one atomic statement (INSERT … ON CONFLICT DO UPDATE … WHERE the
// lease expired … RETURNING): it creates the row, takes over an expired
// lease, or returns nothing, in which case the row is read and classified as
// Duplicate, Busy or KeyReuse. Every reservation writes a fresh token, and
// Complete, Release, Extend and Checkpoint carry it in their WHERE clause: a
// worker whose lease was taken over touches no row, gets ErrLeaseLost, and
// its transaction rolls back, so its effects never commit, however slow it was.
//
// Inspect reads a key's row. A row its holder gave up on (Release, with the
// reason it was given up for) reads as released (Record.Released,
// Record.ReleaseReason) until the next reservation takes it over; a
// rejection's reason is stored with its code and response (Result.Reason).
//
// # Scope, keys and fingerprints
//
// A key is unique per (consumer, tenant, key): a Scope, which Claim, Lease
// and Record carry and Inspect takes. ValidateKey rejects empty and
// malformed keys with ErrKeyRequired and ErrKeyInvalid. A Fingerprint (SHA-256
// of the significant content: the whole body, or canonical JSON of named
// fields with JSONFieldsFingerprint) tells a retry (same fingerprint) from a
// reused key (another one). With Config.HashKeys the table holds only a hash
// of each key. Scope.KeyHash gives a short hash for logs and spans.
//
// # Atomic phases
//
// Work in several steps that touch other systems runs each step with
// Store.Step, which commits the step's writes together with a recovery point;
// a retry skips the committed steps. Scope.DerivedKey (promoted on Lease)
// gives each step a deterministic key to hand to an external API.
//
// # Schema and retention
//
// The tables live in a Postgres schema of their own (default "idemq"),
// created and upgraded by schema.Migrate (package
// github.com/idemq/idemq/dedup/schema) or `idemq migrate`. Store.GC
// deletes completed keys older than the retention in bounded batches, oldest
// first, one instance per schema at a time; its GCOptions (the outbox's GC
// takes the same) pace a run (a pause after each batch), bound it, and can
// vacuum the table after it. It records the idemq.gc.* metrics on Config.MeterProvider, among them how far
// behind the retention horizon a run stopped (docs/operations.md).
package dedup
