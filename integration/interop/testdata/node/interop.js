// CloudEvents through RabbitMQ with clients no one at idemq wrote: the
// cloudevents npm package encodes and decodes the events, amqplib talks
// AMQP 0-9-1. Run by integration/interop (node_test.go).
//
//   node interop.js publish   publishes the events of the key-preset test
//                             to $QUEUE, one message each, with confirms
//   node interop.js read N    takes N messages from $QUEUE, decodes each
//                             with the SDK and prints it as a JSON line
//
// The SDK has bindings for HTTP, Kafka and MQTT, none for AMQP: binary mode
// carries the HTTP binding's ce- headers, or renamed to the AMQP binding's
// cloudEvents_ prefix; the content-type header goes into the AMQP
// content_type property.
"use strict";

const crypto = require("crypto");
const amqplib = require("amqplib");
const { CloudEvent, HTTP } = require("cloudevents");

const url = process.env.AMQP_URL || "amqp://guest:guest@127.0.0.1:5672/";
const queue = process.env.QUEUE;

// toAMQP turns the SDK's HTTP message into an AMQP publish: content-type
// into the property, the other headers (ce-*) as they are or with prefix.
function toAMQP(message, prefix) {
  const headers = {};
  let contentType;
  for (const [name, value] of Object.entries(message.headers)) {
    if (name.toLowerCase() === "content-type") {
      contentType = value;
    } else if (prefix && name.startsWith("ce-")) {
      headers[prefix + name.slice(3)] = value;
    } else {
      headers[name] = value;
    }
  }
  return {
    body: Buffer.from(message.body),
    options: { contentType, headers, messageId: crypto.randomUUID(), persistent: true },
  };
}

// fromAMQP is the reverse: the HTTP message the SDK's toEvent reads.
function fromAMQP(msg) {
  const headers = {};
  for (const [name, value] of Object.entries(msg.properties.headers || {})) {
    const lower = name.toLowerCase();
    if (lower.startsWith("cloudevents_") || lower.startsWith("cloudevents:")) {
      headers["ce-" + lower.slice("cloudevents_".length)] = String(value);
    } else {
      headers[lower] = String(value);
    }
  }
  if (msg.properties.contentType) {
    headers["content-type"] = msg.properties.contentType;
  }
  return { headers, body: msg.content.toString("utf8") };
}

async function publish(ch) {
  const placed = "com.example.order.placed";
  const first = new CloudEvent({ source: "/node/orders", id: "order-1", type: placed, data: { orderId: 1, total: 42.5 } });
  const second = new CloudEvent({ source: "/node/orders", id: "order-2", type: placed, data: { orderId: 2, total: 7 } });
  const billing = new CloudEvent({ source: "/node/billing", id: "order-1", type: "com.example.invoice.issued", data: { invoice: 9 } });
  const sends = [
    toAMQP(HTTP.binary(first)), //                  processed
    toAMQP(HTTP.binary(first), "cloudEvents_"), //  the same event resent: duplicate
    toAMQP(HTTP.structured(second)), //             processed
    toAMQP(HTTP.structured(second)), //             resent: duplicate
    toAMQP(HTTP.binary(billing)), //                same id, another source: processed
    toAMQP(HTTP.structured(first)), //              the first event in the other mode: duplicate
  ];
  for (const s of sends) {
    ch.sendToQueue(queue, s.body, s.options);
    await ch.waitForConfirms();
  }
}

async function read(ch, n) {
  for (let got = 0; got < n; ) {
    const msg = await ch.get(queue, { noAck: true });
    if (!msg) {
      await new Promise((resolve) => setTimeout(resolve, 50)); // poll the queue
      continue;
    }
    const ev = HTTP.toEvent(fromAMQP(msg));
    ev.validate();
    process.stdout.write(JSON.stringify({
      specversion: ev.specversion, id: ev.id, source: ev.source, type: ev.type,
      datacontenttype: ev.datacontenttype, data: ev.data, message_id: msg.properties.messageId,
    }) + "\n");
    got++;
  }
}

async function main() {
  const [cmd, arg] = process.argv.slice(2);
  if (!queue) throw new Error("QUEUE is not set");
  const conn = await amqplib.connect(url);
  try {
    const ch = await conn.createConfirmChannel();
    if (cmd === "publish") {
      await publish(ch);
    } else if (cmd === "read") {
      await read(ch, Number(arg));
    } else {
      throw new Error(`unknown command ${cmd}`);
    }
    await ch.close();
  } finally {
    await conn.close();
  }
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
