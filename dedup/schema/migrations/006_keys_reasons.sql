-- What the row says about why: the reason a business rejection gave
-- (consumer.Reject's reason, replayed to duplicates with the code and body),
-- and the reason a worker gave up its lease (Release: permanent_error,
-- max_attempts_exceeded, retried). A row is released while it is in progress
-- with no lease token (Release clears it, every reservation writes one);
-- release_reason says why, and is cleared by the takeover and the completion.
-- Both columns are nullable without a default: adding them rewrites nothing.
ALTER TABLE {{.schema}}.keys ADD COLUMN response_reason text;
ALTER TABLE {{.schema}}.keys ADD COLUMN release_reason text;

---- create above / drop below ----

ALTER TABLE {{.schema}}.keys DROP COLUMN release_reason;
ALTER TABLE {{.schema}}.keys DROP COLUMN response_reason;
