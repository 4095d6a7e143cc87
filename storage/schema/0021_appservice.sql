-- Application services (issue 26; docs/appservices.md): how far each service's transactions
-- have got, kept by the one process that pushes to services (the `appservice` worker when the
-- config has one, else the main process).
--
-- Every event on the events stream up to stream_ordering has been sent to the service or was
-- of no interest to it. A transaction is recorded (pending_txn_id, pending_upto) before it is
-- sent and cleared when the service accepts it: after a restart it is sent again with the same
-- ID and the same events, so the service (which deduplicates by ID) sees each event once.
CREATE TABLE appservice_stream_positions (
    as_id TEXT PRIMARY KEY,
    stream_ordering BIGINT NOT NULL,
    last_txn_id BIGINT NOT NULL DEFAULT 0,
    pending_txn_id BIGINT,
    pending_upto BIGINT,
    -- The backoff of a failing service, as destinations keeps it for servers.
    retry_last_ts BIGINT NOT NULL DEFAULT 0,
    retry_interval BIGINT NOT NULL DEFAULT 0,
    failure_ts BIGINT
);
