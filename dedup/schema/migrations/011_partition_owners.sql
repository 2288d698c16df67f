-- Which worker is the active consumer of each partition of a partitioned
-- queue (docs/ordering.md). RabbitMQ's single-active-consumer tells an
-- AMQP 0-9-1 client nothing of who is active: a consumer knows it is when it
-- gets deliveries. So the consumer of a partition that gets one records it
-- here, at most every few seconds: the owner (its connection name, host
-- and process), since when it owns the partition, and when it last said so.
-- `idemq order status` and the UI's overview read it; a row whose seen_at
-- is old belongs to an idle partition or to a worker that is gone.
CREATE TABLE {{.schema}}.partition_owners (
    consumer text        NOT NULL,
    queue    text        NOT NULL,
    owner    text        NOT NULL,
    since    timestamptz NOT NULL DEFAULT now(),
    seen_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, queue)
);

---- create above / drop below ----

DROP TABLE {{.schema}}.partition_owners;
