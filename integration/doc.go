// Package integration holds end-to-end tests of idemq against real
// Postgres, RabbitMQ and Jaeger. It has no code of its own.
//
// The services come from IDEMQ_TEST_POSTGRES_URL and IDEMQ_TEST_AMQP_URL
// (local defaults, see internal/testdb and internal/testamqp). The tracing
// tests start the local Jaeger of deploy/jaeger when it is not already
// answering (building it first takes about 10 minutes: run
// deploy/jaeger/build.sh once, or give go test a -timeout of 30m), and stop
// it afterwards; IDEMQ_TEST_JAEGER_QUERY_URL and IDEMQ_TEST_OTLP_ENDPOINT
// point them at another Jaeger instead.
package integration
