-- The headers of a stored response, for protocols whose answer has them: the
-- HTTP middleware (dedup/idemhttp) replays a completed request's status,
-- headers and body exactly. A JSON object from header name to its list of
-- values; NULL when the result has none (every message consumer's). Nullable
-- without a default: adding it rewrites nothing.
ALTER TABLE {{.schema}}.keys ADD COLUMN response_headers jsonb;

---- create above / drop below ----

ALTER TABLE {{.schema}}.keys DROP COLUMN response_headers;
