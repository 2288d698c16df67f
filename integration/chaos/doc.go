// Package chaos is idemq's soak test: "nothing lost, nothing doubled"
// while the processes, the broker, the database and the network fail.
// It has no code of its own; everything is in its tests.
//
// # What it runs
//
// A plan of N messages (30% duplicates, some in bursts of 20 copies
// published at once from 20 goroutines; 1% poison; 2% business rejections;
// 5% of the operations failing with an infrastructure error on their first
// attempt or two; four tenants, some with odd characters; some keys in the
// Idempotency-Key header; twins, whose handler forwards two outbox rows with
// one explicit message_id, the second to a bound route or to one no queue is
// bound to; messages whose header frame is 300 bytes under frame_max,
// failing once so that their retry copy must be trimmed, and 64 bytes under
// it, always failing so that no copy fits) is published with confirms.
// Several worker processes (the test binary started again with
// IDEMQ_CHAOS_WORKER set) consume it with consumer.Consumer: one handles a
// delivery at a time, one uses group commit, one optimistic group commit.
// The handler writes a ledger row and forwards the message through the
// transactional outbox (outbox.Enqueue in the handler's transaction) to an
// exchange bound to an output queue; each worker also runs an outbox.Relay.
// The workers reach Postgres and RabbitMQ through toxiproxy.
//
// While it runs, faults are injected at random, bounded intervals: SIGKILL
// of a worker (then a restart), rabbitmqctl close_all_connections,
// rabbitmqctl stop_app / start_app, pg_terminate_backend of the workers'
// sessions (found by their application_name), a Postgres restart (-m fast)
// and a stop -m immediate followed by a start, and toxiproxy toxics on
// either proxy: latency, timeout (a black hole) and reset_peer; and the
// deletion of a retry tier or of the DLQ (while it is empty and the workers
// are frozen with SIGSTOP, the DLQ's dead letters read out and kept first),
// held until a copy routed to it failed (copy_failed), then declared again
// as the topology declares it. Each fault restores what it broke before the
// next one, and the test's cleanups restore everything again (start_app,
// Postgres start, toxics removed), also after a failure.
//
// # What it checks
//
// At the end, from the database and the queues: every operation ended as its
// kind says — processed (exactly one ledger row, its key completed, one
// outbox row, its claim-derived message_id on the output queue with the body
// it was sent with; a twin's second row on the twin queue, or, when
// unroutable, parked and never marked published; a near_frame_max op
// processed from a copy that dropped its tracestate), rejected (completed,
// no effect) or dead-lettered (in the DLQ with its reason, permanent_error
// or headers_too_large, and an error text); no row marked published is
// missing from its queue; no key has two effects and no effect lacks its
// operation; no key is left under a lease; the outbox is drained (the
// unroutable twins parked); the work queue and the retry tiers are empty;
// the DLQ holds only the ops meant for it; no queue deletion took a message;
// the output queue holds only known message ids (copies of one id are
// allowed: the relay publishes at least once). It prints a report: messages,
// effects, outcomes, retries, faults by kind with the recovery time after
// each one, and fails on any loss or double, on a stall, on a worker that
// exits by itself, and on a data race or panic in a worker's log.
//
// # The ordered soak
//
// TestSoakOrderedShort (every go test ./...), TestSoakOrdered (make chaos)
// and TestSoakOrderedCluster (make cluster) run the same machinery on
// entities whose events must take effect once each and in order
// (ordered_test.go): each entity's events carry x-ordering-key and
// x-sequence, are published to a partitioned queue's exchange (4
// partitions) moved early or late by up to three rounds, with 20%
// duplicates and 5% of events failing their first attempt or two; the
// workers consume every partition with ordering on. Its faults are the
// soak's but the queue deletions, plus a SIGKILL of the worker that is the
// single active consumer of a partition (found with rabbitmqctl). It
// checks, per entity, that the ledger rows in the order they were written
// are exactly 1…N, that every entity's last applied sequence is N, no key
// is blocked and no dead letter made, and that the forwarded stream holds
// each entity's events in order, numbered again by the outbox as at the
// start, a relay's repeat of a message already there the only copy.
//
// # The two sizes
//
// TestSoakShort runs in every go test ./...: 3,000 messages, three workers,
// every fault kind once, in about a minute and a half. TestSoak, behind the
// build tag chaos (make chaos), publishes 50,000 messages by default
// (-chaos.messages or IDEMQ_CHAOS_MESSAGES) through four workers and injects
// faults until every message has settled. IDEMQ_CHAOS_SEED replays a plan
// and a fault sequence; IDEMQ_CHAOS_REPORT names a file for the report.
// TestSoakShortThroughPgBouncer, also in every go test ./..., runs 1,500
// messages with the workers' Postgres traffic through toxiproxy and a
// PgBouncer in transaction pooling mode that the soak starts itself on
// 127.0.0.1:6442 (pgbouncer_test.go), the relays LISTENing on a direct
// connection, and injects once each fault on the way to Postgres, PgBouncer's
// own SIGKILL and restart and Postgres's restarts among them.
//
// # Services
//
// The faults would break every other test using the same Postgres and
// RabbitMQ, and go test ./... runs packages in parallel. So by default
// the soak uses services of its own, created on first use, started when
// down and stopped again at the end of the test process that started them:
// a Postgres cluster "15 idemqchaos" on 127.0.0.1:5442 (pg_createcluster)
// and a RabbitMQ node idemq-chaos@localhost on 127.0.0.1:5682 (data under
// /var/lib/rabbitmq/idemq-chaos). It needs the Debian postgresql,
// rabbitmq-server and pgbouncer packages, and root (or the postgres and rabbitmq users'
// rights). IDEMQ_CHAOS_SERVICES=shared runs the faults against the services
// of IDEMQ_TEST_POSTGRES_URL and IDEMQ_TEST_AMQP_URL instead (cluster
// IDEMQ_CHAOS_PG_CLUSTER, default "15 main"; node IDEMQ_CHAOS_RABBIT_NODE),
// on a machine that runs nothing else.
//
// # The cluster
//
// TestSoakCluster (build tag cluster, make cluster) runs the same plan,
// workers and checks on the production topology, created for the run and
// removed after it (cluster_test.go, patroni_test.go): three RabbitMQ nodes
// idemq-c1..c3@localhost on 127.0.0.1:5701-5703, joined into one cluster,
// every queue a quorum queue with a member on each; three Postgres members
// pg1..pg3 under Patroni on 5452-5454 (REST API 8452-8454) in synchronous
// mode, with one etcd on 23790, all under /var/lib/postgresql/idemq-patroni
// and run as the postgres user. The workers get the three AMQP URLs and the
// multi-host Postgres URL with target_session_attrs=read-write, no
// toxiproxy. Its faults: the node leading the work queue stopped (stop_app,
// then its VM killed) and started again later; the Patroni leader's
// postmaster killed (SIGKILL), Patroni promoting the synchronous standby,
// and later the old leader seen back as a replica (rewound by Patroni, or
// patronictl reinit); a planned patronictl switchover; twice each.
// TestFailoverLosesOnlyAsynchronousReservations shows on the same Patroni
// cluster that a failover loses only reservations (synchronous_commit =
// off), that their holders' completions are fenced, and that the old leader
// comes back as a replica without them. TestClusterDown removes what a
// killed run left (make cluster-down).
//
// toxiproxy-server is built once by toxiproxy/build.sh, from a module of
// its own, into ~/.cache/idemq; IDEMQ_CHAOS_TOXIPROXY names a prebuilt one.
package chaos
