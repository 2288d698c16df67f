// Package interop tests idemq with messages written by clients no one at
// idemq wrote: CloudEvents encoded by the cloudevents npm package and
// published with amqplib (testdata/node), consumed by a consumer keyed by
// consumer.KeyFromCloudEvents through the real RabbitMQ and Postgres.
//
// The tests need Node.js 20 or later on PATH (deploy/local/ensure-node.sh
// installs it; make test runs it) and the npm registry, or a cache filled
// before: the packages of testdata/node/package-lock.json are installed
// with npm ci into the user's cache directory (idemq/node/<lock hash>),
// never into the tree. A missing node fails the tests; it never skips them.
package interop
