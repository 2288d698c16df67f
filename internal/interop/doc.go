// Package interop owns the message formats of the frameworks idemq meets on
// RabbitMQ, in one place: where MassTransit, NServiceBus, Wolverine and
// CloudEvents publishers put a message's identity and its payload, read by
// the consumer's key presets (consumer.KeyPreset) and by the operator's
// tools.
//
// Each preset reads a delivery once: its key (what makes two messages the
// same operation, as the framework sees it) and its payload (what the
// fingerprint is computed over, without the fields a framework rewrites on
// every send, such as MassTransit's sentTime and host). A body is decoded at
// most once. Sources for every field name are in docs/interop.md.
package interop
